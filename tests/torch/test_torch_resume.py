"""replay.torch.init(..., resume=True) + run.restore: a torch run cut short and continued records
the trace an uninterrupted run records (the steps after the checkpoint re-recorded bit for bit,
torch's RNG state restored with it), and a resume that does not reproduce them is refused."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import replay.torch  # noqa: E402
from replay.torch import checkpoint  # noqa: E402
from replay.torch.errors import TorchRecordError  # noqa: E402
from traces import Run  # noqa: E402
from traces.errors import ResumeDivergedError  # noqa: E402

V, D, B, L, STEPS, EVERY = 32, 16, 4, 8, 6, 3


def _rows(k: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(k).integers(0, V, size=(B, L + 1))).long()


def _model(seed: int):
    torch.manual_seed(seed)
    # dropout draws from torch's RNG every step: a resume must restore the RNG state, not only weights
    model = torch.nn.Sequential(torch.nn.Embedding(V, D), torch.nn.Dropout(0.1), torch.nn.Linear(D, V)).train()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _steps(run, model, opt, start: int, stop: int, lr: float = 1e-2) -> None:
    for k in range(start, stop):
        for group in opt.param_groups:
            group["lr"] = lr
        rows = _rows(k)
        with run.step(rows) as rec:
            loss = torch.nn.functional.cross_entropy(model(rows[:, :-1]).reshape(-1, V), rows[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            rec.metrics(loss=loss)
        opt.zero_grad(set_to_none=True)
        if (k + 1) % EVERY == 0 or k + 1 == STEPS:
            checkpoint.save(run, model, opt)


def _record(path, stop: int = STEPS):
    model, opt = _model(0)
    run = replay.torch.init(path, config={"lr": 1e-2}, model=model, optimizer=opt)
    checkpoint.save(run, model, opt)
    _steps(run, model, opt, 0, stop)
    if stop == STEPS:
        run.finish()
    else:
        run.close()  # as an error leaves it: INCOMPLETE, every finished step's record written
    return path


def _records(path) -> list[tuple]:
    run = Run.open(path)
    out = []
    for k in range(run.trace.start, run.trace.end):
        r = run.trace.read(k)
        out.append((k, r.rng.tobytes(), r.example_hashes.tobytes(), r.metrics.tobytes(), r.fingerprints.tobytes(),
                    r.rms.tobytes(), r.sketches.tobytes(), r.norms.tobytes()))
    return out


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    return _records(_record(tmp_path_factory.mktemp("resume") / "whole"))


def _crashed(tmp_path):
    path = _record(tmp_path / "cut", stop=5)  # steps 0..4 ran and reached the trace (close wrote 4's)
    run = Run.open(path)
    assert run.status != "complete" and run.trace.end == 5 and checkpoint.steps(path) == [0, 3]
    return path


def test_a_resumed_run_records_what_an_uninterrupted_one_does(tmp_path, whole):
    path = _crashed(tmp_path)
    model, opt = _model(7)  # another init and RNG state: restore must bring back both
    run = replay.torch.init(path, config={"lr": 1e-2}, model=model, optimizer=opt, resume=True)
    start = run.restore(model, opt)
    assert start == 3
    _steps(run, model, opt, start, STEPS)  # steps 3 and 4 are re-recorded (kept: same bits), 5 appended
    run.finish()
    assert Run.open(path).status == "complete"
    assert _records(path) == whole


def test_a_resume_that_does_not_reproduce_the_recorded_steps_is_refused(tmp_path):
    path = _crashed(tmp_path)
    model, opt = _model(0)
    run = replay.torch.init(path, model=model, optimizer=opt, resume=True)
    run.restore(model, opt)
    with pytest.raises(ResumeDivergedError, match="step 3 is already recorded with different content"):
        _steps(run, model, opt, 3, 5, lr=2e-2)  # step 3 again, with another learning rate
        run.finish()  # the last record is written here, if not before


def test_a_resume_with_other_arguments_is_refused(tmp_path):
    path = _crashed(tmp_path)
    model, opt = _model(0)
    with pytest.raises(TorchRecordError, match="another config"):
        replay.torch.init(path, config={"lr": 2e-2}, model=model, optimizer=opt, resume=True)
    with pytest.raises(TorchRecordError, match="another sketch_width"):
        replay.torch.init(path, model=model, optimizer=opt, resume=True, sketch_width=32)
    with pytest.raises(TorchRecordError, match="holds no run to resume"):
        replay.torch.init(tmp_path / "nothing", model=model, optimizer=opt, resume=True)
    with pytest.raises(TorchRecordError, match="not empty .it holds a run"):
        replay.torch.init(path, model=model, optimizer=opt)
    run = replay.torch.init(path, model=model, optimizer=opt, resume=True)
    _steps(run, model, opt, run.next_step, run.next_step + 1)
    with pytest.raises(TorchRecordError, match="before its first recorded step"):
        run.restore(model, opt)
    run.close()
