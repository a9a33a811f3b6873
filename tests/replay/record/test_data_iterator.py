"""The second data style on a tiny loop: batches from an iterator whose state (grain's
get_state/set_state) is checkpointed with the train state, recorded, resumed and replayed;
random access re-iterates from the newest checkpoint; bad input and damage are one clear error."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import replay
from replay.record import data_iterator
from replay.record.errors import RecordError
from traces import Run
from replay.engine.protocol import load

B, EVERY = 4, 3


class Stream:
    """Batch i a pure function of (seed, i); the state is the position, as grain's is."""

    nexts = 0  # every next() of every Stream: what random access costs

    def __init__(self, seed: int = 5, length: int | None = None):
        self.seed, self.length, self.position = seed, length, 0

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self.length is not None and self.position >= self.length:
            raise StopIteration
        Stream.nexts += 1
        rng = np.random.default_rng([self.seed, self.position])
        self.position += 1
        return {"x": rng.standard_normal((B, 3)).astype(np.float32)}

    def get_state(self) -> dict:
        return {"position": self.position}

    def set_state(self, state: dict) -> None:
        self.position = state["position"]


def init_state() -> dict:
    return {"w": jnp.arange(3, dtype=jnp.float32) / 4, "n": jnp.int32(0)}


def step_fn(state: dict, batch: dict) -> tuple[dict, dict]:
    def loss_fn(w):
        per = jnp.mean((batch["x"] * w - 1.0) ** 2, axis=-1)
        return jnp.mean(per), per

    (loss, per), g = jax.value_and_grad(loss_fn, has_aux=True)(state["w"])
    return {"w": state["w"] - 0.1 * g, "n": state["n"] + 1}, {"loss": loss, "example_loss": per}


@replay.entrypoint
def make(config: dict) -> replay.Loop:
    seed, length = config["seed"], config.get("length")
    return replay.Loop(step=jax.jit(step_fn), init=init_state, data=lambda: Stream(seed, length))


def record(path, steps: int = 8, finish: bool = True, seed: int = 5) -> None:
    loop = make({"seed": seed})
    run = replay.init(path, config={"seed": seed}, entrypoint=make)
    step = run.step(batch_axis=0)(loop.step)
    state, batches = loop.init(), loop.data()
    for k in range(steps):
        if k % EVERY == 0:
            run.save(k, state, data=batches)
        state, _ = step(state, next(batches))
    run.finish() if finish else run.close()


def replay_range(path, first: int, last: int) -> dict:
    from replay.engine.contract import evaluate
    from replay.engine.engine import replay as run_replay

    run = Run.open(path)
    rep = load(run)
    manifest = run.manifest
    contract = evaluate(manifest["environment"], rep.environment(), manifest["program_hash"], rep.program_hash())
    return run_replay(run, rep, first, last, contract).to_json()


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "a"
    record(path)
    return path


def test_the_iterator_state_is_saved_with_each_checkpoint_and_fingerprinted(recorded):
    manifest = Run.open(recorded).manifest
    for k in (0, 3, 6):
        stored = json.loads((recorded / "checkpoints" / str(k) / "data" / "metadata").read_text())
        assert stored["value"] == {"position": k}
        assert manifest[data_iterator.DATA_FINGERPRINTS_KEY][str(k)] == data_iterator.fingerprint(stored)


def test_a_replay_from_a_checkpoint_restores_the_iterator_and_is_bit_exact(recorded):
    report = replay_range(recorded, 4, 7)
    assert report["checkpoint"] == 3 and report["all_bit_exact"] and report["bit_exact"] == 4, report


def test_random_access_reiterates_from_the_newest_checkpoint_at_or_before_the_step(recorded):
    rep = load(Run.open(recorded))
    reference = Stream()
    expected = [next(reference)["x"] for _ in range(8)]
    rep.restore(6)
    Stream.nexts = 0
    for k, cost in [(7, 2), (7, 0), (2, 3), (3, 1), (5, 2), (4, 2)]:  # cost: next() calls it needs
        before = Stream.nexts
        assert np.array_equal(rep.batch(k)["x"], expected[k]), k
        assert Stream.nexts - before == cost, (k, Stream.nexts - before)


def test_a_crashed_run_resumes_its_iterator_from_the_checkpoint(tmp_path, recorded):
    record(tmp_path / "a", steps=5, finish=False)
    loop = make({"seed": 5})
    run = replay.init(tmp_path / "a", resume=True)
    step = run.step(loop.step)
    batches = loop.data()
    state = run.restore(like=loop.init(), data=batches)
    assert run.next_step == 3 and batches.position == 3
    for k in range(3, 8):
        if k % EVERY == 0:
            run.save(k, state, data=batches)
        state, _ = step(state, next(batches))
    run.finish()
    resumed, whole = Run.open(tmp_path / "a"), Run.open(recorded)
    assert [list(resumed.trace.read(k).example_hashes) for k in range(8)] == \
        [list(whole.trace.read(k).example_hashes) for k in range(8)]
    assert replay_range(tmp_path / "a", 6, 7)["all_bit_exact"]


def test_a_damaged_iterator_state_is_refused_on_restore(tmp_path, recorded):
    import shutil

    from replay.record.orbax_io import CheckpointDamagedError

    shutil.copytree(recorded, tmp_path / "a")
    stored = tmp_path / "a" / "checkpoints" / "3" / "data" / "metadata"
    stored.write_text(stored.read_text().replace('"position": 3', '"position": 4'))
    rep = load(Run.open(tmp_path / "a"))
    with pytest.raises(CheckpointDamagedError, match="data iterator state of checkpoint 3 is damaged"):
        rep.restore(3)
    rep.restore(6)  # the others still restore


def test_restore_needs_the_iterator_exactly_when_the_checkpoint_holds_its_state(tmp_path):
    run = replay.init(tmp_path / "b", entrypoint=make)
    run.save(0, init_state())
    with pytest.raises(RecordError, match="saved without data="):
        run.restore(init_state(), 0, data=Stream())
    with pytest.raises(RecordError, match="checkpoint 0 of this run was saved without data="):
        run.save(1, init_state(), data=Stream())
    run.close()
    run = replay.init(tmp_path / "c", entrypoint=make)
    run.save(0, init_state(), data=Stream())
    with pytest.raises(RecordError, match="holds the data iterator's state; pass the iterator"):
        run.restore(init_state(), 0)
    with pytest.raises(RecordError, match="give data= here too"):
        run.save(1, init_state())
    run.close()


def test_bad_iterators_and_loops_are_one_clear_error(tmp_path):
    step = jax.jit(step_fn)
    with pytest.raises(RecordError, match="exactly one of batch_at= .* and data="):
        replay.Loop(step=step, init=init_state)
    with pytest.raises(RecordError, match="exactly one of"):
        replay.Loop(step=step, init=init_state, batch_at=lambda k: None, data=Stream)
    with pytest.raises(RecordError, match="not the Stream itself"):
        replay.Loop(step=step, init=init_state, data=Stream())
    run = replay.init(tmp_path / "a", entrypoint=make)
    with pytest.raises(RecordError, match="get_state"):
        run.save(0, init_state(), data=iter([1, 2]))

    class Tuples(Stream):
        def get_state(self):
            return {"position": (self.position, 0)}  # JSON would hand set_state a list

    with pytest.raises(RecordError, match="JSON does not hold exactly"):
        run.save(0, init_state(), data=Tuples())
    run.close()


def test_a_bytes_state_comes_back_as_bytes():
    class Bytes(Stream):
        def get_state(self):
            return json.dumps({"position": self.position}).encode()

    it = Bytes()
    next(it)
    stored = data_iterator.payload(it)
    assert json.loads(json.dumps(stored)) == stored and data_iterator.state_of(stored) == b'{"position": 1}'


def test_a_loop_whose_data_cannot_serve_the_run_says_why(tmp_path, recorded, monkeypatch):
    from replay.engine.replayer import ReplayUnavailable

    rep = load(Run.open(recorded))
    rep.restore(6)
    monkeypatch.setattr(rep._feed, "_make", lambda: Stream(5, length=7))
    rep._feed._it = None
    rep.restore(6)
    rep.batch(6)
    with pytest.raises(ReplayUnavailable, match="data iterator ended before the batch of step 7"):
        rep.batch(7)
    plain = tmp_path / "plain"  # recorded with run.save(k, state): a Loop(data=) has no state to restore
    run = replay.init(plain, config={"seed": 5}, entrypoint=make)
    step, batches, state = run.step(jax.jit(step_fn)), Stream(), init_state()
    run.save(0, state)
    for _ in range(2):
        state, _ = step(state, next(batches))
    run.finish()
    with pytest.raises(ReplayUnavailable, match="holds no data iterator state .* give the Loop batch_at"):
        load(Run.open(plain)).restore(0)
