"""trainer/mesh.py: mesh sizes, FSDP shardings, sharded init with the unsharded bits, batches.

The pytest process has one CPU device; the multi-device checks run in a child process with
XLA_FLAGS set before it imports JAX (never in this process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from tests.ports import free_port
from trainer import mesh as M
from trainer import step
from trainer.config import MeshConfig, apply_overrides
from trainer.presets import get_preset

ROOT = Path(__file__).resolve().parents[2]


def leaf_bytes(tree) -> list[tuple[str, str, tuple, bytes]]:
    """(path, dtype, shape, raw bytes) of every leaf: equal lists mean bit-identical trees."""
    out = []
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        a = np.asarray(x)
        out.append((jax.tree_util.keystr(path), a.dtype.str, a.shape, a.tobytes()))
    return out


# ------------------------------------------------------------------------ sizes and errors

@pytest.mark.parametrize("data, fsdp, n, want", [
    (-1, 1, 8, (8, 1)), (1, -1, 8, (1, 8)), (2, -1, 8, (2, 4)), (-1, 4, 8, (2, 4)),
    (2, 4, 8, (2, 4)), (-1, 1, 1, (1, 1)), (1, -1, 256, (1, 256)),
])
def test_mesh_shape_resolves_minus_one(data, fsdp, n, want):
    assert M.mesh_shape(MeshConfig(data=data, fsdp=fsdp), n) == want


@pytest.mark.parametrize("data, fsdp, n, words", [
    (2, 2, 8, ["mesh.data=2 x mesh.fsdp=2 = 4", "8 devices", "product is 8"]),
    (-1, 3, 8, ["mesh.fsdp=3 does not divide the 8 devices"]),
    (3, -1, 8, ["mesh.data=3 does not divide the 8 devices"]),
    (4, 1, 1, ["= 4 does not match the 1 devices"]),
])
def test_mesh_shape_errors_are_one_line(data, fsdp, n, words):
    with pytest.raises(M.MeshError) as e:
        M.mesh_shape(MeshConfig(data=data, fsdp=fsdp), n)
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg
    assert isinstance(e.value, ValueError)


def test_make_mesh_one_device():
    mesh = M.make_mesh(MeshConfig())
    assert mesh.axis_names == ("data", "fsdp") and dict(mesh.shape) == {"data": 1, "fsdp": 1}
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
    with pytest.raises(M.MeshError, match="does not match the 1 devices"):
        M.make_mesh(MeshConfig(data=2, fsdp=1))


def test_fsdp_spec_picks_largest_divisible_axis():
    assert M.fsdp_spec((64, 320), 8) == P(None, "fsdp")
    assert M.fsdp_spec((320, 64), 8) == P("fsdp")
    assert M.fsdp_spec((64, 64), 8) == P("fsdp")  # tie: the first
    assert M.fsdp_spec((100, 64), 8) == P(None, "fsdp")  # 100 is larger but 8 does not divide it
    assert M.fsdp_spec((7, 5), 8) == P()
    assert M.fsdp_spec((4,), 8) == P()  # smaller than the axis
    assert M.fsdp_spec((), 8) == P()
    assert M.fsdp_spec((64, 320), 1) == P()


def test_check_batch_error_names_the_numbers():
    mesh = M.make_mesh(MeshConfig())
    M.check_batch(7, mesh)  # one device takes any batch
    fake = type("FakeMesh", (), {"size": 8, "shape": {"data": 2, "fsdp": 4}})()
    with pytest.raises(M.MeshError) as e:
        M.check_batch(12, fake)
    msg = str(e.value)
    assert "global_batch_size=12" in msg and "8 devices" in msg and "data=2 x fsdp=4" in msg and "\n" not in msg
    M.check_batch(16, fake)


def test_shardings_tree_and_abstract_targets():
    cfg = get_preset("tiny")
    mesh = M.make_mesh(cfg.mesh)
    abstract = M.abstract_state(cfg)
    shardings = M.state_shardings(mesh, abstract)
    assert isinstance(shardings, step.TrainState)
    assert jax.tree.structure(shardings) == jax.tree.structure(abstract)
    target = M.abstract_with_shardings(abstract, shardings)
    for a, t in zip(jax.tree.leaves(abstract), jax.tree.leaves(target)):
        assert isinstance(t, jax.ShapeDtypeStruct) and t.shape == a.shape and t.dtype == a.dtype
        assert t.sharding is not None
    # optax's NamedTuples survive (a target read from checkpoint metadata would lose them)
    assert type(target.opt_state[1]).__name__ == "InjectStatefulHyperparamsState"


def test_init_sharded_state_has_init_state_bits_one_device():
    cfg = get_preset("tiny")
    state = M.init_sharded_state(cfg, M.make_mesh(cfg.mesh))
    assert leaf_bytes(state) == leaf_bytes(step.init_state(cfg))


def test_global_batch_one_process():
    mesh = M.make_mesh(MeshConfig())
    assert M.local_batch_range(8, mesh) == (0, 8)
    local = {"inputs": np.arange(8 * 4, dtype=np.int32).reshape(8, 4)}
    g = M.global_batch(local, mesh)
    assert g["inputs"].shape == (8, 4) and np.array_equal(np.asarray(g["inputs"]), local["inputs"])


# --------------------------------------------------------------------- 8 virtual devices

_EIGHT = r"""
import json, sys
import jax, numpy as np
from trainer import mesh as M, step
from trainer.config import apply_overrides
from trainer.presets import get_preset
assert jax.device_count() == 8, jax.device_count()
cfg = apply_overrides(get_preset("tiny"), ["mesh.data=2", "mesh.fsdp=4", "data.global_batch_size=16"])
mesh = M.make_mesh(cfg.mesh)
state = M.init_sharded_state(cfg, mesh)
out = {"mesh": dict(mesh.shape), "leaves": {}}
for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
    out["leaves"][jax.tree_util.keystr(path)] = {
        "shape": list(x.shape), "shard": list(x.addressable_shards[0].data.shape),
        "spec": str(x.sharding.spec), "devices": len(x.sharding.device_set)}
np.savez(sys.argv[1], **{jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(state)[0]})
try:
    M.check_batch(12, mesh)
except M.MeshError as e:
    out["check_batch"] = str(e)
out["range"] = M.local_batch_range(16, mesh)
local = np.arange(16 * 3, dtype=np.int32).reshape(16, 3)
g = M.global_batch({"inputs": local}, mesh)["inputs"]
out["batch_equal"] = bool(np.array_equal(np.asarray(g), local))
out["batch_shards"] = sorted(tuple(s.data.shape) for s in g.addressable_shards)
out["batch_spec"] = str(g.sharding.spec)
print(json.dumps(out))
"""


@pytest.mark.slow
def test_eight_devices_fsdp_really_shards_and_init_bits_match(tmp_path):
    flags = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags)
    npz = tmp_path / "state.npz"
    r = subprocess.run([sys.executable, "-c", _EIGHT, str(npz)], env=env, cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["mesh"] == {"data": 2, "fsdp": 4}
    leaves = out["leaves"]
    emb = leaves[".params['embed']['embedding']"]  # (320, 64): the vocab axis is the larger
    assert emb["shape"] == [320, 64] and emb["shard"] == [80, 64] and "fsdp" in emb["spec"]
    head = leaves[".params['lm_head']['kernel']"]  # (64, 320)
    assert head["shard"] == [64, 80]
    mu = ".opt_state[1].inner_state[0].mu['lm_head']['kernel']"
    assert leaves[mu]["shard"] == head["shard"] and leaves[mu]["spec"] == head["spec"]  # moments mirror params
    for name, leaf in leaves.items():
        if name.startswith(".params"):
            assert "fsdp" in leaf["spec"], name  # every tiny param has an axis 4 divides
        if name in (".step", ".key") or leaf["shape"] == []:
            assert "fsdp" not in leaf["spec"] and leaf["shard"] == leaf["shape"], name
        assert leaf["devices"] == 8
    # the sharded init has exactly the bits of the unsharded init in this (1-device) process
    cfg = apply_overrides(get_preset("tiny"), ["mesh.data=2", "mesh.fsdp=4", "data.global_batch_size=16"])
    ref = {k: np.asarray(v) for k, v in ((jax.tree_util.keystr(p), x) for p, x in
                                         jax.tree_util.tree_flatten_with_path(step.init_state(cfg))[0])}
    got = np.load(npz)
    assert sorted(got.files) == sorted(ref)
    for k in ref:
        assert got[k].dtype == ref[k].dtype and got[k].tobytes() == ref[k].tobytes(), k
    assert "global_batch_size=12" in out["check_batch"] and "8 devices" in out["check_batch"]
    assert out["range"] == [0, 16]
    assert out["batch_equal"] and out["batch_shards"] == [[2, 3]] * 8
    assert "data" in out["batch_spec"] and "fsdp" in out["batch_spec"]


# ------------------------------------------------------------- 2 processes x 2 devices

_PROC = r"""
import json, sys
import jax
pid, port, ckdir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid)
import jax.numpy as jnp, numpy as np
from trainer import mesh as M
from replay.record.checkpointer import Checkpointer
from trainer.config import apply_overrides
from trainer.presets import get_preset
assert jax.device_count() == 4 and jax.local_device_count() == 2
cfg = apply_overrides(get_preset("tiny"), ["mesh.data=2", "mesh.fsdp=2", "data.global_batch_size=8"])
mesh = M.make_mesh(cfg.mesh)
start, stop = M.local_batch_range(8, mesh)
full = np.arange(8 * 3, dtype=np.int32).reshape(8, 3) * 7 + 1
g = M.global_batch({"inputs": full[start:stop]}, mesh)["inputs"]
rows = jax.jit(lambda x: jnp.sum(x, axis=1), out_shardings=M.replicated(mesh))(g)
state = M.init_sharded_state(cfg, mesh)
ck = Checkpointer(ckdir, keep=0)
ck.save(0, state)
back = ck.restore(0, M.sharded_abstract_state(cfg, mesh))
same = all(np.array_equal(np.asarray(a.addressable_shards[i].data), np.asarray(b.addressable_shards[i].data))
           for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(back)) for i in range(len(a.addressable_shards)))
ck.close()
print(json.dumps({"range": [start, stop], "rows": np.asarray(rows.addressable_shards[0].data).tolist(),
                  "steps": ck.steps(), "same": same}))
"""


@pytest.mark.slow
def test_two_processes_global_batch_and_checkpoint(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip())
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", _PROC, str(i), port, str(tmp_path / "ck")], env=env, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = []
    for p in procs:
        try:
            so, se = p.communicate(timeout=180)
        finally:
            if p.poll() is None:
                p.kill()
        assert p.returncode == 0, se[-3000:]
        outs.append(json.loads(so.strip().splitlines()[-1]))
    assert outs[0]["range"] == [0, 4] and outs[1]["range"] == [4, 8]  # each host loads its half
    full = np.arange(8 * 3, dtype=np.int32).reshape(8, 3) * 7 + 1
    for o in outs:
        assert o["rows"] == full.sum(axis=1).tolist()  # the global array is the whole batch, in order
        assert o["steps"] == [0] and o["same"]
