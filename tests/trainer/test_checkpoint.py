"""replay/record/checkpointer.py with the trainer's TrainState: bit-identical round trips (also 8 devices <-> 1), step lookup,
retention, and a read-only Checkpointer that changes nothing on disk.

The pytest process has one CPU device; 8-device parts run in a child process with XLA_FLAGS
set before it imports JAX."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from trainer import mesh as M
from trainer import step
from replay.record.orbax_io import CheckpointError
from replay.record.checkpointer import Checkpointer
from trainer.config import apply_overrides
from trainer.presets import get_preset
from replay.record.fingerprint import state_fingerprint
from trainer.loop import state_step

ROOT = Path(__file__).resolve().parents[2]
CFG = apply_overrides(get_preset("tiny"), ["model.n_layers=1"])  # every kind of leaf; compiles faster


def leaf_bytes(tree) -> dict[str, tuple[str, tuple, bytes]]:
    """{path: (dtype, shape, raw bytes)} of every leaf."""
    out = {}
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        a = np.asarray(x)
        out[jax.tree_util.keystr(path)] = (a.dtype.str, a.shape, a.tobytes())
    return out


def bit_differences(a, b) -> list[str]:
    """Paths of the leaves whose dtype, shape or bytes differ (and leaves only one side has)."""
    la, lb = leaf_bytes(a), leaf_bytes(b)
    return sorted(k for k in set(la) | set(lb) if la.get(k) != lb.get(k))


def make_batch(cfg, seed: int = 0) -> dict[str, np.ndarray]:
    tokens = np.random.default_rng(seed).integers(
        0, cfg.model.vocab_size, (cfg.data.global_batch_size, cfg.model.seq_len + 1), dtype=np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def save(ck, state, **kwargs):
    """Checkpoint state.step (checkpoint k holds the TrainState with step == k, as the trainer saves)."""
    return ck.save(state_step(state), state, **kwargs)


def copy_state(state):
    return jax.tree.map(lambda x: jax.numpy.array(x, copy=True), state)


@pytest.fixture(scope="module")
def trained():
    """(mesh, compiled step, the state after one step): moments and counts are non-trivial."""
    mesh = M.make_mesh(CFG.mesh)
    shardings = M.state_shardings(mesh, M.abstract_state(CFG))
    fn = step.compile_step(CFG, "off", shardings, M.batch_sharding(mesh))
    state, _ = fn(M.init_sharded_state(CFG, mesh), M.global_batch(make_batch(CFG), mesh))
    assert int(state.step) == 1
    return mesh, fn, state


def tree_hash(path: Path) -> dict[str, str]:
    """Every file's content hash and every entry's kind and mtime under `path`."""
    out = {}
    for p in sorted(path.rglob("*")):
        st = p.stat()
        key = str(p.relative_to(path))
        if p.is_file():
            out[key] = hashlib.sha256(p.read_bytes()).hexdigest() + f" {st.st_mtime_ns} {st.st_size}"
        else:
            out[key] = f"dir {st.st_mtime_ns}"
    out["."] = f"dir {path.stat().st_mtime_ns}"
    return out


# ------------------------------------------------------------------------ round trip

def test_round_trip_is_bit_identical_and_trains(tmp_path, trained):
    mesh, fn, state = trained
    state = copy_state(state)
    with Checkpointer(tmp_path / "ck", keep=3) as ck:
        assert save(ck, state) == state_fingerprint(state)
        assert ck.steps() == [1]
        assert save(ck, state) is None  # already saved: the existing checkpoint stands
        back = ck.restore(1, M.sharded_abstract_state(CFG, mesh))
    assert bit_differences(state, back) == []
    assert isinstance(back, step.TrainState)
    assert jax.tree.structure(back) == jax.tree.structure(state)  # optax NamedTuples kept

    # The comparison really compares bits: flip one bit of one element of one leaf.
    kernel = np.asarray(back.params["block_00"]["mlp"]["up"]["kernel"]).copy()
    kernel.view(np.uint32)[3, 5] ^= 1 << 7
    params = jax.tree.map(lambda x: x, back.params)
    params["block_00"]["mlp"]["up"]["kernel"] = jax.numpy.asarray(kernel)
    flipped = back._replace(params=params)
    assert bit_differences(state, flipped) == [".params['block_00']['mlp']['up']['kernel']"]

    # A train step after restore runs, and gives the bits the uninterrupted state gives.
    batch = M.global_batch(make_batch(CFG, seed=1), mesh)
    a, ma = fn(copy_state(state), batch)
    b, mb = fn(copy_state(back), batch)
    assert int(b.step) == 2
    assert bit_differences(a, b) == [] and np.asarray(ma["loss"]).tobytes() == np.asarray(mb["loss"]).tobytes()


def test_steps_latest_and_missing(tmp_path, trained):
    mesh, _, state = trained
    ck = Checkpointer(tmp_path / "ck", keep=0)
    assert ck.steps() == [] and ck.latest_at_or_before(5) is None
    for k in (0, 3, 6):
        save(ck, state._replace(step=jax.numpy.asarray(k, jax.numpy.int32)))
    assert ck.steps() == [0, 3, 6]
    assert [ck.latest_at_or_before(s) for s in (-1, 0, 2, 3, 5, 6, 100)] == [None, 0, 0, 3, 3, 6, 6]
    assert int(ck.restore(3, M.sharded_abstract_state(CFG, mesh)).step) == 3  # checkpoint k holds state.step == k
    with pytest.raises(CheckpointError) as e:
        ck.restore(4, M.sharded_abstract_state(CFG, mesh))
    msg = str(e.value)
    assert "no checkpoint at step 4" in msg and "0, 3, 6" in msg and "\n" not in msg
    assert isinstance(e.value, ValueError)
    ck.close()


def test_restore_with_another_config_is_one_line(tmp_path, trained, capfd):
    mesh, _, state = trained
    with Checkpointer(tmp_path / "ck") as ck:
        save(ck, state)
        for override, words in ((["model.d_model=128"], ["params.block_00.attn.k.kernel is float32[64, 32] in the checkpoint", "[128, 64] in the target"]),
                                (["model.n_layers=3"], ["the target has params.block_01"])):
            other = apply_overrides(CFG, override)
            with pytest.raises(CheckpointError) as e:
                ck.restore(1, M.sharded_abstract_state(other, mesh))
            msg = str(e.value)
            assert "checkpoint 1 does not match" in msg and all(w in msg for w in words) and "\n" not in msg, msg
    assert "Traceback" not in capfd.readouterr().err  # checked before orbax starts reading


def test_keep_zero_keeps_all_and_keep_n_prunes(tmp_path, trained):
    _, _, state = trained
    at = lambda k: state._replace(step=jax.numpy.asarray(k, jax.numpy.int32))  # noqa: E731
    with Checkpointer(tmp_path / "all", keep=0) as ck:
        for k in range(5):
            save(ck, at(k))
        assert ck.steps() == [0, 1, 2, 3, 4]
    with Checkpointer(tmp_path / "two", keep=2) as ck:
        for k in range(5):
            save(ck, at(k))
        assert ck.steps() == [3, 4]
    assert sorted(p.name for p in (tmp_path / "two").iterdir() if p.name.isdigit()) == ["3", "4"]


def test_read_only_changes_nothing(tmp_path, trained):
    mesh, _, state = trained
    path = tmp_path / "ck"
    with Checkpointer(path, keep=0) as ck:
        save(ck, state)
        save(ck, state._replace(step=jax.numpy.asarray(5, jax.numpy.int32)))
    before = tree_hash(path)
    ro = Checkpointer(path, create=False)
    assert ro.steps() == [1, 5] and ro.latest_at_or_before(4) == 1
    back = ro.restore(1, M.sharded_abstract_state(CFG, mesh))
    assert bit_differences(state, back) == []
    with pytest.raises(CheckpointError, match="read-only"):
        save(ro, state._replace(step=jax.numpy.asarray(9, jax.numpy.int32)))
    with pytest.raises(CheckpointError):
        ro.restore(2, M.sharded_abstract_state(CFG, mesh))
    ro.close()
    assert tree_hash(path) == before

    missing = tmp_path / "nothing"
    with pytest.raises(CheckpointError, match="no checkpoint directory"):
        Checkpointer(missing, create=False)
    assert not missing.exists()


# ---------------------------------------------------------------- 8 devices <-> 1 device

# One 8-device process does both directions (each process pays JAX's start and the 8-device
# compiles): it restores the checkpoint this process saved on 1 device (ck1, want1.npz), then
# saves its own from its own training (ck8, want8.npz), which this process restores.
_EIGHT = r"""
import json, sys
import jax, numpy as np
from trainer import mesh as M, step
from replay.record.checkpointer import Checkpointer
from trainer.config import apply_overrides
from trainer.presets import get_preset
from replay.record.fingerprint import state_fingerprint
root = sys.argv[1]
assert jax.device_count() == 8, jax.device_count()
cfg = apply_overrides(get_preset("tiny"), ["model.n_layers=1", "mesh.data=1", "mesh.fsdp=-1"])
mesh = M.make_mesh(cfg.mesh)
shardings = M.state_shardings(mesh, M.abstract_state(cfg))
fn = step.compile_step(cfg, "off", shardings, M.batch_sharding(mesh))
def batch(seed):
    t = np.random.default_rng(seed).integers(0, cfg.model.vocab_size, (cfg.data.global_batch_size, cfg.model.seq_len + 1), dtype=np.int32)
    return M.global_batch({"inputs": t[:, :-1], "targets": t[:, 1:]}, mesh)
def leaves(tree):
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}
restore, save = {}, {}
want = np.load(f"{root}/want1.npz")
with Checkpointer(f"{root}/ck1", create=False) as ck:
    state = ck.restore(1, M.sharded_abstract_state(cfg, mesh))
got = leaves(state)
restore["differ"] = sorted(k for k in want.files if want[k].dtype != got[k].dtype or want[k].tobytes() != got[k].tobytes())
restore["same_keys"] = sorted(want.files) == sorted(got)
restore["fingerprint"] = state_fingerprint(state)
x = state.params["lm_head"]["kernel"]
restore["shard"], restore["shape"] = list(x.addressable_shards[0].data.shape), list(x.shape)
state, metrics = fn(state, batch(1))  # donates (deletes) the restored arrays
restore["after_step"] = int(state.step)
restore["loss_finite"] = bool(np.isfinite(float(metrics["loss"])))
state, _ = fn(M.init_sharded_state(cfg, mesh), batch(0))
np.savez(f"{root}/want8.npz", **leaves(state))
with Checkpointer(f"{root}/ck8", keep=0) as ck:
    ck.save(1, state)
    save["steps"] = ck.steps()
x = state.params["lm_head"]["kernel"]
save["shard"], save["shape"] = list(x.addressable_shards[0].data.shape), list(x.shape)
save["fingerprint"] = state_fingerprint(state)  # of the state sharded 8 ways
print(json.dumps({"restore": restore, "save": save}))
"""


@pytest.fixture(scope="module")
def eight(trained, tmp_path_factory) -> tuple[Path, dict]:
    """(folder, the 8-device process's report): ck1 and want1.npz saved here on 1 device, ck8 and
    want8.npz saved there on 8."""
    _, _, state = trained
    root = tmp_path_factory.mktemp("eight")
    with Checkpointer(root / "ck1", keep=0) as ck:
        save(ck, state)
    np.savez(root / "want1.npz", **{k: np.asarray(x) for k, x in (
        (jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_flatten_with_path(state)[0])})
    flags = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags)
    r = subprocess.run([sys.executable, "-c", _EIGHT, str(root)], env=env, cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return root, json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_saved_on_8_devices_restores_on_1(trained, eight):
    mesh, fn, _ = trained
    root, report = eight
    out = report["save"]
    assert out["steps"] == [1]
    assert out["shape"] == [64, 320] and out["shard"] == [64, 40]  # really sharded 8 ways
    with Checkpointer(root / "ck8", create=False) as ck:
        state = ck.restore(1, M.sharded_abstract_state(CFG, mesh))
    want = np.load(root / "want8.npz")
    got = leaf_bytes(state)
    assert sorted(got) == sorted(want.files)
    assert [k for k in want.files if got[k] != (want[k].dtype.str, want[k].shape, want[k].tobytes())] == []
    assert state_fingerprint(state) == out["fingerprint"]  # the same bits give the same fingerprint, any sharding
    state, metrics = fn(state, M.global_batch(make_batch(CFG, seed=1), mesh))
    assert int(state.step) == 2 and np.isfinite(float(metrics["loss"]))


@pytest.mark.slow
def test_saved_on_1_device_restores_on_8(trained, eight):
    _, _, state = trained
    out = eight[1]["restore"]
    assert out["same_keys"] and out["differ"] == []
    assert out["fingerprint"] == state_fingerprint(state)
    assert out["shard"] == [64, 40]  # restored straight into the 8-way layout
    assert out["after_step"] == 2 and out["loss_finite"]
