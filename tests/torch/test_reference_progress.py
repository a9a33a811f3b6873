"""The reference's training reports each step as it goes (trainer.reference_train's on_step), and
`replay demo --reference torch` passes those reports to its progress bar while the reference
trains, not only while the JAX trainer does."""

from __future__ import annotations


import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.torch.reference_pair import clean_config  # noqa: E402


def test_train_reference_reports_every_step_with_its_recorded_loss(tmp_path):
    from traces import Run
    from trainer.reference_train import train_reference

    cfg = clean_config(2, every=0, level="step")
    seen = []
    train_reference(cfg, tmp_path / "ref", 2, sketch_width=0, on_step=lambda k, loss: seen.append((k, loss)))
    run = Run.open(tmp_path / "ref")
    assert [k for k, _ in seen] == [0, 1]
    for k, loss in seen:  # the loss shown is the one recorded, bit for bit
        assert np.float32(loss).tobytes() == np.float32(run.trace.read(k).metric(run.schema, "loss")).tobytes()


def test_the_reference_demo_moves_its_progress_while_the_reference_trains(tmp_path, monkeypatch):
    import trainer.reference_train
    from trainer import demo_reference

    class Stop(Exception):
        pass

    def fake_reference(cfg, path, steps, *, on_step=None, **_):  # stands in for the training, calls back
        for k in range(steps):
            on_step(k, 2.5)
        raise Stop

    monkeypatch.setattr(trainer.reference_train, "train_reference", fake_reference)
    phases, steps = [], []
    with pytest.raises(Stop):
        demo_reference.run_reference_demo(tmp_path / "demo", steps=8, on_phase=lambda name, total: phases.append(name),
                                          on_step=lambda info: steps.append((info.step, info.total, info.loss)))
    assert phases == ["PyTorch reference"]
    assert steps == [(k, 8, 2.5) for k in range(8)]
