"""The port-bug table (issue 13): each bug switched on in the JAX side only, trained against the
clean reference from the same weights on the same data, and `bisect` must name the step where the
bug first acts, the first tensor it changes, and the kind of cause -- expected vs found, per bug.
A clean JAX run against the same reference is the table's control row: within the noise floor.

One reference run serves every row: the clean config has a z-loss (1e-4), so "z-loss left out"
is a JAX side with optimizer.z_loss=0 (trainer/port_bugs.py). The bugs' expected places are
trainer.port_bugs.PORT_BUGS; the step is 0 except where the bug cannot act at step 0: AdamW's
epsilon changes nothing while the learning rate is 0 (the warmup's first step)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.torch.reference_pair import clean_config  # noqa: E402
from trainer.port_bugs import PORT_BUGS, with_bug  # noqa: E402

STEPS = 3
pytestmark = pytest.mark.slow  # trains one reference and six JAX runs at the layer level


def _first_step_with_lr(cfg) -> int:
    from trainer.optim import lr_schedule

    schedule = lr_schedule(cfg.optimizer)
    return next(k for k in range(cfg.steps) if float(schedule(k)) > 0)


def expected(cfg, name: str) -> tuple[int | None, str | None, str | None]:
    if name == "clean":
        return None, None, None
    bug = PORT_BUGS[name]
    return (_first_step_with_lr(cfg) if bug.kind == "update" else 0), bug.first_tensor, bug.kind


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    return clean_config(STEPS, every=STEPS, z_loss=1e-4), tmp_path_factory.mktemp("port-bugs")


@pytest.fixture(scope="module")
def reference_run(clean):
    from trainer.reference_train import train_reference

    cfg, root = clean
    return train_reference(cfg, root / "reference", STEPS)


def train_port(cfg, root, name: str):
    from trainer.loop import train

    port = cfg if name == "clean" else with_bug(cfg, name)
    train(port, root / f"jax-{name}")
    return root / f"jax-{name}"


@pytest.mark.parametrize("name", ["clean", *PORT_BUGS])
def test_bisect_localizes_each_port_bug(clean, reference_run, name):
    from replay.bisect import bisect
    from traces import Run

    cfg, root = clean
    report = bisect(Run.open(reference_run), Run.open(train_port(cfg, root, name)))
    found = (report.first_step, report.first_layer, report.cause)
    assert found == expected(cfg, name), f"{name}: expected {expected(cfg, name)}, found {found}"
    assert report.within_noise == (name == "clean")


def test_the_table_is_not_vacuous(clean):
    """The expected places differ between bugs (a bisect answering one place for all would fail)."""
    cfg, _ = clean
    places = {expected(cfg, n) for n in PORT_BUGS}
    assert len(places) >= 3 and expected(cfg, "adam_eps")[0] == 1 and expected(cfg, "rope")[0] == 0
    assert cfg.optimizer.z_loss > 0  # so the reference has the term the z_loss port leaves out
