"""OLMo-core's Trainer recorded on two data-parallel ranks (gloo, two local processes started as
torchrun starts them): the seed scenario under OLMo-core's own loader (issue 33 part 3b).

One module fixture (tests/torch/olmo_core_runs.py `seed_runs`, three processes; the module ~32 CPU-s,
~90 s on the shared 2 cores at load ~9) makes:

    seed_1to1   10 steps on one rank: 5, then resumed from OLMo-core's step-5 checkpoint on one rank
    seed_1to2   the same 5 steps on one rank, resumed from its step-5 checkpoint on two ranks
    seed_bad    as seed_1to2, with MaxText's sharding injected into OLMo-core's loader
                (olmo_core_runs.ContiguousShards: each rank a contiguous half of the epoch, resumed at
                step * per-rank batch): the check must be able to fail
    full_disk   10 steps on two ranks from step 0; rank 0 can neither write nor close its trace from step 3 on
    taken       last, on the same two ranks: a folder rank 0 cannot open as a run (both ranks must end)"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if importlib.util.find_spec("olmo_core") is None:
    pytest.skip("ai2-olmo-core is not installed (pip install -e '.[olmo-core]')", allow_module_level=True)

import replay.torch  # noqa: E402
import traces  # noqa: E402
from tests.cli_util import invoke  # noqa: E402

BATCH, STEPS, K, WORLD = 4, 10, 5, 2  # tests/torch/olmo_core_runs.py's; two ranks after the resume
REPO = Path(__file__).resolve().parents[2]


def seed_row():
    spec = importlib.util.spec_from_file_location("seed_row", REPO / "tools" / "seed_row.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def seed(tmp_path_factory):
    from tests.torch import olmo_core_runs

    assert (olmo_core_runs.BATCH, olmo_core_runs.STEPS, olmo_core_runs.K) == (BATCH, STEPS, K)
    return olmo_core_runs.seed_runs(tmp_path_factory.mktemp("olmo_core_dp"), checks=True)


def _segments(run: Path) -> list[tuple[int, int]]:
    return [(s["start_step"], s["world_size"]) for s in json.loads((run / "run.json").read_text())["olmo_core"]["segments"]]


@pytest.mark.slow
def test_two_ranks_record_the_global_batch_a_one_rank_run_feeds(seed):
    """Steps K.. of seed_1to2 were fed by two ranks, each the columns [:, rank::2] of the global batch:
    the recorded hashes and instance indices are the global batch's, in its order, equal to the
    one-rank run's at every step; the recorded loss is the ranks' mean, equal to the one-rank loss up
    to rounding (rank 0's alone would be its half's)."""
    from replay.torch.olmo_core import instances
    from tests.torch import olmo_core_runs

    one, two = traces.Run.open(seed["1->1"]), traces.Run.open(seed["1->2"])
    assert one.status == two.status == "complete" and len(one.trace) == len(two.trace) == STEPS
    assert _segments(seed["1->2"]) == [(0, 1), (K, WORLD)] and _segments(seed["1->1"]) == [(0, 1), (K, 1)]
    fed = instances(seed["1->2"])
    np.testing.assert_array_equal(fed, instances(seed["1->1"]))
    assert fed.shape == (STEPS, BATCH) and len(np.unique(fed)) == STEPS * BATCH
    ds = olmo_core_runs.dataset(seed["1->2"].parent)
    for k in range(STEPS):
        x, y = one.trace.read(k), two.trace.read(k)
        np.testing.assert_array_equal(y.example_hashes, x.example_hashes)
        rows = torch.stack([torch.as_tensor(ds[int(i)]["input_ids"]) for i in fed[k]])
        np.testing.assert_array_equal(y.example_hashes, replay.torch.example_hashes(rows))
        if k < K:
            assert x.metrics.tobytes() == y.metrics.tobytes(), k
        else:
            np.testing.assert_allclose(y.metrics[0], x.metrics[0], rtol=1e-5)


@pytest.mark.slow
def test_the_one_to_two_resume_audits_clean_and_its_data_equals_the_one_rank_resumes(seed):
    clean = invoke("audit", str(seed["1->2"]), "--json")
    assert clean.exit_code == 0, clean.output
    assert json.loads(clean.stdout)["early_repeat_examples"] == 0
    result = invoke("bisect", str(seed["1->1"]), str(seed["1->2"]), "--no-refine", "--json")
    assert result.exit_code == 1, result.output  # they differ (RNG, numbers), never in data
    report = json.loads(result.stdout)
    assert report["first_step"] >= K and report["cause"] != "data", report
    row = seed_row().row("olmo-core", "1->2", seed["1->2"], seed["1->1"], since=K)
    assert row == {"framework": "olmo-core", "processes": "1->2", "steps": STEPS, "since": K, "refed_examples": 0,
                   "refed_share": 0.0, "bisect": {"step": report["first_step"], "cause": report["cause"],
                                                  "identical": False, "data_identical": True,
                                                  "compared_steps": STEPS}}, row


@pytest.mark.slow
def test_maxtexts_sharding_injected_into_olmo_cores_loader_is_flagged(seed):
    """ContiguousShards on two ranks after one: rank 0 restarts its half of the epoch at K * BATCH / 2,
    inside what the one-rank fit fed, so every step from K re-feeds rank 0's rows (global positions
    0, 2, ...): audit flags them with the step each was first fed, bisect says step K, data."""
    result = invoke("audit", str(seed["1->2 contiguous"]), "--json")
    assert result.exit_code == 1, result.output
    repeats = json.loads(result.stdout)["early_repeats"]
    assert [r["step"] for r in repeats] == list(range(K, STEPS))
    assert all(r["positions"] == list(range(0, BATCH, WORLD)) for r in repeats), repeats
    assert all(s["step"] < K for r in repeats for s in r["first_seen"]), repeats
    report = json.loads(invoke("bisect", str(seed["1->1"]), str(seed["1->2 contiguous"]), "--no-refine", "--json").stdout)
    assert (report["first_step"], report["cause"]) == (K, "data"), report
    row = seed_row().row("olmo-core", "1->2", seed["1->2 contiguous"], seed["1->1"], since=K)
    refed = (STEPS - K) * BATCH // WORLD
    assert (row["refed_examples"], row["refed_share"], row["bisect"]["data_identical"]) == (
        refed, refed / ((STEPS - K) * BATCH), False), row


@pytest.mark.slow
def test_rank_0_failing_to_open_the_run_ends_every_rank_with_its_reason(seed):
    """Rank 0 alone opens the run; when it cannot, the other ranks learn why before the first step
    and end too, rather than wait in the step's gather for a rank that is gone (the last fit of the
    fixture's two-rank processes, into a folder that holds something else)."""
    assert seed["taken error"] is not None and "ranks exited rank 0 1, rank 1 1;" in seed["taken error"]
    said = [log.read_text() for log in seed["logs"]]
    assert "taken: exists and is not empty" in said[0], said[0][-2000:]
    assert "rank 0 could not open" in said[1] and "exists and is not empty" in said[1], said[1][-2000:]
    assert not (seed["taken"] / "run.json").exists()


@pytest.mark.slow
def test_rank_0_failing_to_record_stops_the_recording_and_every_rank_trains_on(seed):
    """An error in rank 0's recording of a step (here the trace's write, as on a full disk) ends the
    recording, logged, with the steps before it intact and the run incomplete (closing it fails
    too: logged once, never retried); raising it would end rank 0 alone, the other ranks waiting
    for it in a collective. The fit ends normally."""
    from tests.torch import olmo_core_runs

    at = olmo_core_runs.VARIANTS["full_disk"]()["callbacks"]["full_disk"].at
    run, one = traces.Run.open(seed["full disk"]), traces.Run.open(seed["1->1"])
    assert run.status != "complete" and 0 < run.trace.end <= at, (run.status, run.trace.end)
    for k in range(run.trace.end):  # recorded on two ranks from step 0: the global batches
        np.testing.assert_array_equal(run.trace.read(k).example_hashes, one.trace.read(k).example_hashes)
    root = seed["full disk"].parent
    said = seed["logs"][0].read_text()
    assert "No space left on device" in said and f"{seed['full disk']} stops here" in said, said[-3000:]
    assert f"closing {seed['full disk']} failed too" in said and said.count("No space left on device") == 2, said[-3000:]
    assert (root / "olmo" / "full_disk" / f"step{STEPS}").is_dir()  # OLMo-core trained and saved to the end
