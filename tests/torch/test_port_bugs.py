"""The port-bug table (issue 13): each bug switched on in the JAX side only, trained against the
clean reference from the same weights on the same data, and `bisect` must name the step where the
bug first acts, the first tensor it changes, and the kind of cause -- expected vs found, per bug.
A clean JAX run against the same reference is the table's control row: within the noise floor.

The pair is the session's shared one (tests/torch/reference_pair.py): the runs of `replay demo
--reference torch --steps 8`, whose own bisects give the control row and the RoPE row (its
planted bug; the demo's JSON report is `bisect`'s, as the CLI prints it), and the demo's config
with each other bug on, bisected here. Its JAX runs record distance sketches, so every row's
bisect reads the distances from both traces, as the demo's do (the replay of a JAX run without
sketches: tests/replay/test_bisect_cross.py; the two sources agree: tests/torch/test_jax_sketches.py). One reference run serves every row: the demo config has a
z-loss (1e-4), so "z-loss left out" is a JAX side with optimizer.z_loss=0 (trainer/port_bugs.py).
The bugs' expected places are trainer.port_bugs.PORT_BUGS; the step is 0 except where the bug
cannot act at step 0: AdamW's epsilon changes nothing while the learning rate is 0 (the warmup's
first step). Each row's op inside the layer (trainer.port_bugs.PORT_BUG_OPS) is checked here too:
the known bugs' share of issue 33 part 4 (the held-out mistakes: tests/torch/test_port_ops.py)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.torch.reference_pair import demo, demo_config, port_run  # noqa: E402
from trainer.port_bugs import PORT_BUG_OPS, PORT_BUGS  # noqa: E402

FROM_THE_DEMO = ("clean", "rope")  # rows the demo's own bisects report
READS_SHARED_RUNS = True  # tests/conftest.py orders this file after the one that makes them
pytestmark = pytest.mark.slow  # the shared demo (if not made yet), four JAX runs at the layer level


def _first_step_with_lr(cfg) -> int:
    from trainer.optim import lr_schedule

    schedule = lr_schedule(cfg.optimizer)
    return next(k for k in range(cfg.steps) if float(schedule(k)) > 0)


def expected(cfg, name: str) -> tuple[int | None, str | None, str | None]:
    if name == "clean":
        return None, None, None
    bug = PORT_BUGS[name]
    return (_first_step_with_lr(cfg) if bug.kind == "update" else 0), bug.first_tensor, bug.kind


def found(name: str) -> tuple[tuple[int | None, str | None, str | None], bool]:
    """((first step, first tensor, cause), within the noise floor) of reference vs the `name` port."""
    if name in FROM_THE_DEMO:
        r = demo()
        assert r["exit_code"] == 0, r["output"]
        j = json.loads(r["stdout"].strip().splitlines()[-1])
        assert j["bug"] == "rope"
        if name == "clean":  # the report names no place for a pair within the floor
            within = j["clean"]["within_noise"]
            return ((None, None, None) if within else ("above the floor", None, None)), within
        b = j["buggy"]
        assert b["first_op"] == PORT_BUG_OPS[name], b  # the op inside the layer (tests/torch/test_port_ops.py)
        return (b["first_step"], b["first_layer"], b["cause"]), b["within_noise"]
    from replay.bisect import bisect
    from traces import Run

    report = bisect(Run.open(demo()["reference"]), Run.open(port_run(name)))
    assert report.source == "traces", report.source
    assert report.first_op == PORT_BUG_OPS[name], report.to_json()  # the op inside the layer
    return (report.first_step, report.first_layer, report.cause), report.within_noise


@pytest.mark.parametrize("name", ["clean", *PORT_BUGS])
def test_bisect_localizes_each_port_bug(name):
    cfg = demo_config()
    place, within_noise = found(name)
    assert place == expected(cfg, name), f"{name}: expected {expected(cfg, name)}, found {place}"
    assert within_noise == (name == "clean")


def test_the_table_is_not_vacuous():
    """The expected places differ between bugs (a bisect answering one place for all would fail)."""
    cfg = demo_config()
    places = {expected(cfg, n) for n in PORT_BUGS}
    assert len(places) >= 3 and expected(cfg, "adam_eps")[0] == 1 and expected(cfg, "rope")[0] == 0
    assert cfg.optimizer.z_loss > 0  # so the reference has the term the z_loss port leaves out
    assert set(FROM_THE_DEMO) <= {"clean", *PORT_BUGS} and cfg.trace.level == "layer"
