"""The layer level fingerprints the state once per step: the state entering step k+1 is taken from
step k's update rows when the loop feeds back the state it got (replay/record/program.py). These
tests hold that shortcut to the truth: the recorded entering-state fingerprints are the host
reference fingerprints of the state actually fed, including when the loop changes the state
between steps (then the shortcut must not be taken), and the record packs into one buffer that
reads back bit for bit. (Replay across the chain, from a checkpoint onwards, is
tests/replay/test_record_api.py's bit-exact replay of a donated step.)"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import replay
from replay.record.packed import PackedRecord, pack
from traces import Run
from traces.fingerprint import fingerprint

B = 4


def init_state() -> dict:
    return {"w": jnp.arange(6, dtype=jnp.float32).reshape(2, 3) / 7, "n": jnp.int32(0)}


def batch_at(step: int) -> dict:
    return {"x": np.random.default_rng([3, step]).integers(-4, 5, (B, 2)).astype(np.float32) / 4}


def step_fn(state: dict, batch: dict) -> tuple[dict, dict]:
    def loss_fn(w):
        per = jnp.mean(jnp.tanh(batch["x"] @ w) ** 2, axis=-1)
        return jnp.mean(per), per

    (loss, per), g = jax.value_and_grad(loss_fn, has_aux=True)(state["w"])
    replay.tap(g, "grad")
    return {"w": state["w"] - 0.5 * g, "n": state["n"] + 1}, {"loss": loss, "example_loss": per}


@replay.entrypoint
def make(config: dict) -> replay.Loop:
    return replay.Loop(step=jax.jit(step_fn, donate_argnums=0), batch_at=batch_at, init=init_state)


def _record(path, perturb_at: int | None, steps: int = 6):
    """Records `steps` steps; before step `perturb_at` the loop edits the state outside the step.
    Returns the host copies of every state fed, by step."""
    loop = make({})
    run = replay.init(path, config={}, entrypoint=make)
    step = run.step()(loop.step)
    state, fed = loop.init(), {}
    for k in range(steps):
        if k == perturb_at:
            state = {**state, "w": state["w"] * 1.5}  # e.g. a weight reset or EMA swap done by the loop
        fed[k] = jax.device_get(state)
        state, _ = step(state, batch_at(k))
    run.finish()
    return fed


def _entering_fingerprints(run: Run, k: int) -> dict:
    rec = run.trace.read(k)
    return {n: int(rec.fingerprints[i]) for i, n in enumerate(run.schema.tensor_names) if n.startswith("state/")}


def _update_fingerprints(run: Run, k: int) -> dict:
    rec = run.trace.read(k)
    return {n.replace("update/", "state/", 1): int(rec.fingerprints[i])
            for i, n in enumerate(run.schema.tensor_names) if n.startswith("update/")}


def test_entering_state_fingerprints_are_the_fed_states(tmp_path):
    fed = _record(tmp_path / "r", perturb_at=None)
    run = Run.open(tmp_path / "r")
    for k, state in fed.items():
        want = {f"state/{name}": fingerprint(np.asarray(state[name])) for name in ("n", "w")}
        assert _entering_fingerprints(run, k) == want, k
        if k:  # chained: the same bits as the previous step's update rows
            assert _entering_fingerprints(run, k) == _update_fingerprints(run, k - 1)


def test_a_state_changed_between_steps_is_fingerprinted_as_fed(tmp_path):
    fed = _record(tmp_path / "r", perturb_at=3)
    run = Run.open(tmp_path / "r")
    got = _entering_fingerprints(run, 3)
    assert got["state/w"] == fingerprint(np.asarray(fed[3]["w"]))
    # What a shortcut taken blindly would have recorded: the unperturbed update of step 2.
    assert got["state/w"] != _update_fingerprints(run, 2)["state/w"]
    assert _entering_fingerprints(run, 4) == _update_fingerprints(run, 3)  # chained again afterwards


def test_a_packed_record_reads_back_bit_for_bit():
    values = {"loss": jnp.float32(-0.0), "example_loss": jnp.asarray([1.5, np.nan, np.inf, 2e-45], jnp.float32),
              "rng": jnp.asarray([7, 2**32 - 1], jnp.uint32), "fingerprints": jnp.arange(6, dtype=jnp.uint32).reshape(3, 2)}
    packed = jax.jit(lambda: pack(values))()
    assert isinstance(packed, PackedRecord) and len(jax.tree.leaves(packed)) == 1  # one buffer
    host = jax.device_get(packed)
    assert isinstance(host, PackedRecord) and set(host) == set(values)
    for key, x in values.items():
        got = np.asarray(host[key])
        assert got.dtype == np.asarray(x).dtype and got.shape == np.shape(x)
        assert got.tobytes() == np.asarray(x).tobytes(), key
    assert dict(host)["rng"].tolist() == [7, 2**32 - 1]
