"""A recorded step is lowered once per recording start, not once more for its hash
(replay/record/program.py): with every input on the default device, the program compiled and the
program hashed are one lowering, and the hash is the one a replay computes from eval_shape values."""

import jax
import jax.numpy as jnp
import numpy as np

from replay.record.options import StepOptions
from replay.record.program import Program


def _step(state, batch):
    w = state["w"] - 0.1 * jnp.mean(batch["x"], axis=0)
    return {"w": w}, {"loss": jnp.sum(w * w)}


def test_a_one_device_step_is_lowered_once_and_hashed_as_a_replay_hashes_it(monkeypatch):
    lowerings = []
    real = jax.stages.Traced.lower

    def lower(self, *a, **k):
        lowerings.append(1)
        return real(self, *a, **k)

    monkeypatch.setattr(jax.stages.Traced, "lower", lower)
    state = {"w": jax.device_put(jnp.zeros(4), jax.devices()[0])}  # committed: a one-device sharding
    batch = {"x": np.ones((2, 4), np.float32)}
    recorded = Program(jax.jit(_step), StepOptions(level="step"))
    recorded.compile(state, batch)
    assert len(lowerings) == 1  # was 2: the step lowered with its shardings, then again without for the hash
    replayed = Program(jax.jit(_step), StepOptions(level="step"))
    replayed.compile(jax.eval_shape(lambda: state), batch)  # as replay/record/replayable.py does
    assert recorded.program_hash == replayed.program_hash
    _, metrics, _ = recorded(state, batch)  # runs on the committed inputs, as the plain step does
    _, plain = jax.jit(_step)(state, batch)
    assert np.asarray(metrics["loss"]).tobytes() == np.asarray(plain["loss"]).tobytes()
