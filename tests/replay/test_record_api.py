"""The recording API on a tiny loop: what the wrapper derives, that it changes nothing the step
returns, donated states, resume, and one clear error for each kind of bad input."""

from __future__ import annotations

import functools
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import replay
from replay.record.errors import RecordError
from replay.record.hashing import example_hashes
from traces import Run
from traces.fingerprint import fingerprint
from trainer.data import example_hashes as trainer_example_hashes
from replay.engine.protocol import load

B = 8


def init_state() -> dict:
    return {"w": jnp.arange(12, dtype=jnp.float32).reshape(4, 3) / 10, "key": jax.random.key(3), "n": jnp.int32(0)}


def batch_at(step: int) -> dict:
    rng = np.random.default_rng([7, step])
    return {"x": rng.integers(-4, 5, (B, 4)).astype(np.float32) / 4}


def step_fn(state: dict, batch: dict, scale: float = 1.0) -> tuple[dict, dict]:
    key = jax.random.fold_in(state["key"], state["n"])

    def loss_fn(w):
        out = jnp.tanh(batch["x"] @ w) + 0.01 * jax.random.normal(key, (B, 3))
        per = jnp.mean(out ** 2, axis=-1)
        return jnp.mean(per), (per, out)

    (loss, (per, out)), g = jax.value_and_grad(loss_fn, has_aux=True)(state["w"])
    replay.tap(g, "grad")
    return {"w": state["w"] - 0.1 * scale * g, "key": state["key"], "n": state["n"] + 1}, {"loss": loss, "example_loss": per}


@replay.entrypoint
def make(config: dict) -> replay.Loop:
    step = jax.jit(functools.partial(step_fn, scale=config["scale"]), donate_argnums=0)
    return replay.Loop(step=step, batch_at=batch_at, init=init_state)


def record(path, steps: int = 6, scale: float = 1.0, every: int = 3, finish: bool = True):
    loop = make({"scale": scale})
    run = replay.init(path, config={"scale": scale}, entrypoint=make, dataset_size=100)
    step = run.step(batch_axis=0)(loop.step)
    state = loop.init()
    for k in range(steps):
        if k % every == 0:
            run.save(k, state)
        state, metrics = step(state, loop.batch_at(k))
    run.finish() if finish else run.close()
    return state


def replay_all(path, first: int, last: int) -> dict:
    from replay.engine.contract import evaluate
    from replay.engine.engine import replay as run_replay

    run = Run.open(path)
    rep = load(run)
    contract = evaluate(run.manifest["environment"], rep.environment(), run.manifest["program_hash"], rep.program_hash())
    return run_replay(run, rep, first, last, contract).to_json()


def test_records_and_replays_a_donated_step_bit_exactly(tmp_path):
    record(tmp_path / "a")
    run = Run.open(tmp_path / "a")
    assert run.manifest["entrypoint"] == "tests.replay.test_record_api:make" and run.manifest["dataset_size"] == 100
    assert run.schema.rng_words == 2 and run.schema.example_metrics == ("loss",)
    assert run.schema.tensor_names == ("state/key", "state/n", "state/w", "grad", "update/key", "update/n", "update/w")
    # The entering state's fingerprint was read before the donated step reused its buffers.
    rec0 = run.trace.read(0)
    assert int(rec0.fingerprints[2]) == fingerprint(np.asarray(init_state()["w"]))
    assert np.array_equal(rec0.rng, np.asarray(jax.random.key_data(init_state()["key"])))
    report = replay_all(tmp_path / "a", 3, 5)
    assert report["all_bit_exact"] and report["bit_exact"] == 3 and report["checkpoint"] == 3


def test_a_different_program_is_caught_by_the_replay(tmp_path):
    record(tmp_path / "a")
    run = Run.open(tmp_path / "a")
    manifest = dict(run.manifest, config={"scale": 1.5})  # replay it with other code: the bits must differ
    from traces.run import write_manifest

    write_manifest(tmp_path / "a" / "run.json", manifest)
    report = replay_all(tmp_path / "a", 3, 4)
    assert not report["all_bit_exact"] and report["first_mismatch"]["fields"][0]["kind"] == "update"


def test_the_wrapped_step_returns_what_the_step_returns(tmp_path):
    loop = make({"scale": 1.0})
    plain = jax.jit(functools.partial(step_fn, scale=1.0))
    run = replay.init(tmp_path / "a", config={"scale": 1.0}, entrypoint=make)
    wrapped = run.step(loop.step)
    s1, s2 = init_state(), init_state()
    for k in range(3):
        s1, m1 = plain(s1, batch_at(k))
        s2, m2 = wrapped(s2, batch_at(k))
        for a, b in zip(jax.tree.leaves((s1, m1)), jax.tree.leaves((s2, m2))):
            a, b = (jax.random.key_data(a), jax.random.key_data(b)) if a.dtype != b.dtype or "key" in str(a.dtype) else (a, b)
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    run.finish()


def test_a_crashed_run_resumes_and_rechecks_its_steps(tmp_path):
    record(tmp_path / "a", steps=5, finish=False)
    assert Run.open(tmp_path / "a").status == "crashed"
    loop = make({"scale": 1.0})
    run = replay.init(tmp_path / "a", resume=True)
    step = run.step(loop.step)
    state = run.restore(like=loop.init())
    assert run.next_step == 3
    for k in range(3, 8):
        if k % 3 == 0:
            run.save(k, state)
        state, _ = step(state, batch_at(k))
    run.finish()
    resumed = Run.open(tmp_path / "a")
    assert resumed.status == "complete" and resumed.trace.end == 8 and resumed.manifest["checkpoints"] == [0, 3, 6]
    assert replay_all(tmp_path / "a", 6, 7)["all_bit_exact"]


def test_hashes_follow_the_trainers_convention():
    rows = np.arange(24, dtype=np.int32).reshape(6, 4)
    assert np.array_equal(example_hashes(rows), trainer_example_hashes(rows))
    a = {"x": rows, "y": rows[:, :1].astype(np.float32)}
    b = {"x": rows.copy(), "y": rows[:, :1].astype(np.float32)}
    b["y"][4] += 1
    ha, hb = example_hashes(a), example_hashes(b)
    assert list(np.nonzero(ha != hb)[0]) == [4]
    assert np.array_equal(example_hashes(rows.T, batch_axis=1), example_hashes(rows))


# ------------------------------------------------------------------------ bad input: one clear error


def _first_call(tmp_path, fn, state=None, batch=None, **options):
    run = replay.init(tmp_path / "r", config={"scale": 1.0}, entrypoint=make)
    try:
        return run.step(**options)(fn)(state if state is not None else init_state(), batch if batch is not None else batch_at(0))
    finally:
        run.close()


def test_a_step_without_a_loss_is_refused_unless_it_says_so(tmp_path):
    def no_loss(state, batch):
        s, m = step_fn(state, batch)
        return s, {"xent": m["loss"]}

    with pytest.raises(RecordError, match="no scalar metric 'loss'.*xent.*loss=None"):
        _first_call(tmp_path, jax.jit(no_loss))
    _first_call(tmp_path / "b", jax.jit(no_loss), loss="xent")
    assert Run.open(tmp_path / "b" / "r").schema.metric_names == ("loss",)
    _first_call(tmp_path / "c", jax.jit(no_loss), loss=None)
    assert Run.open(tmp_path / "c" / "r").schema.metric_names == ("xent",)


def test_a_batch_without_the_batch_axis_is_refused(tmp_path):
    with pytest.raises(RecordError, match="batch leaf x has shape \\[8, 4\\], without batch axis 2"):
        _first_call(tmp_path, jax.jit(step_fn), batch_axis=2)
    with pytest.raises(RecordError, match="batch leaf n is a int"):
        _first_call(tmp_path / "b", jax.jit(step_fn), batch={"x": batch_at(0)["x"], "n": 3})


@pytest.mark.parametrize("on_device", [False, True])
def test_a_batch_holding_typed_prng_keys_is_refused_naming_the_leaf(tmp_path, on_device):
    """Typed keys have no bytes to hash (numpy refused them with a TypeError); the step that meets
    them says which leaf and what to feed instead, whether the batch is hashed at once or after
    its step (a batch of device arrays)."""
    run = replay.init(tmp_path / "r", config={"on_device": on_device}, entrypoint=make_with_keys)
    try:
        with pytest.raises(RecordError, match=r"batch leaf k holds key<fry> \(typed PRNG keys.*jax.random.key_data"):
            run.step()(jax.jit(_step_without_keys))(init_state(), _batch_with_keys(0, on_device))
    finally:
        run.close()


def test_several_processes_refuse_typed_prng_keys_before_copying_their_rows():
    """The multi-process path copies each process's rows itself (replay/record/multihost.py); a key
    leaf is refused there in the same line (one process here: the refusal comes before any gather)."""
    from replay.record.multihost import gathered_hashes

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    on_mesh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    batch = {"x": jax.device_put(batch_at(0)["x"], on_mesh),
             "keys": {"k": jax.device_put(jax.random.split(jax.random.key(0), B), on_mesh)}}
    with pytest.raises(RecordError, match=r"batch leaf keys.k holds key<fry> \(typed PRNG keys.*jax.random.key_data"):
        gathered_hashes(batch, 0)


def _batch_with_keys(step: int, on_device: bool) -> dict:
    x = batch_at(step)["x"]
    return {"x": jax.device_put(x) if on_device else x, "k": jax.random.split(jax.random.key(step), x.shape[0])}


def _step_without_keys(state, batch):
    return step_fn(state, {"x": batch["x"]})


@replay.entrypoint
def make_with_keys(config: dict) -> replay.Loop:
    return replay.Loop(step=jax.jit(_step_without_keys), init=init_state,
                       batch_at=lambda k: _batch_with_keys(k, config["on_device"]))


def test_a_state_leaf_that_is_not_an_array_is_refused(tmp_path):
    state = {**init_state(), "n": 0}
    with pytest.raises(RecordError, match="state leaf n is a int, not an array"):
        _first_call(tmp_path, jax.jit(step_fn), state=state)


def test_init_on_a_folder_holding_another_run_is_refused(tmp_path):
    record(tmp_path / "a", steps=1)
    with pytest.raises(RecordError, match="holds another run; record into a new folder"):
        replay.init(tmp_path / "a", entrypoint=make)
    with pytest.raises(RecordError, match="entrypoint=make"):
        replay.init(tmp_path / "b")


def test_a_tap_inside_the_loss_function_is_refused(tmp_path):
    def tapped_inside(state, batch):
        def loss_fn(w):
            return replay.tap(jnp.mean(batch["x"] @ w), "forward")

        loss, g = jax.value_and_grad(loss_fn)(state["w"])
        return {**state, "w": state["w"] - g}, {"loss": loss}

    with pytest.raises(RecordError, match="return that value from it"):
        _first_call(tmp_path, jax.jit(tapped_inside))


def test_save_must_name_the_step_the_state_enters(tmp_path):
    loop = make({"scale": 1.0})
    run = replay.init(tmp_path / "a", config={"scale": 1.0}, entrypoint=make)
    step = run.step(loop.step)
    state, _ = step(loop.init(), batch_at(0))
    with pytest.raises(RecordError, match="save it as 1"):
        run.save(0, state)
    run.close()


def test_import_replay_does_not_import_jax():
    code = "import sys, replay; assert 'jax' not in sys.modules; replay.Loop; assert 'jax' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
