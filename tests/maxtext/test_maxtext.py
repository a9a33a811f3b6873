"""MaxText's own training loop recorded by `python -m replay.maxtext` and replayed (issue 33, part 2).

MaxText needs Python >= 3.12 and jax >= 0.11: these tests run in the venv tools/maxtext-env.sh builds
(maxtext[tpu]==0.2.5, jax 0.12, this package installed editable) and skip elsewhere. A tiny decoder
(2 layers, 64 wide, vocabulary 256, synthetic data) trains 12 steps on the CPU; the run replays bit
for bit from its exported program (a bundle) and with MaxText's code (replay.maxtext:make), bisect
names a learning-rate change down to its op, and a run recorded on two processes (MaxText's checkpointing
on) replays on two from MaxText's checkpoint, each process checking it (a flipped bit refused on both). With
MaxText's checkpointing on the run keeps no copy of the state: a replay restores MaxText's checkpoint s
as the state entering step s + 1 (checked against the trace: a flipped bit is refused), and a Grain
run's loader is set to the iterator state MaxText saved with it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ports import free_port

maxtext = pytest.importorskip("maxtext", reason="MaxText is not installed here: run tools/maxtext-env.sh "
                              "(a Python 3.12 venv with maxtext[tpu]==0.2.5)")

pytestmark = pytest.mark.slow
STEPS = 12
CONFIG = Path(maxtext.__file__).parent / "configs" / "base.yml"
TINY = ["hardware=cpu", "dataset_type=synthetic", f"steps={STEPS}", "per_device_batch_size=4", "max_target_length=64",
        "base_emb_dim=64", "base_num_query_heads=4", "base_num_kv_heads=4", "base_mlp_dim=128",
        "base_num_decoder_layers=2", "head_dim=16", "vocab_size=256", "attention=dot_product",
        "enable_checkpointing=false", "skip_jax_distributed_system=true", "dtype=float32"]
ENV = dict(os.environ, DECOUPLE_GCLOUD="TRUE", JAX_PLATFORMS="cpu")


def _record(root: Path, name: str, *extra: str) -> Path:
    run = root / name
    done = subprocess.run([sys.executable, "-m", "replay.maxtext", str(run), str(CONFIG), *TINY, f"run_name={name}",
                           f"base_output_directory={root / 'maxtext-out'}", *extra],
                          env=ENV, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return run


def _record_on_two_processes(root: Path, name: str, *extra: str) -> Path:
    """MaxText's own CPU multi-process start (max_utils.initialize_jax_for_cpu: coordinator port 1234)."""
    run, sets = root / name, [a for a in TINY if a != "skip_jax_distributed_system=true"] + list(extra)
    procs = [subprocess.Popen([sys.executable, "-m", "replay.maxtext", str(run), str(CONFIG), *sets, f"run_name={name}",
                               f"base_output_directory={root / 'maxtext-out'}"],
                              env=dict(ENV, JAX_COORDINATOR_ADDRESS="127.0.0.1", JOB_INDEX="0", JOB_COMPLETION_INDEX=str(i),
                                       PROCESSES_IN_JOB="2", JAX_PROCESS_COUNT="2"),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for i in range(2)]
    errs = [p.communicate(timeout=900)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e[-2000:] for e in errs]
    return run


def _replay(*args: str, prng: str | None = "unsafe_rbg") -> subprocess.CompletedProcess:
    env = dict(ENV, **({"JAX_DEFAULT_PRNG_IMPL": prng} if prng else {}))
    return subprocess.run([sys.executable, "-m", "replay.cli.app", *args], env=env, capture_output=True, text=True,
                          timeout=900)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("maxtext")
    return {"clean": _record(root, "clean"), "lr": _record(root, "lr", "learning_rate=4e-5")}


def test_the_run_records_every_step_with_maxtexts_loss(runs):
    manifest = json.loads((runs["clean"] / "run.json").read_text())
    assert (runs["clean"] / "COMPLETE").exists() and manifest["loop"] == "maxtext"
    done = _replay("show", str(runs["clean"]), "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    shown = json.loads(done.stdout.strip().splitlines()[-1])
    assert shown["status"] == "complete" and shown["steps"]["count"] == STEPS, shown
    assert manifest["config"]["base_emb_dim"] == 64 and manifest["config"]["steps"] == STEPS  # MaxText's own config


TWO_PERIOD = 3


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> Path:
    """Recorded with MaxText's checkpointing on (period 3: its 0, 3, 6, 9, 11, replay's 1, 4, 7, 10), into
    one run folder and MaxText's one checkpoint folder (both processes' shards)."""
    return _record_on_two_processes(tmp_path_factory.mktemp("two"), "two", "enable_checkpointing=true",
                                    f"checkpoint_period={TWO_PERIOD}", "async_checkpointing=false")


def test_two_processes_record_one_run_of_the_global_batch(runs, two):
    manifest = json.loads((two / "run.json").read_text())
    assert (two / "COMPLETE").exists() and manifest["environment"]["process_count"] == 2
    done = _replay("show", str(two), "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    shown = json.loads(done.stdout.strip().splitlines()[-1])
    one = json.loads(_replay("show", str(runs["clean"]), "--json").stdout.strip().splitlines()[-1])
    # per_device_batch_size=4 on each process's one device: the trace holds both processes' rows
    assert (shown["steps"]["count"], shown["schema"]["examples_per_step"]) == (STEPS, 8), shown["schema"]
    assert one["schema"]["examples_per_step"] == 4
    # The checkpoints are MaxText's (replay saved none): show lists the steps they give, as the launcher saw
    # MaxText save them (its 0, 3, 6, 9: replay's 1, 4, 7, 10; its 11, the last step's, gives no step to replay)
    assert not manifest.get("checkpoints") and shown["checkpoints"] == [0, 1, 4, 7, 10], shown["checkpoints"]
    assert shown["loop_checkpoints"] == manifest["config"]["replay_maxtext_checkpoints"]["directory"], shown


def test_the_two_process_run_replays_bit_exact_on_two_processes_with_maxtexts_code(two):
    # No examples are stored (each process held only its rows): the batches are MaxText's own, its
    # loader rebuilt on each process, the global batch gathered. --steps 5:11 starts from MaxText's
    # checkpoint 3 (replay's 4), restored by MaxText's code on both processes (each its shards) and
    # verified on both against the trace's fingerprints of the state entering step 4 (a collective).
    codes, outs = _replay_on_two_processes(two, f"5:{STEPS - 1}")
    assert codes == [0, 0], [err[-2000:] for _, err in outs]
    report = json.loads(outs[0][0].strip().splitlines()[-1])
    assert "replayed with your code (replay.maxtext:make)" in report["notes"], report["notes"]
    assert report["contract"]["expect_bits"], report["contract"]
    assert (report["replayed"], report["bit_exact"], report["all_bit_exact"]) == (STEPS - 5, STEPS - 5, True), report
    assert (report["checkpoint"], report["warmup_bit_exact"]) == (4, 1), report
    assert not any("unverified" in n for n in report["notes"]), report["notes"]


def test_a_tampered_maxtext_checkpoint_is_refused_on_both_processes_in_one_line(two):
    # A bit flipped in MaxText's checkpoint 3 (its largest array file, put back after): each process restores
    # its shards and checks the whole state (the fingerprints are a collective), so both refuse, alike.
    where = Path(json.loads((two / "run.json").read_text())["config"]["replay_maxtext_checkpoints"]["directory"]) / "3"
    chunk = max((p for p in (where / "items").rglob("*") if p.is_file() and p.parent.name == "d"),
                key=lambda p: p.stat().st_size)
    data = chunk.read_bytes()
    try:
        chunk.write_bytes(data[:len(data) // 2] + bytes([data[len(data) // 2] ^ 1]) + data[len(data) // 2 + 1:])
        codes, outs = _replay_on_two_processes(two, f"5:{STEPS - 1}")
    finally:
        chunk.write_bytes(data)
    errors = [[ln for ln in err.splitlines() if ln.startswith("error:")] for _, err in outs]
    assert codes == [2, 2] and [len(e) for e in errors] == [1, 1], [err[-2000:] for _, err in outs]
    assert errors[0] == errors[1] and f"{where}: MaxText's checkpoint 3" in errors[0][0], errors
    assert "entering step 4 differs" in errors[0][0] and not any("Traceback" in err for _, err in outs), errors


def _replay_on_two_processes(run: Path, steps: str) -> tuple[list[int], list[tuple[str, str]]]:
    """`replay run RUN --steps A:B --json` started once per process, as a user starts it on two hosts."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "replay.cli.app", "run", str(run), "--steps", steps, "--json",
                               "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)],
                              env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=900) for p in procs]
    return [p.returncode for p in procs], outs


def test_the_two_process_run_on_one_process_is_refused_in_one_line(two):
    done = _replay("run", str(two), "--steps", "0:1", prng=None)
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("error:")]
    assert done.returncode == 2 and len(lines) == 1 and "--num-processes 2" in lines[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr


@pytest.fixture(scope="module")
def bundle(runs, tmp_path_factory) -> Path:
    """The clean run packed: a bundle never runs code, so it replays from the exported program."""
    out = tmp_path_factory.mktemp("bundle") / "clean.rpk"
    done = _replay("pack", str(runs["clean"]), "--steps", f"0:{STEPS - 1}", "-o", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    return out


def test_replay_without_maxtexts_code_is_bit_exact(bundle):
    done = _replay("run", str(bundle), "--steps", f"0:{STEPS - 1}", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert (report["replayed"], report["bit_exact"], report["all_bit_exact"]) == (STEPS, STEPS, True), report
    assert any("exported program" in n for n in report["notes"]), report["notes"]


def test_a_replay_of_the_exported_program_under_another_prng_is_refused_naming_the_setting(bundle):
    done = _replay("run", str(bundle), "--steps", "0:1", prng=None)
    assert done.returncode == 2 and "JAX_DEFAULT_PRNG_IMPL=unsafe_rbg" in done.stderr, done.stderr[-2000:]


def test_replay_with_maxtexts_code_is_bit_exact(runs):
    # replay.maxtext:make runs MaxText's own main with the recorded argv up to its first step: the
    # program it traces is the recorded one (same hash), so the contract expects bits, and gets them.
    # MaxText's code sets its own PRNG (unsafe_rbg), so no JAX_DEFAULT_PRNG_IMPL is needed here.
    done = _replay("run", str(runs["clean"]), "--steps", f"3:{STEPS - 1}", "--json", prng=None)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert "replayed with your code (replay.maxtext:make)" in report["notes"], report["notes"]
    assert report["contract"]["expect_bits"] and report["contract"]["differences"] == [], report["contract"]
    assert (report["replayed"], report["bit_exact"], report["all_bit_exact"]) == (STEPS - 3, STEPS - 3, True), report
    assert (report["checkpoint"], report["warmup_replayed"], report["warmup_bit_exact"]) == (0, 3, 3), report
    assert not any("does not reproduce" in n for n in report["notes"]), report["notes"]  # MaxText's data, rebuilt


def test_bisect_names_the_learning_rate_change_down_to_the_op(runs):
    done = _replay("bisect", str(runs["clean"]), str(runs["lr"]), "--json")
    assert done.returncode == 1, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    # MaxText's schedule warms up from 0: step 0's update is 0 under either rate, step 1's is not.
    assert (report["first_step"], report["cause"]) == (1, "update"), report
    # With MaxText's code rebuilt, the op: the warmup schedule's op fed the changed rate (a constant).
    op = report["refinement"]["op"]
    assert op is not None, report["refinement"]["notes"]
    assert "optax/schedules/_schedule.py" in op["where"] and op["same_inputs"] is False, op
    assert [d["constant"] for d in op["differing_operands"]] == [True], op


@pytest.mark.parametrize("config", [{"base_emb_dim": 64}, {"replay_maxtext_argv": ["/nowhere/base.yml", "steps=2"]}],
                         ids=["recorded-without-argv", "config-file-not-here"])
def test_make_declines_so_the_replay_falls_back_to_the_exported_program(config):
    # EntrypointNotFound is a CodeNotAllowed: replay/record/exported.py's choose() then replays the exported
    # program (with a note), instead of MaxText's main failing inside the user's code (exit 2).
    from replay.engine.code import EntrypointNotFound
    from replay.maxtext import make

    with pytest.raises(EntrypointNotFound, match="cannot be rebuilt"):
        make(config)


def test_gradient_taps_inside_maxtexts_step_are_recorded_and_replay_bit_exact_with_its_code(tmp_path):
    # --tap-grads: MaxText's train_step hands its gradients to TrainStateNNX.apply_gradients, tapped there
    # (replay.maxtext.tap_gradients); make() taps the same, so the replay's program is the recorded one.
    steps = 4
    run = tmp_path / "grads"
    done = subprocess.run([sys.executable, "-m", "replay.maxtext", str(run), "--tap-grads", str(CONFIG),
                           *[a for a in TINY if not a.startswith("steps=")], f"steps={steps}", "run_name=grads",
                           f"base_output_directory={tmp_path / 'maxtext-out'}"],
                          env=ENV, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    tensors = json.loads((run / "run.json").read_text())["schema"]["tensors"]
    grads = [t for t in tensors if t["name"].startswith("grad/")]
    assert grads and {t["kind"] for t in grads} == {"backward"}, tensors[:3]
    assert any("layers" in t["name"] for t in grads) and any("embedder" in t["name"] for t in grads), grads
    replayed = _replay("run", str(run), "--steps", f"1:{steps - 1}", "--json", prng=None)
    assert replayed.returncode == 0, replayed.stderr[-2000:]
    report = json.loads(replayed.stdout.strip().splitlines()[-1])
    assert "replayed with your code (replay.maxtext:make)" in report["notes"], report["notes"]
    assert (report["replayed"], report["bit_exact"], report["all_bit_exact"]) == (steps - 1, steps - 1, True), report


OWNED_STEPS, PERIOD = 6, 2


@pytest.fixture(scope="module")
def owned(tmp_path_factory) -> dict:
    """A run recorded with MaxText's checkpointing on: MaxText saves at s % PERIOD == 0 and the last step."""
    root = tmp_path_factory.mktemp("owned")
    argv = [a for a in TINY if not a.startswith(("steps=", "enable_checkpointing="))]
    done = subprocess.run([sys.executable, "-m", "replay.maxtext", str(root / "owned"), str(CONFIG), *argv,
                           f"steps={OWNED_STEPS}", "enable_checkpointing=true", f"checkpoint_period={PERIOD}",
                           "async_checkpointing=false", "run_name=owned", f"base_output_directory={root / 'out'}"],
                          env=ENV, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return {"run": root / "owned", "maxtext": root / "out" / "owned" / "checkpoints"}


def test_with_maxtexts_checkpointing_on_the_run_keeps_no_copy_and_replays_from_maxtexts_own(owned):
    # MaxText's checkpoint s is the state after step s: replay's state entering step s + 1. The run holds
    # no checkpoint of replay's; `replay run --steps 3:4` restores MaxText's checkpoint 2 with MaxText's
    # code, checks it against the trace's fingerprints of the state entering step 3, and replays.
    assert sorted(int(p.name) for p in owned["maxtext"].iterdir()) == [0, 2, 4, OWNED_STEPS - 1]
    manifest = json.loads((owned["run"] / "run.json").read_text())
    assert not manifest.get("checkpoints") and not manifest.get("checkpoint_fingerprints"), manifest.get("checkpoints")
    assert not any((owned["run"] / "checkpoints").glob("*/*")), list((owned["run"] / "checkpoints").glob("*"))
    assert manifest["config"]["replay_maxtext_checkpoints"]["directory"].rstrip("/") == str(owned["maxtext"])
    # what `replay show` lists: MaxText's 0, 2, 4 as replay's 1, 3, 5 (its 5, the last step's, gives none)
    assert manifest["loop_checkpoints"]["steps"] == [0, 1, 3, 5], manifest["loop_checkpoints"]
    for steps, checkpoint in (("3:4", 3), ("0:1", 0)):  # step 0's state: rebuilt from the argv, checked alike
        done = _replay("run", str(owned["run"]), "--steps", steps, "--json", prng=None)
        assert done.returncode == 0, done.stderr[-2000:]
        report = json.loads(done.stdout.strip().splitlines()[-1])
        assert "replayed with your code (replay.maxtext:make)" in report["notes"], report["notes"]
        assert report["checkpoint"] == checkpoint and report["contract"]["expect_bits"], report
        assert (report["replayed"], report["bit_exact"], report["all_bit_exact"]) == (2, 2, True), report
        assert not any("unverified" in n for n in report["notes"]), report["notes"]


def test_a_tampered_maxtext_checkpoint_is_refused_in_one_line(owned):
    # A bit flipped in MaxText's checkpoint 2 (the largest array file): orbax and MaxText restore it
    # without complaint; the trace's fingerprints of the state entering step 3 refuse it. Put back after.
    files = [p for p in (owned["maxtext"] / "2" / "items").rglob("*") if p.is_file() and p.parent.name == "d"]
    chunk = max(files, key=lambda p: p.stat().st_size)
    data = chunk.read_bytes()
    try:
        chunk.write_bytes(data[:len(data) // 2] + bytes([data[len(data) // 2] ^ 1]) + data[len(data) // 2 + 1:])
        done = _replay("run", str(owned["run"]), "--steps", "3:4", "--json", prng=None)
    finally:
        chunk.write_bytes(data)
    errors = [ln for ln in done.stderr.splitlines() if ln.startswith("error:")]
    assert done.returncode == 2 and len(errors) == 1, done.stderr[-3000:]
    assert f"{owned['maxtext'] / '2'}: MaxText's checkpoint 2" in errors[0] and "entering step 3" in errors[0], errors
    assert "differs" in errors[0] and "Traceback" not in done.stderr, errors


def test_without_maxtexts_code_a_run_on_maxtexts_checkpoints_is_refused_naming_what_to_do():
    # The exported program takes MaxText's NNX state; MaxText's checkpoints hold its Linen layout, which
    # only MaxText's code converts: make() refuses (exit 2) rather than fall back to the exported program.
    from replay.errors import ReplayUnavailable
    from replay.maxtext import make

    config = {"replay_maxtext_argv": ["/nowhere/base.yml", "steps=2"],
              "replay_maxtext_checkpoints": {"directory": "/nowhere/checkpoints", "period": 2}}
    with pytest.raises(ReplayUnavailable, match="MaxText's own .*enable_checkpointing=false keeps replay's own"):
        make(config)


def test_a_grain_run_replays_from_maxtexts_checkpoint_with_its_saved_iterator_state(tmp_path):
    # dataset_type=grain (a parquet file of pre-tokenized 48-token rows made here): MaxText saves its Grain
    # iterator's state beside each checkpoint (s/iter). A replay from MaxText's checkpoint 2 sets the
    # rebuilt loader's iterator to it (one `next` for step 3): the loader's batch is the one the run fed.
    # Given checkpoint 0's iterator state instead (a real state, the wrong step), the loader's batch
    # differs and the note says so: the saved state is what the replay's loader uses.
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = np.random.default_rng(0).integers(1, 256, (256, 48))
    pq.write_table(pa.table({"text": rows.tolist()}), tmp_path / "tokens.parquet")
    tokenizer = Path(maxtext.__file__).parent / "assets" / "tokenizers" / "tokenizer.llama2"
    argv = [a for a in TINY if not a.startswith(("steps=", "enable_checkpointing=", "dataset_type="))]
    done = subprocess.run([sys.executable, "-m", "replay.maxtext", str(tmp_path / "g"), str(CONFIG), *argv, "steps=4",
                           "dataset_type=grain", "grain_file_type=parquet", f"grain_train_files={tmp_path / 'tokens.parquet'}",
                           "tokenize_train_data=false", f"tokenizer_path={tokenizer}", "grain_worker_count=0",
                           "enable_checkpointing=true", "checkpoint_period=2", "async_checkpointing=false",
                           "run_name=g", f"base_output_directory={tmp_path / 'out'}"],
                          env=ENV, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    saved = tmp_path / "out" / "g" / "checkpoints"
    state = saved / "2" / "iter" / "process_0-of-1.json"
    assert state.is_file() and (saved / "0" / "iter" / "process_0-of-1.json").is_file()
    original = state.read_text()
    notes = {}
    for name, text in (("saved", original), ("step 0's", (saved / "0" / "iter" / "process_0-of-1.json").read_text())):
        state.write_text(text)
        try:
            replayed = _replay("run", str(tmp_path / "g"), "--steps", "3:3", "--json", prng=None)
        finally:
            state.write_text(original)
        assert replayed.returncode == 0, replayed.stderr[-2000:]
        report = json.loads(replayed.stdout.strip().splitlines()[-1])
        assert report["checkpoint"] == 3 and (report["replayed"], report["bit_exact"]) == (1, 1), report
        notes[name] = [n for n in report["notes"] if "does not reproduce" in n]
    assert notes["saved"] == [] and len(notes["step 0's"]) == 1 and "step 3's batch" in notes["step 0's"][0], notes


@pytest.fixture(scope="module")
def gcs_env() -> dict:
    """A GCS emulator on 127.0.0.1 (gcp-storage-emulator, made to answer as GCS does: tests/traces/emulators.py)
    for the subprocesses only: its variables go into their environment, not this process's (tests/traces'
    own session emulator keeps the process-wide ones)."""
    pytest.importorskip("gcp_storage_emulator", reason="pip install gcp-storage-emulator (in the MaxText venv) "
                        "for the gs:// test")
    from gcp_storage_emulator.server import create_server

    from tests.traces.emulators import reads_like_gcs

    reads_like_gcs()
    port = free_port()
    server = create_server("127.0.0.1", port, in_memory=True, default_bucket="replay-maxtext")
    server.start()
    server._api._httpd.socket.listen(128)  # as tests/traces/emulators.py: parallel requests overflow 5
    url = f"http://127.0.0.1:{port}"
    try:
        yield dict(ENV, STORAGE_EMULATOR_HOST=url, TENSORSTORE_GCS_HTTP_URL=url, FSSPEC_GS_TOKEN="anon",
                   GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false", TENSORSTORE_GCS_REQUEST_CONCURRENCY="1")
    finally:
        server.stop()


def test_maxtexts_checkpoints_on_gcs_are_listed_and_a_replay_restores_from_them(tmp_path, gcs_env):
    # MaxText saves into gs:// (base_output_directory a bucket URL); the run (local) lists the steps its
    # checkpoints give, read through traces.storage (a pathlib.Path would turn gs:// into gs:/), and
    # `replay run --steps 3:3` restores MaxText's checkpoint 2 from the bucket with MaxText's code.
    argv = [a for a in TINY if not a.startswith(("steps=", "enable_checkpointing="))]
    done = subprocess.run([sys.executable, "-m", "replay.maxtext", str(tmp_path / "gs"), str(CONFIG), *argv, "steps=4",
                           "enable_checkpointing=true", "checkpoint_period=2", "async_checkpointing=false", "run_name=g",
                           "base_output_directory=gs://replay-maxtext/out"],
                          env=gcs_env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    listed = json.loads((tmp_path / "gs" / "run.json").read_text())["loop_checkpoints"]
    assert listed["directory"].rstrip("/") == "gs://replay-maxtext/out/g/checkpoints" and listed["steps"] == [0, 1, 3]
    replayed = subprocess.run([sys.executable, "-m", "replay.cli.app", "run", str(tmp_path / "gs"), "--steps", "3:3",
                               "--json"], env=gcs_env, capture_output=True, text=True, timeout=900)
    assert replayed.returncode == 0, replayed.stderr[-2000:]
    report = json.loads(replayed.stdout.strip().splitlines()[-1])
    assert "replayed with your code (replay.maxtext:make)" in report["notes"], report["notes"]
    assert report["checkpoint"] == 3 and (report["replayed"], report["bit_exact"], report["all_bit_exact"]) == (1, 1, True)
    assert not any("unverified" in n for n in report["notes"]), report["notes"]
