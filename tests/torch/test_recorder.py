"""replay.torch records a PyTorch loop into the run format: hashes, exact metric bits, and the
fingerprints of layers (forward hooks), raw gradients, parameters after the optimizer step and
the state entering each step, each checked against the numpy reference on copies the test takes
itself; under the trainer's name map the schema is the JAX trainer's."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import replay.torch  # noqa: E402
import traces  # noqa: E402
from trainer import data, reference  # noqa: E402
from trainer.presets import get_preset  # noqa: E402
from traces.fingerprint import fingerprint  # noqa: E402

CFG = dataclasses.replace(get_preset("tiny"), model=dataclasses.replace(get_preset("tiny").model, dropout=0.0))
M = CFG.model
B, STEPS = 4, 3


def _rows(k: int) -> torch.Tensor:
    g = np.random.default_rng(k)
    return torch.from_numpy(g.integers(0, M.vocab_size, size=(B, M.seq_len + 1))).long()


def _tree(fps: list[int]) -> int:
    """The trainer's pytree summary from per-leaf fingerprints: the fingerprint of their lanes."""
    lanes = np.array([[f >> 32, f & 0xFFFFFFFF] for f in fps], np.uint32)
    return fingerprint(lanes)


def _jax_fps(hf_named: dict[str, np.ndarray]) -> dict[str, int]:
    return {j: fingerprint(np.asarray(reference._get(reference.to_jax(hf_named, M), j))) for j, _, _ in
            reference.param_map(M)}


def train(path, *, lr: float = 1e-3, nudge_before: int | None = None) -> dict:
    """A 3-step recorded run of the reference; returns what the test saw, taken independently."""
    torch.manual_seed(0)  # the RNG state entering each step is recorded (a hash of it)
    model = reference.hf_model(M, seed=0).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    seen = {"params_before": [], "grads": [], "params_after": [], "layers": [], "loss": []}
    captured: dict[str, torch.Tensor] = {}
    modules = dict(model.named_modules())
    for name, mod in reference.layer_map(M):
        modules[mod].register_forward_hook(lambda _m, _a, out, name=name: captured.__setitem__(name, out.detach().clone()))
    run = replay.torch.init(path, config={"preset": "tiny"}, model=model, optimizer=opt,
                            names=reference.tensor_names(M))
    for k in range(STEPS):
        if k == nudge_before:
            with torch.no_grad():  # changes a parameter between steps, outside any recorded step
                model.model.norm.weight.add_(1e-3)
        seen["params_before"].append(_jax_fps(reference.hf_tensors(model, M)))
        rows = _rows(k)
        with run.step(rows) as rec:
            logits = model(rows[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, M.vocab_size), rows[:, 1:].reshape(-1))
            loss.backward()
            seen["grads"].append(_jax_fps({n: p.grad.numpy().copy() for n, p in model.named_parameters()}))
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)  # clips in place: recorded grads are raw
            opt.step()
            rec.metrics(loss=loss, grad_norm=norm)
        opt.zero_grad()
        seen["params_after"].append(_jax_fps(reference.hf_tensors(model, M)))
        seen["layers"].append({n: fingerprint(t.numpy()) for n, t in captured.items()})
        seen["loss"].append(loss.detach().numpy().copy())
    run.finish()
    return seen


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    path = tmp_path_factory.mktemp("torch") / "run"
    seen = train(path, nudge_before=2)
    return traces.Run.open(path), seen


def _by_name(run, step: int) -> dict[str, int]:
    rec = run.trace.read(step)
    return {n: int(f) for n, f in zip(run.schema.tensor_names, rec.fingerprints)}


def test_the_schema_is_the_jax_trainers(recorded):
    from trainer.step import tensor_schema

    run, _ = recorded
    assert run.status == "complete" and len(run.trace) == STEPS
    assert run.schema.tensors == tensor_schema(CFG)
    assert run.schema.metrics == (("loss", "loss"), ("grad_norm", "backward"))
    assert run.manifest["recorded_by"] == "replay.torch"
    assert run.manifest["names"]["source"].startswith("trainer.reference:")


def test_hashes_and_metric_bits(recorded):
    run, seen = recorded
    for k in range(STEPS):
        rec = run.trace.read(k)
        want = data.example_hashes(_rows(k).numpy().astype(np.int32))
        assert np.array_equal(rec.example_hashes, want)
        assert rec.batch_hash == data.batch_hash(want)
        assert rec.metrics[:1].view(np.uint32)[0] == seen["loss"][k].view(np.uint32)


def test_fingerprints_equal_the_numpy_reference_of_each_tensor(recorded):
    run, seen = recorded
    for k in range(STEPS):
        got = _by_name(run, k)
        for name, fp in seen["layers"][k].items():
            assert got[name] == fp, (k, name)
        for j, fp in seen["grads"][k].items():  # the raw gradients, before the in-place clip
            assert got[f"grad/{j}"] == fp, (k, j)
        for j, fp in seen["params_after"][k].items():
            assert got[f"param/{j}"] == fp, (k, j)
        names = [j for j, _, _ in reference.param_map(M)]
        assert got["state/params"] == _tree([seen["params_before"][k][j] for j in names]), k


def test_a_parameter_changed_between_steps_is_seen_in_the_state(recorded):
    run, seen = recorded
    before_2 = _by_name(run, 2)["state/params"]
    after_1 = _tree([seen["params_after"][1][j] for j, _, _ in reference.param_map(M)])
    assert before_2 != after_1  # the nudge between steps 1 and 2 is in step 2's state, not a stale summary
    assert _by_name(run, 1)["state/params"] == _tree([seen["params_after"][0][j] for j, _, _ in reference.param_map(M)])


def test_rms_is_the_tensors(recorded):
    run, _ = recorded
    rec = run.trace.read(0)
    i = run.schema.tensor_names.index("param/final_norm.scale")
    assert rec.rms[i] == pytest.approx(1.0, abs=2e-3)  # ones, moved by one AdamW step of lr 1e-3


def test_two_identical_runs_compare_identical_and_a_changed_lr_is_found_at_the_update(recorded, tmp_path):
    run, _ = recorded
    same = tmp_path / "same"
    train(same, nudge_before=2)
    assert traces.compare(run.trace, traces.Run.open(same).trace).identical
    other = tmp_path / "lr"
    train(other, lr=2e-3, nudge_before=2)
    result = traces.compare(run.trace, traces.Run.open(other).trace)
    assert not result.identical and result.first_step == 0
    assert result.first.kind == "update" and result.first.name == "param/embed.embedding"
    assert {d.kind for d in result.diffs} == {"update"}  # data, state, forward, loss, backward agree
