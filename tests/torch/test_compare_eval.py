"""`replay compare A B --eval`: checkpoints of a torch reference run and JAX trainer runs evaluated
on the same held-out rows, each with its own framework's code, against the measured float32 floor.

The session's shared pair (tests/torch/reference_pair.py: the runs of `replay demo --reference
torch --steps 8`, checkpoints every 2): the reference from the trainer's initial weights, the
clean JAX trainer, and the JAX trainer with a port bug (AdamW epsilon inside the square root,
which acts from the first update), all on the demo's config. The clean pair's comparison at the
default steps is the one the demo made (its JSON); the others are made here."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from replay.compare import EvalComparison, EvalRow, compare_eval, pick_steps  # noqa: E402
from replay.compare.errors import CompareInputError  # noqa: E402
from tests.cli_util import invoke  # noqa: E402
from tests.torch.reference_pair import DEMO_STEPS, demo, demo_config, one_torch_thread, port_run  # noqa: E402
from traces import Run  # noqa: E402

STEPS, EVERY = DEMO_STEPS, 2  # checkpoints 0, 2, 4, 6, 8
READS_SHARED_RUNS = True  # tests/conftest.py orders this file after the one that makes them
slow = pytest.mark.slow  # the shared pair (made by the first file that needs it), then evaluations


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """The reference's evaluations on one thread (tests/torch/reference_pair.py)."""
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def pair():
    d = demo()
    return {"torch": d["reference"], "jax": d["jax"], "bug": port_run("adam_eps")}


@pytest.fixture(scope="module")
def clean(pair):
    """compare_eval(reference, clean JAX run) at the default steps: the comparison the demo made
    and printed (its JSON "eval"), rebuilt as the EvalComparison it came from."""
    j = json.loads(demo()["stdout"].strip().splitlines()[-1])["eval"]
    rows = [EvalRow(**{f.name: r[f.name] for f in dataclasses.fields(EvalRow)}) for r in j["steps"]]
    report = EvalComparison(j["run_a"], j["run_b"], j["framework_a"], j["framework_b"], j["examples"],
                            j["skipped_trained"], rows)
    assert report.to_json() == j  # every field, the verdicts (agree, first_disagreement) included
    return report


@slow
def test_a_clean_pair_agrees_at_early_middle_and_late_checkpoints(clean):
    assert (clean.framework_a, clean.framework_b) == ("torch", "jax")
    assert [r.step for r in clean.rows] == pick_steps(list(range(0, STEPS + 1, EVERY))) == [2, 4, 8]
    assert clean.agree, clean.to_json()
    assert any(r.difference != 0.0 for r in clean.rows)  # two frameworks: close, not the same bits
    for r in clean.rows:
        assert 0 < r.noise_a and 0 < r.noise_b and r.tolerance < 1e-4  # a measured floor, not a blanket


@slow
def test_a_port_bug_differs_at_its_first_checkpoint(pair, clean):
    report = compare_eval(pair["torch"], pair["bug"], steps=[EVERY])
    assert [r.step for r in report.rows] == [EVERY] and not report.agree and report.first_disagreement == EVERY
    assert abs(report.rows[0].difference) > 10 * report.rows[0].tolerance
    assert abs(report.rows[0].difference) > 10 * abs(clean.rows[0].difference)


@slow
def test_same_framework_pairs(pair, tmp_path):
    twin = shutil.copytree(pair["jax"], tmp_path / "twin")
    same = compare_eval(pair["jax"], twin, steps=[4])
    assert same.agree and same.rows[0].difference == 0.0
    assert not compare_eval(pair["jax"], pair["bug"], steps=[4]).agree
    torch_twin = shutil.copytree(pair["torch"], tmp_path / "torch-twin")
    both = compare_eval(pair["torch"], torch_twin, steps=[STEPS])
    assert (both.framework_a, both.framework_b) == ("torch", "torch") and both.rows[0].difference == 0.0


@slow
def test_the_held_out_rows_were_not_trained_on(pair):
    from traces import Run, first_fed
    from replay.compare.heldout import held_out_rows
    from replay.compare.sides import open_side
    from trainer.data import example_hashes

    sides = [open_side(pair["torch"]), open_side(pair["jax"])]
    rows, skipped = held_out_rows(sides, 64, before_step=STEPS)
    assert rows.shape == (64, 33) and skipped > 0  # 8 x 16 of 10k examples: some candidates were trained on
    assert not first_fed(Run.open(pair["jax"]), example_hashes(rows))
    again, _ = held_out_rows(sides, 64, before_step=STEPS)
    assert (again == rows).all()


def test_pick_steps():
    assert pick_steps([0, 4, 8, 12]) == [4, 8, 12]
    assert pick_steps([0, 10, 20, 30, 40, 100]) == [10, 40, 100]  # 40 is nearest halfway (55)
    assert pick_steps([0, 5]) == [5]
    assert pick_steps([0, 4, 8], [8, 0]) == [0, 8]
    with pytest.raises(CompareInputError, match="step 7 is not a checkpoint of both runs"):
        pick_steps([0, 4, 8], [7])


@slow
def test_cli_table_json_and_exit_codes(pair):
    ok = invoke("compare", str(pair["torch"]), str(pair["jax"]), "--eval", "--steps", "4")
    assert ok.exit_code == 0, ok.output
    assert "agree within the noise floor at 1 checkpoint" in ok.output and "tolerance" in ok.output
    bad = invoke("compare", str(pair["torch"]), str(pair["bug"]), "--eval", "--json")
    assert bad.exit_code == 1, bad.output
    j = json.loads(bad.stdout)
    assert j["agree"] is False and j["first_disagreement"] == EVERY and j["framework_b"] == "jax"
    for argv, words in ((["--eval", "--steps", "7"], "not a checkpoint of both runs"),
                        (["--steps", "4"], "needs --eval"), (["--eval", "--steps", "x"], "separated by commas")):
        r = invoke("compare", str(pair["torch"]), str(pair["jax"]), *argv)
        assert r.exit_code == 2 and words in r.output and r.output.count("error:") == 1, r.output


@slow
def test_a_damaged_torch_checkpoint_is_exit_2(pair, tmp_path):
    copy = shutil.copytree(pair["torch"], tmp_path / "torch")
    f = copy / "checkpoints" / "4" / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-3] ^= 0x10
    f.write_bytes(bytes(data))
    r = invoke("compare", str(copy), str(pair["jax"]), "--eval", "--steps", "4")
    assert r.exit_code == 2 and "damaged" in r.output, r.output


# ------------------------------------------------------------------ issue 31: two `replay train --preset tiny` runs

# `replay train --preset tiny` with these is the demo's config (trainer.demo_reference.demo_config),
# whose JAX run the session already trained; the lr run below differs from it in optimizer.lr only
# (and in steps, which the schedule does not read: decay_steps is set). The training is a fresh
# compile (the learning rate is a constant of the step program), the test's main cost: recorded at
# the step level (compare --eval reads checkpoints, not the trace), a smaller program than the layer
# level's with its per-tensor fingerprints and sketches, which compiles in less than half the time.
DEMO_SETS = ("model.dropout=0.0", "trace.sketches=true", "optimizer.z_loss=0.0001", f"optimizer.decay_steps={STEPS}",
             f"checkpoint.every_steps={EVERY}", "checkpoint.keep=0")


@slow
def test_cli_on_tiny_runs_exit_0_when_identical_and_1_on_a_learning_rate_change(pair, tmp_path):
    from trainer.config import to_dict

    base = pair["jax"]
    twin = shutil.copytree(base, tmp_path / "twin")
    same = invoke("compare", str(base), str(twin), "--eval")
    assert same.exit_code == 0 and "Traceback" not in same.output, same.output
    assert same.stdout.strip().splitlines()[-1] == "agree within the noise floor at 3 checkpoints", same.stdout

    lr_run, lr = tmp_path / "lr", 2 * demo_config().optimizer.lr
    sets = [a for s in (*DEMO_SETS, f"optimizer.lr={lr}", "trace.level=step") for a in ("--set", s)]
    trained = invoke("train", "--preset", "tiny", "--steps", str(EVERY), "--out", str(lr_run), *sets)  # checkpoints 0, 2
    assert trained.exit_code == 0, trained.output
    changed = dataclasses.replace(demo_config(), steps=EVERY,
                                  optimizer=dataclasses.replace(demo_config().optimizer, lr=lr),
                                  trace=dataclasses.replace(demo_config().trace, level="step"))
    assert Run.open(base).manifest["config"] == to_dict(demo_config())
    assert Run.open(lr_run).manifest["config"] == to_dict(changed)

    differ = invoke("compare", str(base), str(lr_run), "--eval", "--json")
    assert differ.exit_code == 1 and "Traceback" not in differ.output, differ.output
    j = json.loads(differ.stdout)
    # The learning rate acts from the first update: 2 is the first common checkpoint after it.
    assert j["agree"] is False and j["first_disagreement"] == EVERY, j
    (row,) = j["steps"]
    assert row["step"] == EVERY and abs(row["difference"]) > 10 * row["tolerance"] > 0, row
