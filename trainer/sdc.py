"""Silent data corruption in mesh-invariant mode: simulated faults, per-replica fingerprints, checks.

In mesh-invariant mode (trainer/invariant.py) every microbatch gradient is computed by one
device with the same program whatever the layout, so its bits do not depend on which device
computed it. That makes each device's share of the step comparable bit for bit with the same
work done by another device: a disagreement is a device computing wrongly.

    faults      `sdc` / `sdc-chip` (trainer/faults.py) flip one bit of a microbatch gradient on
                one device (`corrupt`, inside the shard_map, before any reduction). In the step
                program the fault knows its step by the step's RNG key (a pure function of the
                root seed and the step), so one compiled program serves every step
    replicas    `microbatch_summaries`: one 64-bit fingerprint per layer (the parameter leaves under
                one top-level module, e.g. block_01) of one microbatch's gradient. Recorded as
                trace tensors "replica/mbNN/LAYER" (check.replicas=true, level layer)
    check       check.rerun_every=N: on steps k with k % N == 0 each device also computes the
                microbatches of device d + rotate, and each microbatch's fingerprints are compared
                inside the step with the step's own (check.replicas) or, to keep other steps free
                of fingerprints, with a re-computation on the step's own devices; the result is the
                trace tensor "check/rerun" (traces/FORMAT.md "SDC checks"). Without check.replicas
                a transient in the step's own computation is not seen by the check (`replay verify`
                with per-replica fingerprints finds those); a bad chip is, within N steps
    rotation    device d computes the work device (d + rotate) % n computes unrotated
                (`owner`, `executor`): how `replay verify` re-runs a step on other chips

Cost: per-replica fingerprints read every microbatch gradient once (M fingerprints of the gradient
a step); a checked step computes its forward and backward once more with check.replicas, twice
more without; other steps pay one untaken branch (its operands are the incoming parameters, which
trainer/step.py orders the donated update after, so nothing is copied for it: tested). Measured by
bench/sdc_overhead.py. Nothing grows with the run's length.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax.sharding import Mesh, PartitionSpec as P

from replay.verify.names import mask_microbatches, replica_name  # noqa: F401  (the recorded names; read from here too)
from traces.schema import CHECK_TENSOR
from trainer.config import Config
from trainer.microbatches import BATCH_AXES, Layout, microbatch
from replay.record.fingerprint import fingerprint_lanes, fingerprints_and_sums_of_squares
from trainer import rng
from trainer.invariant import strided as _strided

MAX_GAP = 4096  # sdc-chip: steps between the first SDC fault and a chip's start the program can tell apart


# ------------------------------------------------------------------------------ the layout

def strided(n_devices: int) -> bool:
    return _strided(n_devices)


def owner(mb: int, n_devices: int, n_microbatches: int) -> int:
    """The device that computes microbatch `mb` unrotated (trainer/invariant.py's assignment)."""
    return mb % n_devices if strided(n_devices) else mb // (n_microbatches // n_devices)


def executor(mb: int, n_devices: int, n_microbatches: int, rotate: int) -> int:
    """The device that computes microbatch `mb` with the work rotated by `rotate`."""
    return (owner(mb, n_devices, n_microbatches) - rotate) % n_devices


# ------------------------------------------------------------------------ layers and names

def layer_groups(cfg: Config) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """(layer, its parameter leaves) in execution order: the unit a replica fingerprint covers."""
    from trainer import model

    groups: dict[str, list[str]] = {}
    for name in model.param_names(cfg.model):
        groups.setdefault(name.split(".")[0], []).append(name)
    return tuple((g, tuple(names)) for g, names in groups.items())


def check_words(n_microbatches: int) -> int:
    return -(-n_microbatches // 64)


def extra_tensors(cfg: Config, level: str) -> tuple[tuple[str, str], ...]:
    """The trace tensors this module adds after the step's own (kind "backward"): per-replica
    fingerprints with check.replicas, the re-run check's words with check.rerun_every."""
    if not cfg.mesh.mesh_invariant or level != "layer":
        return ()
    m = cfg.mesh.n_microbatches
    out: list[tuple[str, str]] = []
    if cfg.check.replicas:
        out += [(replica_name(i, g, m), "backward") for i in range(m) for g, _ in layer_groups(cfg)]
    if cfg.check.rerun_every:
        out += [(CHECK_TENSOR + (f"_{w}" if w else ""), "backward") for w in range(check_words(m))]
    return tuple(out)


# ------------------------------------------------------------------------- the faults

@dataclass(frozen=True)
class _Compiled:
    """What the device code needs of one SdcFault (hashable, so it can sit in a config)."""

    persistent: bool
    device: int
    tensor: str
    elem: int
    mask: int
    p: float
    step: int
    key: tuple[int, int]  # transient: the step key's words at `step`
    chip_key: tuple[int, int]  # persistent: the key data of the stream "sdc-chip/D"
    inactive: tuple[tuple[int, int], ...]  # persistent: step keys of steps the program runs before `step`


@dataclass(frozen=True, kw_only=True)
class FaultyConfig(Config):
    """The run's config plus the SDC faults its faulty program simulates (never in a manifest)."""

    sdc: tuple[_Compiled, ...] = ()


def _step_words(seed: int, step: int) -> tuple[int, int]:
    words = np.asarray(jax.random.key_data(rng.step_key(rng.dropout_key(seed), step)), np.uint32)
    return int(words[0]), int(words[1])


def _tensor(cfg: Config, f) -> str:
    from trainer.faults import bitflip_param

    return f.tensor or bitflip_param(cfg)


def check_faults(faults, cfg: Config, has_bf16: bool) -> None:
    """One-line FaultError unless every SDC fault fits this config."""
    from trainer import model
    from trainer.faults import FaultError

    if not cfg.mesh.mesh_invariant:
        raise FaultError(f"--inject {faults[0]}: SDC faults hit one device's microbatch gradient, which only "
                         "mesh-invariant mode computes apart; add --set mesh.mesh_invariant=true mesh.n_microbatches=M")
    if has_bf16:
        raise FaultError(f"--inject {faults[0]}: SDC faults cannot be combined with layer-bf16 in one run")
    from trainer.invariant import prepare_process

    prepare_process()  # the shapes below start JAX: mesh-invariant mode's settings go in first
    shapes = {name: leaf.shape for name, leaf in zip(model.param_names(cfg.model), _leaves(cfg))}
    start = min(f.step for f in faults)
    for f in faults:
        name = _tensor(cfg, f)
        if name not in shapes:
            raise FaultError(f"--inject {f}: no parameter {name!r}; parameters are {', '.join(shapes)}")
        if f.elem >= int(np.prod(shapes[name])):
            raise FaultError(f"--inject {f}: {name} has {int(np.prod(shapes[name]))} elements, elem={f.elem} is past them")
        if f.persistent and f.step - start > MAX_GAP:
            raise FaultError(f"--inject {f}: starts {f.step - start} steps after the run's first SDC fault; "
                             f"at most {MAX_GAP} apart")


def _leaves(cfg: Config) -> list:
    from trainer import model
    from trainer.mesh import abstract_state

    params = abstract_state(cfg).params
    leaves = []
    for name in model.param_names(cfg.model):
        node = params
        for part in name.split("."):
            node = node[part]
        leaves.append(node)
    return leaves


def faulty_config(cfg: Config, faults) -> FaultyConfig:
    """`cfg` carrying `faults` compiled for the device code; the program runs from the first fault's step."""
    start = min(f.step for f in faults)
    compiled = []
    for f in faults:
        chip = tuple(int(w) for w in np.asarray(jax.random.key_data(rng.stream_key(cfg.seed, f"sdc-chip/{f.device}"))))
        compiled.append(_Compiled(
            f.persistent, f.device, _tensor(cfg, f), f.elem, 1 << f.bit, f.p, f.step, _step_words(cfg.seed, f.step),
            chip, tuple(_step_words(cfg.seed, s) for s in range(start, f.step)) if f.persistent else ()))
    fields = {fl.name: getattr(cfg, fl.name) for fl in dataclasses.fields(Config)}
    return FaultyConfig(**fields, sdc=tuple(compiled))


def chips_only(cfg: Config) -> tuple[_Compiled, ...]:
    """The persistent faults of a faulty config: what a re-execution meets again (a transient does not)."""
    return tuple(f for f in getattr(cfg, "sdc", ()) if f.persistent)


def _fires(f: _Compiled, me: jax.Array, slot: jax.Array, key_words: jax.Array, step: jax.Array | None) -> jax.Array:
    def is_key(words: tuple[int, int]) -> jax.Array:
        return (key_words[0] == jnp.uint32(words[0])) & (key_words[1] == jnp.uint32(words[1]))

    here = me == f.device
    if not f.persistent:
        return here & (slot == 0) & (is_key(f.key) if step is None else step == f.step)
    if step is not None:
        active = step >= f.step
    else:
        active = jnp.logical_not(functools.reduce(jnp.logical_or, [is_key(w) for w in f.inactive], jnp.bool_(False)))
    draw = jax.random.fold_in(jax.random.fold_in(jax.random.wrap_key_data(jnp.asarray(f.chip_key, jnp.uint32),
                                                                         impl="threefry2x32"), key_words[0]), key_words[1])
    return here & active & (jax.random.uniform(draw) < f.p)


def corrupt(grads: Any, faults: tuple[_Compiled, ...], me: jax.Array, slot: jax.Array, key_words: jax.Array,
            step: jax.Array | None = None) -> Any:
    """`grads` (one microbatch's, on device `me`, local slot `slot`) with the bits of every fault that
    fires here flipped. XOR by a select on one element: the other elements' bits are untouched."""
    for f in faults:
        fire = _fires(f, me, slot, key_words, step)
        path = f.tensor.split(".")
        grads = dict(grads)
        node = grads
        for part in path[:-1]:
            node[part] = dict(node[part])
            node = node[part]
        leaf = node[path[-1]]
        flat = leaf.reshape(-1)
        bits = lax.bitcast_convert_type(flat[f.elem], jnp.uint32)
        flipped = jnp.where(fire, bits ^ jnp.uint32(f.mask), bits)
        node[path[-1]] = flat.at[f.elem].set(lax.bitcast_convert_type(flipped, leaf.dtype)).reshape(leaf.shape)
    return grads


# --------------------------------------------------------------------------- fingerprints

def microbatch_summaries(grads: Any, cfg: Config) -> tuple[jax.Array, jax.Array]:
    """uint32[G, 2] fingerprint lanes and float32[G] RMS of one microbatch's gradient, per layer
    (layer_groups): a layer's fingerprint is the fingerprint of its leaves' lanes stacked in order."""
    lanes, rms = [], []
    for _, names in layer_groups(cfg):
        leaves = [_get(grads, n) for n in names]
        leaf_lanes, sum_sq = fingerprints_and_sums_of_squares(leaves)
        lanes.append(fingerprint_lanes(leaf_lanes))
        rms.append(jnp.sqrt(jnp.sum(sum_sq) / float(sum(x.size for x in leaves))))
    return jnp.stack(lanes), jnp.stack(rms)


def _get(tree: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        tree = tree[part]
    return tree


def check_summaries(main_MxGx2: jax.Array, rerun_MxGx2: jax.Array, checked: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The "check/rerun" tensors: lanes whose 64-bit value (lane 0 high, lane 1 low) has bit i set
    when microbatch i's fingerprints differ between the step and its re-run; RMS 1.0 on a checked
    step, 0.0 on others (then the mask is 0)."""
    m = main_MxGx2.shape[0]
    differs = jnp.any(main_MxGx2 != rerun_MxGx2, axis=(1, 2)) & checked
    words = []
    for w in range(check_words(m)):
        half = [jnp.uint32(0), jnp.uint32(0)]  # [high, low]
        for i in range(64 * w, min(m, 64 * w + 64)):
            b = i - 64 * w
            half[b < 32] = half[b < 32] | jnp.where(differs[i], jnp.uint32(1 << (b % 32)), jnp.uint32(0))
        words.append(jnp.stack(half))
    return jnp.stack(words), jnp.full((len(words),), jnp.where(checked, 1.0, 0.0), jnp.float32)


def rerun_check(params, cfg: Config, base, tokens, layout: Layout, me, key_data, step, main_MxGx2=None,
                fixed_backward: bool = True):
    """The "check/rerun" summaries of a re-run step (inside the step's shard_map, under its cond):
    every microbatch re-computed with the work rotated by check.rotate and compared with the
    step's own replica fingerprints (`main_MxGx2`, with check.replicas) or, without them, with a
    re-computation on the step's own devices. Only bad chips act in re-computations."""
    rotate = cfg.check.rotate % layout.n
    chips = chips_only(cfg)
    summary = None
    if main_MxGx2 is None:  # two re-computations: compare them by cheap checksums
        summary = checksums
        main_MxGx2 = layout.in_order(
            rotated_lanes(params, cfg, base, tokens, layout, me, 0, chips, key_data, step, summary, fixed_backward))
    rerun = layout.owner_order(
        rotated_lanes(params, cfg, base, tokens, layout, me, rotate, chips, key_data, step, summary, fixed_backward),
        rotate)
    return check_summaries(main_MxGx2, rerun, jnp.bool_(True))


def no_check(n_microbatches: int) -> tuple[jax.Array, jax.Array]:
    """The "check/rerun" summaries of a step that is not re-run: an empty mask, RMS 0."""
    words = check_words(n_microbatches)
    return jnp.zeros((words, 2), jnp.uint32), jnp.zeros((words,), jnp.float32)


# ------------------------------------------------------------------------ re-executions

def checksums(grads: Any, cfg: Config) -> jax.Array:
    """uint32[G, 2] per layer: wrapping sums of the gradient's 32-bit words (any one flipped bit
    changes the first) and of each word folded with its upper half. A cheap comparison between two
    computations of the same microbatch, not a recorded fingerprint (those are murmur-mixed)."""
    out = []
    for _, names in layer_groups(cfg):
        words = [lax.bitcast_convert_type(_get(grads, n), jnp.uint32).reshape(-1) for n in names]
        out.append(jnp.stack([functools.reduce(jnp.add, [jnp.sum(w, dtype=jnp.uint32) for w in words]),
                              functools.reduce(jnp.add, [jnp.sum(w ^ (w >> 16), dtype=jnp.uint32) for w in words])]))
    return jnp.stack(out)


def rotated_lanes(params, cfg, base, tokens, layout, me, rotate, faults, key_data, step, summary=None,
                  fixed_backward: bool = True) -> jax.Array:
    """[local, G, 2] lanes of the microbatches of device (me + rotate) % n, computed here (device me);
    `summary` (default: the replica fingerprints' lanes) of each microbatch's gradient."""
    def body(carry, x):
        grads, _ = microbatch(params, cfg, base, False, x[:3], fixed_backward)
        if faults:
            grads = corrupt(grads, faults, me, x[3], key_data, step)
        return carry, (summary or (lambda g, c: microbatch_summaries(g, c)[0]))(grads, cfg)

    return lax.scan(body, None, layout.work(tokens, (me + rotate) % layout.n))[1]


def replica_lanes(params: Any, cfg: Config, batch: dict, step_key: jax.Array, step: jax.Array, rotate: jax.Array,
                  mesh: Mesh | None) -> jax.Array:
    """uint32[M, G, 2]: every microbatch's per-layer gradient fingerprint lanes (trainer/sdc.py), in
    global microbatch order, with device d computing the microbatches device (d + rotate) % n computes
    in the step; only the persistent SDC faults of a faulty config act (a transient happened once).
    No reduction, no update: what `replay verify` compares across devices. jit it (rotate traced)."""
    from trainer.invariant import mesh_or_one_device, check, strided as _strided

    mesh = mesh_or_one_device(mesh)
    n = int(mesh.devices.size)
    check(cfg, n)
    layout = Layout(n, cfg.mesh.n_microbatches // n, cfg.mesh.n_microbatches, _strided(n))
    chips = chips_only(cfg)

    def per_device(params, key_data, step, rotate, inputs_bxL, targets_bxL):
        me = lax.axis_index(BATCH_AXES)
        base = jax.random.wrap_key_data(key_data, impl="threefry2x32")
        tokens = layout.tokens(inputs_bxL, targets_bxL, gathered=True)
        lanes = rotated_lanes(params, cfg, base, tokens, layout, me, rotate, chips, key_data, step)
        return layout.owner_order(lanes, rotate)

    fn = jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P(), P(), P(), P(BATCH_AXES), P(BATCH_AXES)),
                       out_specs=P(), check_vma=False)
    return fn(params, jax.random.key_data(step_key), jnp.asarray(step, jnp.int32), jnp.asarray(rotate, jnp.int32),
              batch["inputs"], batch["targets"])
