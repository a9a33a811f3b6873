"""Asynchronous checkpoint saves (replay/record/checkpointer.py, save(k, state, wait=False)).

The write to disk is held back (orbax's host-to-storage coroutine waits for an event), so every
claim is checked at a known moment rather than by timing: save() returns while the write is
held; the caller may donate the state's buffers at once; steps() lists only complete
checkpoints, and the disk as a crash would leave it holds the earlier ones, restorable; the
next save starts only once the previous is complete; a failure surfaces at the next wait,
naming the checkpoint that failed.
"""

from __future__ import annotations

import asyncio
import errno
import threading

import jax
import jax.numpy as jnp
import pytest
from orbax.checkpoint._src.serialization import serialization

from replay.record.fingerprint import state_fingerprint
from replay.record.orbax_io import CheckpointDiskFullError
from tests.trainer.test_checkpoint import CFG, copy_state, leaf_bytes, save
from trainer import mesh as M
from replay.record.checkpointer import Checkpointer

SAFETY_S = 120  # a save that blocked on the held write would hang the test without it


@pytest.fixture(scope="module")
def initial():
    """(mesh, the initial TrainState): what a save holds does not matter here, only when."""
    mesh = M.make_mesh(CFG.mesh)
    return mesh, M.init_sharded_state(CFG, mesh)


def at(state, k: int):
    return copy_state(state._replace(step=jnp.asarray(k, jnp.int32)))


@pytest.fixture
def held_writes(monkeypatch):
    """An event that releases every checkpoint write; `fail` makes a released write hit a full disk."""
    release, fail = threading.Event(), threading.Event()
    real = serialization.async_serialize_from_host

    async def held(*args, **kwargs):
        while not release.is_set():
            await asyncio.sleep(0.005)
        if fail.is_set():
            raise OSError(errno.ENOSPC, "No space left on device")
        return await real(*args, **kwargs)

    monkeypatch.setattr(serialization, "async_serialize_from_host", held)
    safety = threading.Timer(SAFETY_S, release.set)
    safety.start()
    yield release, fail
    release.set()
    safety.cancel()


def test_an_async_save_returns_before_its_write_and_a_crash_then_leaves_the_earlier_checkpoints(
        tmp_path, initial, held_writes):
    mesh, state = initial
    release, _ = held_writes
    abstract = M.sharded_abstract_state(CFG, mesh)
    ck = Checkpointer(tmp_path / "ck", keep=1)
    first = at(state, 1)
    release.set()
    save(ck, first)  # on disk before the writes are held
    release.clear()
    try:
        second = at(state, 2)
        want = leaf_bytes(at(state, 2))  # of a copy: reading `second` to the host would pin its buffers
        assert save(ck, second, wait=False) is not None
        assert not release.is_set()  # it returned while its bytes were held back from the disk
        assert ck.pending == 2 and ck.steps() == [1]
        # The step loop donates the state to the next step at once: the checkpoint must not care.
        # On CPU orbax holds zero-copy host views of the buffers until the write ends, so JAX
        # copies instead of donating them meanwhile (measured); once written, they donate.
        params = second.params
        donate = jax.jit(lambda p: jax.tree.map(lambda x: x + 1, p), donate_argnums=0)
        donate(params)
        # The disk as a crash now would leave it: checkpoint 1 complete and intact (keep=1 prunes it
        # only once 2 is complete), and nothing of 2 listed.
        with Checkpointer(tmp_path / "ck", create=False) as reader:
            assert reader.steps() == [1]
            reader.restore(1, abstract, fingerprint=state_fingerprint(first))
        release.set()
        assert ck.wait() == 2 and ck.pending is None and ck.wait() is None
        assert ck.steps() == [2]
        donate(params)
        assert all(x.is_deleted() for x in jax.tree.leaves(params))  # not pinned after the write
        assert leaf_bytes(ck.restore(2, abstract)) == want  # the bytes of the state as it was at save()
    finally:
        release.set()
        ck.close()


def test_a_save_starts_only_once_the_previous_one_is_complete(tmp_path, initial, held_writes):
    _, state = initial
    release, _ = held_writes
    ck = Checkpointer(tmp_path / "ck", keep=0)
    started = []
    real_save = ck._manager.save

    def save(step, *args, **kwargs):  # what is on disk when orbax is asked to write `step`
        started.append((step, sorted(int(p.name) for p in ck.path.iterdir() if p.name.isdigit())))
        return real_save(step, *args, **kwargs)

    waiting, second = threading.Event(), None  # set once the second save waits for a save in flight
    real_wait = ck._manager.wait_until_finished

    def wait_until_finished():
        if threading.current_thread() is second:
            waiting.set()
        return real_wait()

    ck._manager.save, ck._manager.wait_until_finished = save, wait_until_finished
    try:
        ck.save(3, at(state, 3), wait=False)
        second = threading.Thread(target=ck.save, args=(4, at(state, 4)), kwargs={"wait": False})
        second.start()
        assert waiting.wait(SAFETY_S)
        assert second.is_alive() and started == [(3, [])]  # waiting for 3, orbax not yet asked for 4
        release.set()
        second.join(SAFETY_S)
        assert started == [(3, []), (4, [3])]  # 4 began only with 3 complete on disk
        ck.wait()
        assert ck.steps() == [3, 4]
    finally:
        release.set()
        ck.close()


def test_a_failed_async_save_surfaces_at_the_next_save_naming_its_step(tmp_path, initial, held_writes):
    mesh, state = initial
    release, fail = held_writes
    ck = Checkpointer(tmp_path / "ck", keep=0)
    fail.set()
    try:
        assert save(ck, at(state, 5), wait=False) is not None
        release.set()
        with pytest.raises(CheckpointDiskFullError) as e:
            save(ck, at(state, 6), wait=False)
        assert e.value.step == 5 and "checkpoint 5 could not be saved" in str(e.value) and "\n" not in str(e.value)
        assert ck.steps() == [] and ck.pending is None
    finally:
        ck.close()  # the failure was reported once; closing does not raise it again
