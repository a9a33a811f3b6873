"""OLMo-core's own Trainer recorded through replay.torch.olmo_core.ReplayCallback.

One module fixture trains six runs of a tiny `olmo3_1M` (~52k parameters, 512 tokens) on a numpy
token file made here, on the CPU in this process, in nine fits of OLMo-core's Trainer (each saving
OLMo-core's own checkpoints every 3 steps):

    a, a2   10 steps each
    b       5 steps, then a second fit that OLMo-core resumes from its own step-5 checkpoint
    lr      10 steps; from step K on the learning rate is doubled (a test callback)
    refeed  as b, but the resumed loader starts one batch early (an off-by-one resume): step K
            is fed the batch of step K - 1 again
    crash   dies at step K; a second fit resumes from the step-3 checkpoint"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if importlib.util.find_spec("olmo_core") is None:
    pytest.skip("ai2-olmo-core is not installed (pip install -e '.[olmo-core]')", allow_module_level=True)

import replay.torch  # noqa: E402
import traces  # noqa: E402
from tests.cli_util import invoke  # noqa: E402

VOCAB, SEQ, BATCH, STEPS, K, SAVE_EVERY = 512, 16, 4, 10, 5, 3  # tests/torch/olmo_core_runs.py's


def instances(run):
    from replay.torch.olmo_core import instances

    return instances(run)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from tests.torch import olmo_core_runs

    assert (olmo_core_runs.VOCAB, olmo_core_runs.SEQ, olmo_core_runs.BATCH, olmo_core_runs.STEPS,
            olmo_core_runs.K, olmo_core_runs.SAVE_EVERY) == (VOCAB, SEQ, BATCH, STEPS, K, SAVE_EVERY)
    root = tmp_path_factory.mktemp("olmo_core")
    (root / "logged.json").write_text(json.dumps(olmo_core_runs.train_all(root)))
    return root


def _same(x, y) -> bool:
    return (x.metrics.tobytes(), x.example_hashes.tobytes(), x.fingerprints.tobytes()) == (
        y.metrics.tobytes(), y.example_hashes.tobytes(), y.fingerprints.tobytes())


@pytest.mark.slow
def test_two_clean_runs_record_bit_identical_traces(runs):
    ra, rb = traces.Run.open(runs / "a"), traces.Run.open(runs / "a2")
    assert ra.status == rb.status == "complete" and len(ra.trace) == len(rb.trace) == STEPS
    assert ra.schema == rb.schema and len(ra.schema.tensors) > 100, len(ra.schema.tensors)
    for k in range(STEPS):
        x, y = ra.trace.read(k), rb.trace.read(k)
        assert _same(x, y) and x.rng.tobytes() == y.rng.tobytes(), k
    result = invoke("bisect", str(runs / "a"), str(runs / "a2"), "--no-refine", "--json")
    assert result.exit_code == 0, result.output
    fed = instances(runs / "a")
    assert fed is not None and fed.shape == (STEPS, BATCH)
    np.testing.assert_array_equal(fed, instances(runs / "a2"))


@pytest.mark.slow
def test_a_run_resumed_from_olmo_cores_checkpoint_trains_bit_identically_one_rng_draw_ahead(runs):
    """b stopped at step K and OLMo-core resumed it from its own checkpoint: every metric, example
    and tensor is the uninterrupted run's, but torch's global RNG is one draw ahead from step K on:
    the restore comes before the epoch's torch DataLoader iterator is made, which draws its base
    seed from the global generator (the uninterrupted run drew it before step 0). bisect says rng."""
    ra, rb = traces.Run.open(runs / "a"), traces.Run.open(runs / "b")
    assert rb.status == "complete" and len(rb.trace) == STEPS
    assert all(_same(ra.trace.read(k), rb.trace.read(k)) for k in range(STEPS))
    assert [ra.trace.read(k).rng.tobytes() == rb.trace.read(k).rng.tobytes() for k in range(STEPS)] == [
        k < K for k in range(STEPS)]
    saved = torch.load(runs / "olmo" / "b" / f"step{K}" / "train" / "rank0.pt", weights_only=False)
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(saved["rng"]["torch"]["state"])
        torch.empty((), dtype=torch.int64).random_()  # the DataLoader iterator's base seed
        np.testing.assert_array_equal(rb.trace.read(K).rng, replay.torch.step.rng_words())
    result = invoke("bisect", str(runs / "a"), str(runs / "b"), "--no-refine", "--json")
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert (report["first_step"], report["cause"]) == (K, "rng"), report
    np.testing.assert_array_equal(instances(runs / "a"), instances(runs / "b"))


@pytest.mark.slow
def test_a_fit_resumed_from_a_checkpoint_before_the_crash_stops_the_recording_not_the_training(runs):
    """crash died at step K, after its step-3 checkpoint; OLMo-core resumed it from there, so steps 3..
    were recorded again, and they differ (the RNG hash, one draw ahead as above): the recording stops
    with one logged error that says why, steps 0..K-1 as recorded, and the training goes on to its end."""
    run, ra = traces.Run.open(runs / "crash"), traces.Run.open(runs / "a")
    assert run.status != "complete" and run.trace.end == K
    assert all(_same(run.trace.read(k), ra.trace.read(k)) for k in range(K))
    np.testing.assert_array_equal(instances(runs / "crash"), instances(runs / "a")[:K])
    (line,) = json.loads((runs / "logged.json").read_text())
    assert f"step {SAVE_EVERY} is already recorded with different content" in line and "one draw ahead" in line, line
    assert str(runs / "crash") in line and "stops here" in line, line
    assert (runs / "olmo" / "crash" / f"step{STEPS}").is_dir()  # OLMo-core's checkpoint at the end of training
    assert [c["step"] for c in json.loads((runs / "crash" / "run.json").read_text())["olmo_core"]["checkpoints"]] == [
        0, SAVE_EVERY]


@pytest.mark.slow
def test_manifest_holds_the_loaders_world_size_seed_fingerprint_and_batches(runs):
    manifest = json.loads((runs / "b" / "run.json").read_text())
    section = manifest["olmo_core"]
    first, second = section["segments"]
    from tests.torch import olmo_core_runs

    fingerprint = olmo_core_runs.dataset(runs).fingerprint
    for seg in (first, second):
        assert (seg["world_size"], seg["rank"], seg["seed"], seg["dataset_fingerprint"]) == (1, 0, 0, fingerprint)
    assert (first["start_step"], first["batches_processed"], first["end_step"], first["batches_processed_end"]) == (0, 0, K, K)
    assert (second["start_step"], second["resumed_from"], second["batches_processed"]) == (K, K, K)
    assert (second["end_step"], second["batches_processed_end"]) == (STEPS, STEPS)
    # OLMo-core's own: before step 0, every SAVE_EVERY steps (saved in post_train_batch), at each fit's end
    assert [c["step"] for c in section["checkpoints"]] == sorted({0, K, STEPS, *range(0, STEPS, SAVE_EVERY)})
    assert all(Path(c["path"]).name == f"step{c['step']}" for c in section["checkpoints"])
    assert manifest["dataset_size"] == 64  # instances per epoch: audit's epochs


@pytest.mark.slow
def test_example_hashes_are_replay_torchs_of_the_instances_fed(runs):
    """The recorded hashes are replay.torch's of the rows OLMo-core's dataset holds at the recorded
    instance indices: the run says which instances it fed, and the hashes pair with any run's."""
    from tests.torch import olmo_core_runs

    ds, fed, trace = olmo_core_runs.dataset(runs), instances(runs / "a"), traces.Run.open(runs / "a").trace
    assert fed.shape == (STEPS, BATCH) and len(np.unique(fed)) == STEPS * BATCH  # one epoch: no instance twice
    for k in range(STEPS):
        rows = torch.stack([torch.as_tensor(ds[int(i)]["input_ids"]) for i in fed[k]])
        np.testing.assert_array_equal(trace.read(k).example_hashes, replay.torch.example_hashes(rows))


def _bisect_against_a(runs, other: str) -> dict:
    """`replay bisect a OTHER --no-refine --json` (a torch run has no program to replay): its report, exit 1."""
    result = invoke("bisect", str(runs / "a"), str(runs / other), "--no-refine", "--json")
    assert result.exit_code == 1, result.output
    return json.loads(result.stdout)


@pytest.mark.slow
def test_bisect_names_the_learning_rate_change_step_and_update(runs):
    report = _bisect_against_a(runs, "lr")
    assert (report["first_step"], report["cause"]) == (K, "update"), report


@pytest.mark.slow
def test_bisect_names_the_refed_batch_as_data_and_audit_flags_it(runs):
    report = _bisect_against_a(runs, "refeed")
    assert (report["first_step"], report["cause"]) == (K, "data"), report
    np.testing.assert_array_equal(instances(runs / "refeed")[K], instances(runs / "a")[K - 1])
    clean = invoke("audit", str(runs / "a"), "--json")
    assert clean.exit_code == 0, clean.output
    result = invoke("audit", str(runs / "refeed"), "--json")
    assert result.exit_code == 1, result.output
    (repeat,) = json.loads(result.stdout)["early_repeats"]
    assert (repeat["step"], repeat["positions"]) == (K, list(range(BATCH))), repeat
    assert repeat["first_seen"] == [{"step": K - 1, "position": j} for j in range(BATCH)], repeat


@pytest.mark.slow
def test_a_data_parallel_loader_without_a_process_group_is_refused_before_its_first_step(tmp_path):
    from replay.torch import TorchRecordError
    from tests.torch import olmo_core_runs

    with pytest.raises(TorchRecordError, match="world size is 2 and torch.distributed is not initialized") as e:
        olmo_core_runs.fit(tmp_path, "dp", STEPS, world_size=2)
    assert len(str(e.value).splitlines()) == 1 and not (tmp_path / "dp").exists()


def test_import_replay_and_replay_torch_never_import_olmo_core():
    code = "import sys, replay, replay.torch; print(sorted(m for m in sys.modules if m.startswith('olmo_core')))"
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
