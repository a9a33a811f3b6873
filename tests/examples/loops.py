"""What every example's tests check, shared: each example records its runs once per module
(clean, clean again, the learning rate doubled at LR_AT, step REFEED_AT fed the batch of
REFEED_AT - 5, example POISONED of step POISON_AT replaced by a degenerate one), and the CLI
replays, bisects, compares and spikes them in-process. The re-fed and the poisoned steps are
one recording when a module asks for both (the poison after the refeed: bisect finds the refeed
first, spike looks at POISON_AT only), one run of ~4 CPU s fewer per module."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from types import ModuleType

import numpy as np

from tests.cli_util import assert_one_line_error, dir_digest, invoke
from traces import Run

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))  # the examples are "installed": their modules import by name

STEPS, EVERY, LR_AT, REFEED_AT, POISON_AT = 30, 10, 17, 23, 26
BUGS = {"clean": {}, "clean2": {}, "lr": {"lr_bump_at": LR_AT}, "refeed": {"refeed_at": REFEED_AT},
        "poison": {"poison_at": POISON_AT}}


def record_runs(example: ModuleType, root: Path, steps: int = STEPS, names=tuple(BUGS), **sizes) -> dict[str, Path]:
    """{name: run}; "refeed" and "poison", both asked for, are one run with both bugs: POISON_AT
    comes after REFEED_AT, so the refeed is still its first difference from clean (bisect), and
    spike is asked about POISON_AT only."""
    assert REFEED_AT < POISON_AT < steps
    together = {"refeed", "poison"} <= set(names)
    runs: dict[str, Path] = {}
    for name in names:
        if together and name == "poison":
            continue
        bugs = {**BUGS[name], **(BUGS["poison"] if together and name == "refeed" else {})}
        runs[name] = Path(example.train(example.Config(steps=steps, checkpoint_every=EVERY, **sizes, **bugs),
                                        str(root / name)))
    if together:
        runs["poison"] = runs["refeed"]
    return runs


def shared_runs(example: ModuleType, names=tuple(BUGS)) -> dict[str, Path]:
    """record_runs' runs at the example's own sizes, made once per test session for every file
    that reads them (tests/torch/reference_pair.py's shared folder, under a file lock): examples/
    optax_loop.py's are read by tests/examples/test_optax_loop.py and tests/replay/test_user_loop.py.
    "refeed" and "poison" are always the one run with both bugs. Readers copy a run to change it."""
    from tests.torch.reference_pair import shared

    def make(run: str):
        bugs = {**BUGS["refeed"], **BUGS["poison"]} if run == "refeed" else BUGS[run]
        return lambda out: example.train(example.Config(steps=STEPS, checkpoint_every=EVERY, **bugs), str(out))

    runs = {}
    for name in names:
        run = "refeed" if name == "poison" else name
        runs[name] = shared(f"{example.__name__}-{run}", make(run))
    return runs


def replay_lines(example: ModuleType) -> list[str]:
    return [l for l in Path(example.__file__).read_text().splitlines() if l.rstrip().endswith("# replay")]


def check_replay_from_a_checkpoint(run: Path) -> None:
    """`replay run` of 12..25 restores checkpoint 10, re-runs 10..25 and compares every bit."""
    before = dir_digest(run)
    result = invoke("run", str(run), "--steps", "12:25", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["checkpoint"] == 10 and (report["replayed"], report["bit_exact"]) == (14, 14), report
    assert (report["warmup_replayed"], report["warmup_bit_exact"]) == (2, 2) and report["all_bit_exact"]
    # Same machine, same program: the contract promises the bits (a program hash that changed between
    # recording and replay, e.g. through a one-device sharding in the lowering, would withdraw that).
    assert report["contract"]["expect_bits"], report["contract"]
    assert dir_digest(run) == before  # a replay changes nothing in the run


def check_replay_without_code(run: Path) -> None:
    """The run's exported program and example store replay 12..25 bit for bit, no user code used
    (the fresh-process, module-not-importable form is tests/replay/test_exported*.py's)."""
    from replay.engine.contract import evaluate
    from replay.engine.engine import replay as run_replay
    from replay.record.exported import ExportedReplay

    r = Run.open(run)
    assert "error" not in r.manifest["exported"] and r.manifest["example_store"].get("enabled") is not False, r.manifest["exported"]
    rep = ExportedReplay(r)
    contract = evaluate(r.manifest["environment"], rep.environment(), r.manifest["program_hash"], rep.program_hash())
    report = run_replay(r, rep, 12, 25, contract).to_json()
    assert report["all_bit_exact"] and (report["replayed"], report["bit_exact"]) == (14, 14), report


def check_replay_catches_another_trace(runs: dict[str, Path], tmp: Path) -> None:
    """The same replay compares bits: the clean run's code and checkpoints against the lr run's trace differ at LR_AT."""
    import shutil

    copy = tmp / "mixed"
    shutil.copytree(runs["clean"], copy)
    shutil.rmtree(copy / "trace")
    shutil.copytree(runs["lr"] / "trace", copy / "trace")
    result = invoke("run", str(copy), "--steps", f"{LR_AT - 2}:{LR_AT + 1}", "--json")
    assert result.exit_code == 1, result.output
    first = json.loads(result.stdout)["first_mismatch"]
    assert first["step"] == LR_AT and first["fields"][0]["kind"] == "update", first


def check_bisect_lr(runs: dict[str, Path]) -> dict:
    result = invoke("bisect", str(runs["clean"]), str(runs["lr"]), "--json")
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert (report["first_step"], report["cause"]) == (LR_AT, "update"), report
    # The layer named is the trace's first differing field in causal order (a recorded `lr` before the
    # parameters it moves: the recomputation orders each kind's metrics before its tensors, as the trace does).
    assert report["layer"] == report["fields"][0]["name"], (report["layer"], report["fields"][:2])
    # The first op that differs (replay/bisect/first_op.py): the schedule's `step == lr_bump_at`, an op whose
    # inputs are the same in both runs except for the constant the config baked in.
    op = report["refinement"]["op"]
    assert op["op"] == "eq" and op["first_differing_input"] is None and "constant" in op["reason"], op
    # A loop that records its `lr`: every parameter moves with it, summarized as such, not as one layer.
    summary = report["refinement"].get("global") or {}
    if report["fields"][0]["name"] == "lr":
        assert summary.get("differing") == summary.get("of") and summary.get("of", 0) > 1, report["refinement"]
        assert any(note.startswith(f"all {summary['of']} leaves of the new state's {summary['part']} differ") for note in
                   report["refinement"]["notes"]), report["refinement"]["notes"]
    return report


def check_bisect_refeed(runs: dict[str, Path]) -> None:
    result = invoke("bisect", str(runs["clean"]), str(runs["refeed"]), "--json")
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert (report["first_step"], report["cause"]) == (REFEED_AT, "data"), report
    b = [e for e in report["examples"] if e["run"] == "B"]
    assert b and report["repeated_in_b"] == len(b), report["examples"]
    first_fed = {min(s["step"] for s in e["seen_before"] if s["run"] == "B") for e in b}
    assert first_fed == {REFEED_AT - 5}, first_fed


def check_identical_runs(runs: dict[str, Path]) -> None:
    """Refinement on (the default): identical runs are identical, exit 0; and the check can fail."""
    result = invoke("bisect", str(runs["clean"]), str(runs["clean2"]), "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["identical"]


def fingerprints(run: Path, step: int) -> dict[str, int]:
    r = Run.open(run)
    return dict(zip(r.schema.tensor_names, (int(f) for f in r.trace.read(step).fingerprints)))


def state_fingerprints(state) -> list[int]:
    """The fingerprint the recorder computes of each of a state's leaves, computed here independently."""
    import jax

    from replay.record.fingerprint import fingerprints_and_sums_of_squares
    from replay.record.recorder import lanes_to_uint64

    def bits(x):
        return jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x

    lanes, _ = fingerprints_and_sums_of_squares([jax.numpy.asarray(bits(x)) for x in jax.tree.leaves(state)])
    return [int(f) for f in lanes_to_uint64(np.asarray(lanes))]


def check_entering_state_is_the_state_entering(run: Path, example: ModuleType, param: str) -> None:
    """Step 0's state/ fingerprints are those of the initial state (computed here), not of the
    updated one; and the parameter `param` changed in the step (state/ != update/)."""
    cfg = example.Config(**Run.open(run).manifest["config"])
    fp = fingerprints(run, 0)
    assert entering(fp) == state_fingerprints(example.make(dataclasses.asdict(cfg)).init())
    assert fp[f"state/{param}"] != fp[f"update/{param}"]
    nxt = fingerprints(run, 1)
    assert all(nxt["state/" + k[7:]] == v for k, v in fp.items() if k.startswith("update/"))


def entering(fp: dict[str, int]) -> list[int]:
    return [v for k, v in fp.items() if k.startswith("state/")]


def check_spike_names_what_the_loop_does_not_provide(run: Path, tmp: Path) -> None:
    """`replay spike --step` attributes to examples from the recorded per-example losses; the
    tokens need the loop's token rows, which a replay.init loop does not declare: a note says so,
    and --save-batch is one line naming what to provide."""
    result = invoke("spike", str(run), "--step", "15", "--window", "5", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["examples"] and all(e["first_tokens"] is None for e in report["examples"])
    assert any("does not provide fed_rows(step)" in n for n in report["notes"]), report["notes"]
    saved = invoke("spike", str(run), "--step", "15", "--window", "5", "--save-batch", str(tmp / "b.npy"))
    assert saved.exit_code == 2 and "Traceback" not in saved.output, saved.output
    last = saved.stderr.strip().splitlines()[-1]  # after the contract line; refused before any step is replayed
    assert last.startswith("error: ") and "fed_rows(step) -> int32 [B, L+1]" in last and "--save-batch" in last, last
    assert "to step 15" not in saved.stderr
    assert not (tmp / "b.npy").exists()


def check_compare_eval_of_identical_runs(runs: dict[str, Path]) -> dict:
    """Two runs of one config agree at early, middle and late checkpoints, bit for bit, with a
    floor measured on their weights (the loop's evaluate at weights one ulp away), not assumed."""
    result = invoke("compare", str(runs["clean"]), str(runs["clean2"]), "--eval", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["agree"] and report["first_disagreement"] is None and report["floor"] == "weights-ulp", report
    assert [r["step"] for r in report["steps"]] == [EVERY, 2 * EVERY, 3 * EVERY], report["steps"]
    for row in report["steps"]:
        assert row["difference"] == 0.0 and row["agree"], row
        assert 0 < row["noise_a"] == row["noise_b"] < 1e-3 * abs(row["loss_a"]), row  # measured, and small
    assert report["examples"] > 0 and report["notes"] == [], report
    return report


def check_compare_eval_finds_the_learning_rate_change(runs: dict[str, Path]) -> dict:
    """The learning rate doubled at LR_AT: the checkpoint before it agrees, the first after it differs (exit 1)."""
    result = invoke("compare", str(runs["clean"]), str(runs["lr"]), "--eval", "--json")
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    first_after = min(k for k in (EVERY, 2 * EVERY, 3 * EVERY) if k > LR_AT)
    assert not report["agree"] and report["first_disagreement"] == first_after, report
    before, at = report["steps"][0], report["steps"][1]
    assert before["step"] < LR_AT and before["agree"] and before["difference"] == 0.0, before
    assert at["step"] == first_after and abs(at["difference"]) > 10 * at["tolerance"] > 0, at
    return report


def check_compare_eval_names_the_loop_field_to_add(runs: dict[str, Path], monkeypatch) -> None:
    """A loop without evaluate (or, for run A, eval_batches) is one line, exit 2, naming the field."""
    import dataclasses as dc

    from replay.engine.replayer import open_replayable

    rep = open_replayable(Run.open(runs["clean"]))  # the cached one compare opens
    for field in ("evaluate", "eval_batches"):
        with monkeypatch.context() as m:
            m.setattr(rep, "loop", dc.replace(rep.loop, **{field: None}))
            result = invoke("compare", str(runs["clean"]), str(runs["clean2"]), "--eval")
        assert_one_line_error(result, str(runs["clean"]), f"replay.Loop({field}=...)")


def check_spike_names_the_poisoned_example(runs: dict[str, Path], poisoned: int) -> dict:
    """`replay spike RUN --step POISON_AT` ranks the poisoned example first among the batch's examples."""
    result = invoke("spike", str(runs["poison"]), "--step", str(POISON_AT), "--window", "5", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["examples"][0]["position"] == poisoned, report["examples"]
    return report
