"""`replay bisect`: each injected fault named at its step with the right cause and layer; the
layer refinement (replay/bisect/refine.py) names the first intermediate or leaf that differs; sparse
traces are bisected by replay in O(log N) probes; exit codes 0 / 1 / 2."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from replay.bisect import bisect
from replay.cli.app import app
from replay.bisect.refine import compare_tensors
from tests.replay.test_refine_device import count_fetches  # noqa: F401  (a fixture)
from traces import Run
from trainer import faults
from trainer.config import apply_overrides
from trainer.presets import get_preset

FAULT_STEP = 15
STEPS = 20  # checkpoints at 10 and 20
SPARSE_STEPS, SPARSE_EVERY, SPARSE_FAULT = 40, 10, 23
# One block: no claim here needs a second, a block is most of each program's compile, and the
# one-block tiny's step program is also tests/replay/test_claims.py's and test_noise.py's.
ONE_BLOCK = ["model.n_layers=1"]
FLIPPED = "block_00.mlp.up.kernel"  # the parameter bitflip flips: block n_layers // 2's MLP input (trainer/faults.py)


def invoke(*args: str):
    return CliRunner().invoke(app, list(args), env={"REPLAY_DEBUG": None})


def cli_json(*args: str) -> tuple[int, dict]:
    result = invoke("bisect", *args, "--json")
    assert result.exit_code in (0, 1), result.output
    return result.exit_code, json.loads(result.stdout)


# ------------------------------------------------------------------------------ runs, trained once


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """runs(name) -> path, trained on first use (their step programs come from the session's XLA
    cache, tests/conftest.py, which other files' tiny runs fill too): "A", "A2" (a second clean run), a fault name
    (that fault at step 15), "offA"/"offB" (trace.level=off, 40 steps, checkpoints every 10,
    offB with a bitflip at step 23)."""
    from trainer.faults import Fault, FaultPlan
    from trainer.loop import train

    root = tmp_path_factory.mktemp("bisect")
    cfg = apply_overrides(get_preset("tiny"), [*ONE_BLOCK, f"steps={STEPS}", "checkpoint.every_steps=10"])
    off = apply_overrides(get_preset("tiny"), [*ONE_BLOCK, f"steps={SPARSE_STEPS}", "trace.level=off",
                                               f"checkpoint.every_steps={SPARSE_EVERY}"])
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            path = root / name
            if name in ("A", "A2"):
                train(cfg, path)
            elif name == "offA":
                train(off, path)
            elif name == "offB":
                train(off, path, faults=FaultPlan([Fault("bitflip", SPARSE_FAULT)], off))
            else:
                train(cfg, path, faults=FaultPlan([Fault(name, FAULT_STEP)], cfg))
            made[name] = path
        return made[name]

    get.cfg = cfg
    return get


def assert_refinement_is_consistent(r: dict) -> None:
    """The first differing entry of `compared` is first_intermediate, everything before it equal."""
    names = [row["name"] for row in r["compared"]]
    i = names.index(r["first_intermediate"])
    assert all(row["equal"] for row in r["compared"][:i])
    assert not r["compared"][i]["equal"]
    assert r["distances"]["max_abs"] > 0 and r["distances"]["max_ulp"] > 0 and r["distances"]["max_rel"] > 0
    assert 0 < r["share_differing"] <= 1
    json.dumps(r)  # JSON-able


# ------------------------------------------------------------------------------ the faults


@pytest.mark.slow
def test_identical_runs_exit_0(runs):
    code, report = cli_json(str(runs("A")), str(runs("A2")))
    assert code == 0
    assert report["identical"] and report["first_step"] is None and report["cause"] is None
    assert report["replays"] == 0 and report["refinement"] is None and report["method"] == "trace scan"


# layer-bf16 (the first intermediate inside the layer, and --no-refine's trace scan alone) is
# tests/replay/test_claims.py's scenario: tested there on its runs, not trained again here.


@pytest.mark.slow
def test_bitflip_names_the_parameter_and_the_flipped_element(runs, count_fetches):
    """Also the refinement's transfers (was tests/replay/test_refine_device.py's end-to-end test, which
    trained this scenario again): it compares where the tensors live and fetches one leaf pair to
    the host, not every parameter of both runs."""
    from trainer.model import param_count

    a, b = Run.open(runs("A")), Run.open(runs("bitflip"))
    count_fetches["bytes"] = 0
    report = bisect(a, b)
    assert (report.first_step, report.cause, report.layer) == (FAULT_STEP, "state", "state/params")
    r = report.refinement
    assert r["first_intermediate"] == faults.bitflip_param(runs.cfg) == FLIPPED
    assert_refinement_is_consistent(r)
    numel = int(np.prod(r["shape"]))
    assert r["differing"] == 1 and r["share_differing"] == pytest.approx(1 / numel)
    assert r["distances"]["max_ulp"] == 1 << faults.BITFLIP_BIT  # one mantissa bit: exactly 2**20 ULPs
    assert r["at"] == [0, 0]
    assert report.replays == 1
    leaf = numel * 4
    everything = 2 * param_count(runs.cfg.model) * 4  # every parameter of both runs, what the host compare fetched
    assert r["fetched"]["leaves"] == 1 and r["fetched"]["bytes"] <= 2 * leaf + 4096
    assert count_fetches["bytes"] <= 2 * leaf + 64 * 1024 < everything / 4


@pytest.mark.slow
def test_skip_opt_restore_names_the_optimizer_state_leaf(runs):
    report = bisect(Run.open(runs("A")), Run.open(runs("skip-opt-restore")))
    assert (report.first_step, report.cause, report.layer) == (FAULT_STEP, "state", "state/opt_state")
    r = report.refinement
    assert r["first_intermediate"].startswith("opt_state.") and r["first_intermediate"].endswith("count")
    assert_refinement_is_consistent(r)
    assert (r["a_value"], r["b_value"]) == (FAULT_STEP, 0)  # the step count was reset


@pytest.mark.slow
def test_dropout_key_reuse_is_an_rng_cause_at_its_step(runs):
    code, report = cli_json(str(runs("A")), str(runs("dropout-key-reuse")))
    assert code == 1
    assert (report["first_step"], report["cause"], report["layer"]) == (FAULT_STEP, "rng", None)
    assert report["replays"] == 0  # the trace names an input of the step: nothing to replay


@pytest.mark.slow
def test_data_repeat_flags_examples_already_seen_by_b(runs):
    code, report = cli_json(str(runs("A")), str(runs("data-repeat")))
    assert code == 1
    assert (report["first_step"], report["cause"], report["layer"]) == (FAULT_STEP, "data", None)
    fed = faults.FaultPlan([faults.Fault("data-repeat", FAULT_STEP)], runs.cfg).batch_step(FAULT_STEP)
    assert fed < FAULT_STEP
    b = [e for e in report["examples"] if e["run"] == "B"]
    assert b and report["repeated_in_b"] == len(b) and report["repeated_in_a"] == 0
    for e in b:
        assert {"run": "B", "step": fed, "position": e["position"]} in e["seen_before"]
    assert report["replays"] == 0 and report["refinement"] is None  # the trace names the cause


@pytest.mark.slow
def test_without_checkpoints_the_replay_starts_from_the_initial_state(runs, tmp_path):
    bare = tmp_path / "no-checkpoints"
    shutil.copytree(runs("bitflip"), bare)
    shutil.rmtree(bare / "checkpoints")
    (bare / "checkpoints").mkdir()
    report = bisect(Run.open(runs("A")), Run.open(bare))
    assert (report.first_step, report.cause, report.layer) == (FAULT_STEP, "state", "state/params")
    assert report.refinement["first_intermediate"] == FLIPPED
    assert report.replayed_steps == (FAULT_STEP - 10) + FAULT_STEP  # A from checkpoint 10, B from step 0


@pytest.mark.slow
def test_run_that_cannot_be_replayed_is_an_error_after_the_trace_scan(runs, tmp_path):
    from replay.engine.replayer import ReplayUnavailable
    from traces.run import write_manifest

    moved = tmp_path / "data-gone"
    shutil.copytree(runs("bitflip"), moved, ignore=shutil.ignore_patterns(".lock"))
    manifest = Run.open(moved).manifest
    manifest["config"]["data"]["source"] = str(tmp_path / "no-such-tokens.bin")
    write_manifest(moved / "run.json", manifest)  # a run moved without its data, not a damaged manifest
    report = bisect(Run.open(runs("A")), Run.open(moved))
    assert (report.first_step, report.cause, report.layer) == (FAULT_STEP, "state", "state/params")
    assert report.refinement is None and report.replays == 0
    assert isinstance(report.failure, ReplayUnavailable) and "data-gone" in str(report.failure)
    result = invoke("bisect", str(runs("A")), str(moved))
    assert result.exit_code == 2, result.output
    assert "first divergent step" in result.stdout and "not confirmed by replay" in result.stdout  # the scan's answer
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "--no-refine" in lines[0]


# ------------------------------------------------------------------------------ sparse traces


@pytest.mark.slow
def test_sparse_runs_binary_search_by_replay(runs):
    """trace.level=off: no records, only checkpoints every 10 steps. Checkpoints narrow it to
    (20, 30], then replays bisect the 10 steps between."""
    code, report = cli_json(str(runs("offA")), str(runs("offB")))
    assert code == 1
    assert report["method"] == "binary search by replay"
    assert (report["identical"], report["first_step"], report["cause"], report["layer"]) == \
        (False, SPARSE_FAULT, "state", "state/params")
    assert report["replays"] <= math.ceil(math.log2(SPARSE_EVERY)) + 2
    search = report["search"]
    assert search["checkpoint_bounds"] == [20, 30]
    replayed = [p for p in search["probes"] if p["how"] == "replay"]
    assert len(replayed) == report["replays"]
    assert {p["step"] for p in replayed if not p["equal"]} and all(
        p["step"] <= SPARSE_FAULT for p in replayed if p["equal"])
    r = report["refinement"]
    assert r["found_by"] == "replay" and r["first_intermediate"] == FLIPPED
    assert r["distances"]["max_ulp"] == 1 << faults.BITFLIP_BIT


@pytest.mark.slow
def test_sparse_identical_runs_compare_checkpoints(runs, tmp_path):
    copy = tmp_path / "offA-copy"
    shutil.copytree(runs("offA"), copy)
    code, report = cli_json(str(runs("offA")), str(copy))
    assert code == 0
    assert report["identical"] and report["method"] == "checkpoint comparison" and report["replays"] == 0
    assert report["search"]["probes"] == [{"step": SPARSE_STEPS, "how": "checkpoint", "equal": True, "leaf": None}]


@pytest.mark.slow
def test_trace_scan_step_too_late_is_searched_below(runs, tmp_path):
    """A trace that starts after the divergence (only steps 17.. recorded): the scan's first
    differing step is 17, but the states already differ entering it, so bisect searches below."""
    source = Run.open(runs("bitflip"))
    late = tmp_path / "late"
    manifest = {k: v for k, v in source.manifest.items() if k not in ("format_version", "schema")}
    run = Run.create(late, source.schema, manifest, first_step=17)
    writer = run.writer()
    for rec in source.trace.records(17, source.trace.end):
        writer.append(rec)
    run.finish()
    shutil.copytree(source.checkpoint_dir, late / "checkpoints", dirs_exist_ok=True)
    report = bisect(Run.open(runs("A")), Run.open(late))
    assert report.comparison.first_step == 17
    assert report.method == "binary search by replay" and report.first_step == FAULT_STEP
    assert (report.cause, report.layer) == ("state", "state/params")
    assert report.refinement["first_intermediate"] == FLIPPED
    assert report.replays <= 1 + math.ceil(math.log2(17 - 10)) + 1


# ------------------------------------------------------------------------------ bad input, units


def test_missing_run_exits_2(tmp_path):
    result = invoke("bisect", str(tmp_path / "nope"), str(tmp_path / "nope2"))
    assert result.exit_code == 2
    assert len(result.output.strip().splitlines()) == 1


def test_run_compared_with_itself_exits_2(tmp_path):
    result = invoke("bisect", str(tmp_path), str(tmp_path))
    assert result.exit_code == 2 and "same run" in result.output


def test_compare_tensors_distances():
    a = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    b = a.copy()
    b[1, 2] = np.nextafter(b[1, 2], np.float32(2), dtype=np.float32)
    b[2, 3] = np.nextafter(np.nextafter(b[2, 3], np.float32(2)), np.float32(2))
    d = compare_tensors(a, b)
    assert not d["equal"] and d["differing"] == 2 and d["share_differing"] == pytest.approx(2 / 12)
    assert d["max_ulp"] == 2 and d["at"] == [2, 3] and d["max_abs"] > 0
    assert compare_tensors(a, a.copy())["equal"]
    # Across zero, ULPs count every float in between; bfloat16 vs float32 is never "equal".
    assert compare_tensors(np.float32([-0.0]), np.float32([0.0]))["max_ulp"] == 0
    assert not compare_tensors(np.float32([0.0]), np.float32([-0.0]))["equal"]
    import ml_dtypes

    bf = compare_tensors(np.float32([1.0, 1.5]), np.array([1.0, 1.5], ml_dtypes.bfloat16))
    assert not bf["equal"] and bf["differing"] == 0 and bf["dtype_b"] == "bfloat16"
    ints = compare_tensors(np.int32(15), np.int32(0))
    assert (ints["max_abs"], ints["max_ulp"], ints["share_differing"]) == (15.0, 15, 1.0)
