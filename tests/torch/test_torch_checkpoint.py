"""replay.torch checkpoints: model and optimizer after k steps as safetensors, loaded bit for bit,
a damaged file refused (its xxh3 is in the manifest), a checkpoint that does not fit refused."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import replay.torch  # noqa: E402
from replay.errors import exit_code_of  # noqa: E402
from replay.torch import checkpoint  # noqa: E402
from traces import Run  # noqa: E402


def _model(seed: int = 0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 10))


def _train(path, steps: int = 3):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    run = replay.torch.init(path, model=model, optimizer=opt)
    checkpoint.save(run, model, opt)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        rows = torch.randint(0, 10, (4, 5), generator=g)
        with run.step(rows) as rec:
            loss = torch.nn.functional.cross_entropy(model(rows[:, :-1]).reshape(-1, 10), rows[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            rec.metrics(loss=loss)
        opt.zero_grad()
    checkpoint.save(run, model, opt)
    run.finish()
    return model, opt


def test_saved_state_loads_bit_for_bit_and_the_manifest_lists_it(tmp_path):
    model, opt = _train(tmp_path / "r")
    assert checkpoint.steps(tmp_path / "r") == [0, 3]
    assert Run.open(tmp_path / "r").manifest["checkpoints"] == [0, 3]
    assert Run.open(tmp_path / "r").trace.end == 3  # the trace reaches the newest checkpoint
    assert checkpoint.latest(tmp_path / "r") == 3
    fresh = _model(seed=5)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    checkpoint.load(tmp_path / "r", 3, fresh, fresh_opt)
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)
    sa, sb = opt.state_dict()["state"], fresh_opt.state_dict()["state"]
    assert sa.keys() == sb.keys() and all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])
    checkpoint.load(tmp_path / "r", 0, fresh)  # the initial weights, not the trained ones
    assert not torch.equal(fresh[1].weight, model[1].weight)
    assert torch.equal(fresh[1].weight, _model()[1].weight)


def test_a_flipped_bit_is_refused(tmp_path):
    _train(tmp_path / "r")
    path = tmp_path / "r" / "checkpoints" / "3" / checkpoint.MODEL_FILE
    data = bytearray(path.read_bytes())
    data[-1] ^= 1  # inside the tensor bytes: safetensors itself would load it
    path.write_bytes(bytes(data))
    with pytest.raises(checkpoint.TorchCheckpointError, match="damaged") as e:
        checkpoint.load(tmp_path / "r", 3, _model())
    assert exit_code_of(e.value) == 2
    checkpoint.load(tmp_path / "r", 0, _model())  # the others still load


def test_missing_step_and_wrong_model_are_one_line_errors(tmp_path):
    _train(tmp_path / "r")
    with pytest.raises(checkpoint.TorchCheckpointError, match=r"no torch checkpoint 2 \(it has 0, 3\)"):
        checkpoint.load(tmp_path / "r", 2, _model())
    other = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 11))
    with pytest.raises(checkpoint.TorchCheckpointError, match="does not fit the model"):
        checkpoint.load(tmp_path / "r", 3, other)


def test_save_is_refused_inside_a_step_and_after_finish(tmp_path):
    model = _model()
    run = replay.torch.init(tmp_path / "r", model=model)
    rows = torch.zeros((2, 3), dtype=torch.long)
    with pytest.raises(checkpoint.TorchCheckpointError, match="inside a recorded step"):
        with run.step(rows) as rec:
            rec.metrics(loss=model(rows).sum())
            checkpoint.save(run, model)
    run.finish()
    with pytest.raises(checkpoint.TorchCheckpointError, match="finished"):
        checkpoint.save(run, model)
