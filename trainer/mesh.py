"""Device mesh and shardings: a ("data", "fsdp") mesh, FSDP-style parameter sharding.

    mesh axes      ("data", "fsdp"), both AxisType.Auto (classic jit auto-sharding; jax.make_mesh
                   now defaults to Explicit, see ../shared/JAX-NOTES.md)
    batch          the batch axis is split over both axes together: every device holds
                   global_batch / n_devices examples
    params, moments each leaf is split over "fsdp" along its largest axis that the fsdp size
                   divides, else replicated; optimizer moments have their parameter's shape and
                   so get its sharding (the rule is a function of the shape alone)
    step, key, scalars (counts, injected hyperparameters): replicated

Everything that places arrays on devices lives here, so the loop, the replay engine and
`replay plan` lay out the state identically. A sharding never changes what is computed, only
where: `init_sharded_state(cfg, mesh)` has the bits of `step.init_state(cfg)` (tested).
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from replay.errors import InputError
from trainer import step
from trainer.config import Config, MeshConfig
from trainer.constants import BATCH_AXES

AXES = ("data", "fsdp")


class MeshError(ValueError, InputError):
    """The mesh does not fit the devices or the batch; the message is one line for users."""


# ---------------------------------------------------------------------------------- mesh

def mesh_shape(cfg: MeshConfig, n_devices: int) -> tuple[int, int]:
    """(data, fsdp) sizes for `n_devices`, with -1 resolved to all the devices the other
    axis leaves. Pure arithmetic: raises MeshError when the sizes cannot fit."""
    if n_devices < 1:
        raise MeshError(f"a mesh needs at least one device, got {n_devices}")
    data, fsdp = cfg.data, cfg.fsdp
    if data == -1 or fsdp == -1:
        fixed_name, fixed = ("mesh.fsdp", fsdp) if data == -1 else ("mesh.data", data)
        if n_devices % fixed:
            raise MeshError(f"{fixed_name}={fixed} does not divide the {n_devices} devices; "
                            f"set {fixed_name} to a divisor of {n_devices}")
        other = n_devices // fixed
        data, fsdp = (other, fsdp) if data == -1 else (data, other)
    if data * fsdp != n_devices:
        raise MeshError(f"mesh.data={data} x mesh.fsdp={fsdp} = {data * fsdp} does not match the "
                        f"{n_devices} devices; set sizes whose product is {n_devices}, or -1 for one of them")
    return data, fsdp


def make_mesh(cfg: MeshConfig, devices: Sequence[Any] | None = None) -> Mesh:
    """A ("data", "fsdp") mesh over `devices` (default: all devices of all processes)."""
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(cfg, len(devices))
    return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=devices)


def describe(mesh: Mesh) -> dict[str, Any]:
    """The mesh as JSON-ready data, for the manifest."""
    return {"axes": {name: int(size) for name, size in mesh.shape.items()}, "devices": int(mesh.size)}


# ----------------------------------------------------------------------------- shardings

def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def fsdp_spec(shape: Sequence[int], fsdp_size: int) -> P:
    """Split the largest axis that `fsdp_size` divides over "fsdp" (the first such axis on a
    tie); replicate when none does, or when fsdp_size is 1."""
    if fsdp_size <= 1:
        return P()
    best = None
    for axis, dim in enumerate(shape):
        if dim >= fsdp_size and dim % fsdp_size == 0 and (best is None or dim > shape[best]):
            best = axis
    if best is None:
        return P()
    return P(*([None] * best + ["fsdp"]))


def _fsdp_sharding(mesh: Mesh, leaf: Any) -> NamedSharding:
    return NamedSharding(mesh, fsdp_spec(leaf.shape, int(mesh.shape["fsdp"])))


def state_shardings(mesh: Mesh, abstract_state: step.TrainState) -> step.TrainState:
    """A TrainState-shaped tree of NamedSharding for `abstract_state` (arrays or
    ShapeDtypeStructs): params and optimizer leaves FSDP-style, step and key replicated."""
    rep = replicated(mesh)
    leaf = functools.partial(_fsdp_sharding, mesh)
    return step.TrainState(
        step=rep,
        params=jax.tree.map(leaf, abstract_state.params),
        opt_state=jax.tree.map(leaf, abstract_state.opt_state),  # scalars come out replicated
        key=rep,
    )


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batch axis (axis 0) over ("data", "fsdp"); works as a prefix for a dict of arrays."""
    return NamedSharding(mesh, P(BATCH_AXES))


def check_batch(global_batch: int, mesh: Mesh) -> None:
    """MeshError unless every device gets the same whole number of examples."""
    n = int(mesh.size)
    if global_batch % n:
        raise MeshError(f"data.global_batch_size={global_batch} is not divisible by the {n} devices "
                        f"(mesh data={mesh.shape['data']} x fsdp={mesh.shape['fsdp']}); "
                        f"use a multiple of {n} or fewer devices")


# ---------------------------------------------------------------------- abstract state

@functools.lru_cache(maxsize=16)
def abstract_state(cfg: Config) -> step.TrainState:
    """The state's shapes and dtypes (ShapeDtypeStructs), computed without allocating it.
    Built from the state constructor, so optax's NamedTuples keep their types (a target
    read from checkpoint metadata would lose them). Kept per config: a trace of the whole
    initializer each time, and the loop, checkpoints and replay each ask for it."""
    return jax.eval_shape(functools.partial(step.init_state, cfg))


def abstract_with_shardings(abstract: Any, shardings: Any) -> Any:
    """`abstract` with each leaf a ShapeDtypeStruct carrying its sharding from `shardings`
    (a tree of the same structure): the target for restore and for lowering."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


def sharded_abstract_state(cfg: Config, mesh: Mesh) -> step.TrainState:
    """abstract_state(cfg) laid out on `mesh` as state_shardings says."""
    abstract = abstract_state(cfg)
    return abstract_with_shardings(abstract, state_shardings(mesh, abstract))


def abstract_batch(cfg: Config, mesh: Mesh) -> dict[str, jax.ShapeDtypeStruct]:
    """The train step's batch as sharded ShapeDtypeStructs (int32[B, L] inputs and targets)."""
    shape = (cfg.data.global_batch_size, cfg.model.seq_len)
    s = batch_sharding(mesh)
    return {name: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=s) for name in ("inputs", "targets")}


def lower_step(cfg: Config, level: str, mesh: Mesh, program_cfg: Config | None = None) -> tuple[Any, Any, Any, Any]:
    """The train step at trace `level` lowered for `mesh`, as the trainer's loop lowers it:
    (lowered, state shardings, batch sharding, sharded abstract state). Tests that step the trainer
    by hand call it too, so they compile the very programs the loop's runs compile. `program_cfg`:
    another config's step (a fault's) on `cfg`'s arguments."""
    abstract = abstract_state(cfg)
    shardings = state_shardings(mesh, abstract)
    abstract_sharded = abstract_with_shardings(abstract, shardings)
    lowered = step.compile_step(program_cfg or cfg, level, shardings, batch_sharding(mesh)).lower(
        abstract_sharded, abstract_batch(cfg, mesh))
    return lowered, shardings, batch_sharding(mesh), abstract_sharded


def init_sharded_state(cfg: Config, mesh: Mesh) -> step.TrainState:
    """step.init_state(cfg) created directly in its sharded layout (no full copy on one device).
    Same bits as the unsharded state: threefry_partitionable random bits do not depend on the
    sharding (tested)."""
    if cfg.model.init_from:  # a checkpoint's weights, read now and placed: not baked into a cached program
        return jax.device_put(step.init_state(cfg), state_shardings(mesh, abstract_state(cfg)))
    return _compiled_init(cfg, mesh)()


@functools.lru_cache(maxsize=8)
def _compiled_init(cfg: Config, mesh: Mesh):
    """One jitted initializer per (config, mesh): a process that trains or replays several runs
    (bisect, tests) traces and compiles it once instead of once per run."""
    shardings = state_shardings(mesh, abstract_state(cfg))
    return jax.jit(functools.partial(step.init_state, cfg), out_shardings=shardings)


# ------------------------------------------------------------------------------ batches

def local_batch_range(global_batch: int, mesh: Mesh, sharding: NamedSharding | None = None) -> tuple[int, int]:
    """[start, stop) of the global batch's examples that this process's devices hold: the
    slice this host loads and passes to `global_batch`. (0, global_batch) on one process."""
    sharding = batch_sharding(mesh) if sharding is None else sharding
    check_batch(global_batch, mesh)
    rows = set()
    for idx in sharding.addressable_devices_indices_map((global_batch,)).values():
        sl = idx[0]
        rows.update(range(*sl.indices(global_batch)))
    start, stop = min(rows), max(rows) + 1
    if len(rows) != stop - start:  # make_mesh keeps each process's devices together
        raise MeshError(f"this process's devices hold a non-contiguous part of the batch "
                        f"({len(rows)} rows in {start}..{stop}); use a mesh built by trainer.mesh.make_mesh")
    return start, stop


def global_batch(local: Any, mesh: Mesh, sharding: NamedSharding | None = None) -> Any:
    """A global jax.Array (or a tree of them, e.g. {"inputs", "targets"}) from this process's
    slice of the batch (rows `local_batch_range(...)`, numpy or jax arrays). With one process
    the slice is the whole batch; with several, every process calls this with its own slice."""
    sharding = batch_sharding(mesh) if sharding is None else sharding
    procs = jax.process_count()

    def one(x: Any) -> jax.Array:
        x = np.asarray(x)
        global_shape = (x.shape[0] * procs,) + x.shape[1:]
        return jax.make_array_from_process_local_data(sharding, x, global_shape)

    return jax.tree.map(one, local)
