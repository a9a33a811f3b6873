"""Cross-framework bisect names the op inside the layer (issue 33 part 4): five held-out mistakes
(trainer.port_bugs.REFERENCE_BUGS, on the torch side: the trainer has no switch for them) each at
the point inside the block where it acts, against the session's shared clean port
(tests/torch/reference_pair.py). The five known port bugs' ops (PORT_BUG_OPS) are checked by
tests/torch/test_port_bugs.py on the bisects it runs anyway. A held-out mistake's torch run is 2 steps from the demo
config's weights (it acts at step 0; about 2 s each); a clean pair names nothing, and at the op
level every point stays within the floor."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from replay.bisect import bisect  # noqa: E402
from replay.bisect.cross_refine import block_of, refine_op  # noqa: E402
from tests.cli_util import invoke  # noqa: E402
from tests.torch.reference_pair import demo, demo_config, one_torch_thread, shared  # noqa: E402
from traces import Run  # noqa: E402
from trainer import port_bugs  # noqa: E402
from trainer.port_bugs import PORT_BUG_OPS, REFERENCE_BUGS  # noqa: E402

READS_SHARED_RUNS = True  # tests/conftest.py orders this file after the one that makes them
VARIANT_STEPS = 2


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """The variants' training and every re-run of the reference on one thread (reference_pair.py)."""
    with one_torch_thread():
        yield


def variant_run(bug: str):
    """The reference trained VARIANT_STEPS steps with held-out mistake `bug` patched in (shared)."""
    from trainer.reference_train import train_reference

    return shared(f"reference-{bug}", lambda out: train_reference(demo_config(), out, VARIANT_STEPS, variant=bug))


def _above_only_from(report) -> None:
    """Every point before the named one within the floor, the named one above it."""
    points = list(report.op.points.items())
    names = [n for n, _ in points]
    at = names.index(report.op.name)
    assert all(d <= f for _, (d, f) in points[:at]), points
    d, f = points[at][1]
    assert d > 100 * f  # far from rounding, not a near miss


@pytest.mark.slow
@pytest.mark.parametrize("bug", REFERENCE_BUGS)
def test_each_held_out_mistake_is_named_at_its_op(bug):
    expected = REFERENCE_BUGS[bug]
    report = bisect(Run.open(variant_run(bug)), Run.open(demo()["jax"]))
    assert (report.first_step, report.cause) == (0, "forward"), report.to_json()
    assert report.first_op == expected.op, report.to_json()
    assert report.op.diagnosis == expected.diagnosis
    assert report.op.weights == "torch checkpoint 0"  # re-run from the torch run's own state, checked
    _above_only_from(report)
    assert expected.op in report.cause_text
    # the scores before softmax are the JAX side's only: said when they precede the op named
    assert any("attn.logits" in n and "one side only" in n for n in report.notes) == expected.op.endswith(".probs")


def test_the_expected_ops_are_not_one_answer():
    ops = {b.op for b in REFERENCE_BUGS.values()} | {o for o in PORT_BUG_OPS.values() if o}
    assert len(ops) >= 5  # rotary, QK-norm, softmax, merged heads, SwiGLU
    assert {b.diagnosis for b in REFERENCE_BUGS.values() if b.op.endswith(".probs")} == {"mask", "softmax scale"}


def test_a_clean_pair_names_nothing_and_every_point_is_within_the_floor():
    torch_run, jax_run = Run.open(demo()["reference"]), Run.open(demo()["jax"])
    assert bisect(torch_run, jax_run).first_op is None
    for layer in ("block_00.attn", "block_01.mlp"):
        notes: list[str] = []
        finding = refine_op(torch_run, jax_run, 0, layer, notes)
        assert finding is not None and finding.name is None, finding
        assert len(finding.points) >= 15 and max(d / f for d, f in finding.points.values()) < 0.5
        assert any("no point inside" in n for n in notes)


def test_a_torch_run_that_cannot_be_re_run_keeps_the_layer(monkeypatch):
    from replay import plugins

    monkeypatch.setattr(plugins, "first_answer", lambda hook, run, **kw: None)
    report = bisect(Run.open(demo()["reference"]), Run.open(demo()["rope"]))
    assert (report.first_step, report.first_layer, report.first_op) == (0, "block_00.attn", None)
    assert any("cannot re-run its step 0" in n for n in report.notes), report.notes


@pytest.mark.slow
def test_a_re_run_that_does_not_reproduce_the_torch_run_names_no_op(monkeypatch):
    """The torch run's variant not patched on re-running: its checkpoint's forward is not what it
    recorded, so no op is named (a wrong re-run would blame a clean point)."""
    run = variant_run("head_merge")
    monkeypatch.setattr(port_bugs, "apply_reference_bug", lambda model, name: None)
    report = bisect(Run.open(run), Run.open(demo()["jax"]))
    assert (report.first_step, report.first_layer, report.first_op) == (0, "block_00.attn", None)
    assert any("does not give the" in n for n in report.notes), report.notes


def test_the_cli_reports_the_op():
    torch_run, jax_run = str(variant_run("gate_up")), str(demo()["jax"])
    r = invoke("bisect", torch_run, jax_run, "--json")
    assert r.exit_code == 1, r.output
    j = json.loads(r.stdout)
    assert j["first_op"] == "block_00.mlp.act" and j["op"]["weights"] == "torch checkpoint 0"
    assert list(j["op"]["points"])[:3] == ["block_00.attn.q", "block_00.attn.k", "block_00.attn.v"]
    r = invoke("bisect", torch_run, jax_run)
    assert r.exit_code == 1 and "│ op " in r.stdout and "block_00.mlp.act" in r.stdout, r.stdout


def test_a_layer_inside_a_block_and_one_outside():
    names = ["embed", "block_00.attn", "block_00.mlp", "block_00", "final_norm", "logits"]
    assert block_of("block_00.attn", names) == "block_00"
    assert block_of("final_norm", names) is None and block_of("block_00", names) is None


def test_a_layer_outside_the_blocks_is_its_own_op():
    notes: list[str] = []
    finding = refine_op(Run.open(demo()["reference"]), Run.open(demo()["jax"]), 0, "final_norm", notes)
    assert (finding.name, finding.text, finding.points, notes) == ("final_norm", "final norm", {}, [])


@pytest.mark.slow
def test_a_step_without_a_torch_checkpoint_runs_both_sides_on_the_jax_weights():
    """Step 1 of a held-out pair: the torch run saved checkpoints 0 and 2 only, so the reference
    re-runs step 1 from the JAX run's replayed parameters, and still names the mistake's op."""
    notes: list[str] = []
    finding = refine_op(Run.open(variant_run("head_merge")), Run.open(demo()["jax"]), 1, "block_00.attn", notes)
    assert finding.weights.startswith("the JAX run's parameters at step 1"), finding
    assert finding.name == REFERENCE_BUGS["head_merge"].op, (finding, notes)
