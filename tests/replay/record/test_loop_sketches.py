"""`run.step(sketch_width=W)`: a user's own JAX loop records distance sketches, so `replay bisect`
compares it with a PyTorch run layer by layer from the two traces alone.

A two-layer MLP in JAX and the same MLP in torch, from the same weights on the same batches.
The JAX loop taps its layers under the torch modules' names (fc1, act, fc2) and its parameters
are named as torch names them (fc1.weight [out, in]), so forward layers and gradients pair by
name with a torch run recorded under its own names (no name map on either side).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import replay  # noqa: E402
import replay.torch  # noqa: E402
from replay.bisect.cross import cross_bisect  # noqa: E402
from replay.record.errors import RecordError  # noqa: E402
from tests.cli_util import invoke, last_json  # noqa: E402
from traces import Run  # noqa: E402
from traces.sketch import DEFAULT_WIDTH, sketch  # noqa: E402

B, D, H, O, STEPS, LR = 4, 6, 16, 3, 3, 0.1


def batch_at(k: int) -> np.ndarray:
    return np.random.default_rng([7, k]).normal(size=(B, D)).astype(np.float32)


def weights() -> dict:
    g = np.random.default_rng(3)
    return {"fc1": {"weight": g.normal(size=(H, D)).astype(np.float32) * 0.4, "bias": np.zeros(H, np.float32)},
            "fc2": {"weight": g.normal(size=(O, H)).astype(np.float32) * 0.3, "bias": np.full(O, 0.1, np.float32)}}


def _forward(p, x):
    h = x @ p["fc1"]["weight"].T + p["fc1"]["bias"]
    a = jnp.tanh(h)
    out = a @ p["fc2"]["weight"].T + p["fc2"]["bias"]
    return jnp.mean(out ** 2), (h, a, out)


@jax.jit
def step(params, x):
    (loss, (h, a, out)), grads = jax.value_and_grad(_forward, has_aux=True)(params, x)
    for name, value in (("fc1", h), ("act", a), ("fc2", out)):
        replay.tap(value, name)  # named as the torch modules whose outputs these are
    replay.tap(grads, "grad")  # grad/fc1.weight, ...: torch's parameter names
    return jax.tree.map(lambda w, g: w - LR * g, params, grads), {"loss": loss}


def init() -> dict:
    return jax.tree.map(jnp.asarray, weights())


@replay.entrypoint
def make(config: dict) -> replay.Loop:
    return replay.Loop(step=step, batch_at=batch_at, init=init)


def record_jax(path, **options) -> Run:
    run = replay.init(path, config={"lr": LR}, entrypoint=make)
    wrapped = run.step(**options)(step)
    params = init()
    run.save(0, params)
    for k in range(STEPS):
        params, _ = wrapped(params, batch_at(k))
    run.finish()
    return Run.open(path)


class Mlp(torch.nn.Module):
    def __init__(self, act: torch.nn.Module):
        super().__init__()
        self.fc1, self.act, self.fc2 = torch.nn.Linear(D, H), act, torch.nn.Linear(H, O)
        w = weights()
        with torch.no_grad():
            for name in ("fc1", "fc2"):
                for p in ("weight", "bias"):
                    getattr(getattr(self, name), p).copy_(torch.from_numpy(w[name][p]))

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class SlightlyOffTanh(torch.nn.Module):
    """A port mistake confined to one layer: tanh of a slightly scaled input."""

    def forward(self, x):
        return torch.tanh(x * 1.001)


def record_torch(path, act: torch.nn.Module) -> Run:
    model = Mlp(act)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    run = replay.torch.init(path, config={"lr": LR}, model=model, optimizer=opt)
    for k in range(STEPS):
        x = torch.from_numpy(batch_at(k))
        with run.step(x) as rec:
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            rec.metrics(loss=loss)
        opt.zero_grad()
    run.finish()
    return Run.open(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("loop_sketches")
    return {"jax": record_jax(root / "jax", sketch_width=DEFAULT_WIDTH),
            "torch": record_torch(root / "torch", torch.nn.Tanh()),
            "torch_off": record_torch(root / "torch_off", SlightlyOffTanh())}


def test_the_sketches_are_the_recorded_tensors_and_bisect_reaches_the_layer(runs):
    j = runs["jax"]
    assert j.schema.sketch_width == DEFAULT_WIDTH and j.manifest["record"]["sketch_width"] == DEFAULT_WIDTH
    names = j.schema.tensor_names
    rec = j.trace.read(0)
    # Step 0's first state leaf is the initial fc1.bias (jax.tree order): its sketch is the reference's.
    i = names.index("state/fc1.weight")
    want, norm = sketch(weights()["fc1"]["weight"], DEFAULT_WIDTH)
    np.testing.assert_allclose(rec.sketches[i], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(rec.norms[i], norm, rtol=1e-6)

    clean = cross_bisect(runs["torch"], j)
    assert clean.source == "traces" and clean.within_noise, clean.to_json()
    paired = {n for n, _ in clean.names}
    assert {"fc1", "act", "fc2", "grad/fc1.weight", "grad/fc2.bias"} <= paired
    assert max(v for d in clean.distances.values() for n, v in d.items() if n != "loss") > 0  # measured, not equal bits

    off = cross_bisect(runs["torch_off"], j)
    assert off.source == "traces" and (off.first_step, off.first_layer, off.cause) == (0, "act", "forward"), off.to_json()

    # The replay wraps the loop's step with the recorded sketch_width: the same program, bit for bit.
    replayed = invoke("run", str(j.path), "--steps", f"0:{STEPS - 1}", "--json")
    assert replayed.exit_code == 0 and last_json(replayed)["all_bit_exact"], replayed.output

    result = invoke("bisect", str(j.path), str(runs["torch_off"].path), "--json")
    assert result.exit_code == 1, result.output
    got = last_json(result)
    assert (got["first_step"], got["first_layer"], got["source"]) == (0, "act", "traces")


def test_sketches_need_the_layer_level_and_a_power_of_two(tmp_path):
    run = replay.init(tmp_path / "r", config={}, entrypoint=make)
    for bad in ({"sketch_width": 48}, {"sketch_width": 64, "level": "step"}):
        with pytest.raises(RecordError, match="sketch_width"):
            run.step(**bad)(step)


def test_a_sketched_run_resumes_bit_for_bit_and_only_with_its_width(tmp_path):
    """A resume re-records the steps after its checkpoint and keeps them only if bit-identical:
    the first step after a restore sketches the state it is fed as the chained steps did."""
    path = tmp_path / "r"
    run = replay.init(path, config={"lr": LR}, entrypoint=make)
    wrapped, params = run.step(sketch_width=DEFAULT_WIDTH)(step), init()
    for k in range(STEPS):
        if k in (0, 1):
            run.save(k, params)
        params, _ = wrapped(params, batch_at(k))
    run.close()  # a crash: not finished
    before = Run.open(path).trace.read(STEPS - 1)

    other = replay.init(path, resume=True)
    with pytest.raises(RecordError, match="different options"):
        other.step(sketch_width=0)(step)(other.restore(like=init()), batch_at(1))
    other.close()

    again = replay.init(path, resume=True)
    wrapped, params = again.step(sketch_width=DEFAULT_WIDTH)(step), again.restore(like=init())
    assert again.next_step == 1
    for k in range(1, STEPS + 1):
        params, _ = wrapped(params, batch_at(k))
    again.finish()
    done = Run.open(path)
    assert done.status == "complete" and done.trace.end == STEPS + 1 and again.rewritten == STEPS - 1
    after = done.trace.read(STEPS - 1)
    assert after.sketches.tobytes() == before.sketches.tobytes() and after.norms.tobytes() == before.norms.tobytes()
