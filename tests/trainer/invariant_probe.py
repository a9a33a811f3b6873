"""Mesh-invariant gradients on several meshes of one process, as exact bits and compiled memory.

    python -m tests.trainer.invariant_probe [--runs scatter:1x1,scatter:2x1,gather:8x1,sequential:8x1]

Runs in a process with 8 virtual CPU devices and mesh-invariant settings (`probe_env()`): the
XLA:CPU pool is pinned to 8 threads, so a mesh over the first n devices computes what a process
of n devices does (trainer/invariant.py, c). For each run "REDUCTION:DATAxFSDP" it compiles
`invariant.value_and_grad` of `tiny` (8 microbatches, a fixed batch and key; trace level step:
no captured activations) and prints one JSON line: per run the sha256 of the loss, the
per-example losses and every gradient leaf (in tree order), the compiled program's
per-device memory (`memory_analysis()`) and the gradient state a device keeps across
microbatches, read from the traced program (trainer/gradient_memory.py). Reductions: scatter (the trainer's), gather (the
previous implementation, kept in trainer/invariant.py as the reference), sequential (an
injected difference: scatter with a left-to-right sum over each scan step's microbatches
instead of the tree; strided layouts only) and interleaved (scatter with the fixed-order softmax and
RMSNorm VJPs summing their last axis in another order, `interleaved_vjps`: as correct, other rounding;
its gradients are also compared with scatter's on the same layout within float tolerance,
"close_to_scatter").
Cost: one compile of the microbatched gradient per run (3-6 s each on 2 busy cores).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

DEVICES = 8
SETS = ["mesh.mesh_invariant=true", "mesh.n_microbatches=8", "model.n_layers=1"]  # one block: every kind of leaf
REDUCTIONS = ("scatter", "gather", "sequential", "interleaved")
DEFAULT_RUNS = ("scatter:1x1", "scatter:2x1", "scatter:4x1", "scatter:2x2", "scatter:8x1",
                "gather:2x1", "gather:8x1", "sequential:8x1", "interleaved:1x1")


def probe_env(base: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in (os.environ if base is None else base).items()
           if k not in ("XLA_FLAGS", "PJRT_NPROC", "NPROC")}
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES}"
    return env


def _digest(x) -> str:
    import numpy as np

    a = np.asarray(x)
    return hashlib.sha256(f"{a.dtype}{a.shape}".encode() + np.ascontiguousarray(a).tobytes()).hexdigest()[:32]


def _left_fold(shards_Nx):
    """block_sum with the tree replaced by a left-to-right sum: as correct, other rounding."""
    total = shards_Nx[0]
    for i in range(1, shards_Nx.shape[0]):
        total = total + shards_Nx[i]
    return total


def vjps(softmax_bwd, rms_bwd):
    """Stand-ins for model._softmax_fixed and model._rms_norm_fixed: the same forward and
    residuals, the given backward functions."""
    import jax

    from trainer import model

    softmax = jax.custom_vjp(model._softmax)
    softmax.defvjp(model._softmax_fixed_fwd, softmax_bwd)
    rms = jax.custom_vjp(lambda x, s, eps: model._rms_norm(x, s, eps)[0], nondiff_argnums=(2,))
    rms.defvjp(model._rms_norm_fixed_fwd, rms_bwd)
    return softmax, rms


def interleaved_vjps():
    """The fixed-order VJPs with each sum over the last axis taken over its even elements, then its
    odd ones: tree_sum's halving adds then pair neighbours first, not elements half a row apart, so
    the rounding differs. (Reversing or rolling the row would not do: tree_sum then adds the same
    pairs, b + a for a + b, and with mesh-invariant settings gives the same bits: measured.)"""
    import jax.numpy as jnp

    from trainer import model

    def interleaved_sum(x):
        return model.tree_sum(jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1))

    def softmax_bwd(p, g):
        return ((g - interleaved_sum(g * p)) * p,)

    def rms_bwd(eps, res, g):
        x32, scale32, rms = res
        gs = g * scale32
        dx = gs * rms - x32 * (rms * rms * rms) * (interleaved_sum(gs * x32) / x32.shape[-1])
        return dx, interleaved_sum((g * x32 * rms).reshape(-1, x32.shape[-1]).T)[:, 0]

    return vjps(softmax_bwd, rms_bwd)


def scattered_vs_gathered(n_devices: int) -> dict:
    """scattered_sum (the reduce-scatter for device counts that are not powers of two) and
    gathered_sum on the same random partial sums, 3 per device, of a leaf it shards and of one it
    cannot: the same bits? And, to show the comparison can fail, does a left-to-right sum of the
    gathered partials differ from gathered_sum?"""
    import jax
    import numpy as np
    from jax import lax
    from jax.sharding import Mesh, PartitionSpec as P

    from trainer import invariant

    mesh = Mesh(np.asarray(jax.devices()[:n_devices]).reshape(n_devices, 1), invariant.BATCH_AXES)
    rng = np.random.default_rng(n_devices)
    leaves = [(rng.standard_normal((3 * n_devices, 6 * n_devices, 5)) * 1e3).astype(np.float32),
              (rng.standard_normal((3 * n_devices, 5, 7)) * 1e3).astype(np.float32)]
    m_total = 3 * n_devices

    def run(reduce):
        fn = jax.shard_map(lambda xs: [reduce(x) for x in xs], mesh=mesh, in_specs=(P(invariant.BATCH_AXES),),
                           out_specs=P(), check_vma=False)
        return [np.asarray(x) for x in jax.jit(fn)(leaves)]

    def scattered(x):  # the reduce-scatter leaves this device's shard: gather it to compare whole leaves
        shard, axis = invariant.scattered_sum(x, n_devices, m_total), invariant.split_axis(x.shape[1:], n_devices)
        return shard if axis is None else lax.all_gather(shard, invariant.BATCH_AXES, axis=axis, tiled=True)

    a = run(scattered)
    b = run(lambda x: invariant.gathered_sum(x, m_total))
    c = run(lambda x: _left_fold(lax.all_gather(x, invariant.BATCH_AXES, axis=0, tiled=True)) / m_total)
    return {"equal": all(x.tobytes() == y.tobytes() for x, y in zip(a, b)),
            "left_fold_differs": all(x.tobytes() != y.tobytes() for x, y in zip(c, b))}


def probe(runs: list[tuple[str, int, int]]) -> dict:
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from trainer import gradient_memory, invariant, model, step
    from trainer.config import apply_overrides
    from trainer.presets import get_preset

    invariant.prepare_process()
    cfg = apply_overrides(get_preset("tiny"), SETS)
    params = step.init_state(cfg).params
    tokens = np.random.default_rng(5).integers(0, cfg.model.vocab_size,
                                               (cfg.data.global_batch_size, cfg.model.seq_len + 1))
    batch = {"inputs": tokens[:, :-1].astype(np.int32), "targets": tokens[:, 1:].astype(np.int32)}
    key = jax.random.key(3, impl="threefry2x32")
    grad_bytes = int(sum(np.asarray(g).nbytes for g in jax.tree.leaves(params)))
    out, arrays, close = {}, {}, {}
    for reduction, data, fsdp in runs:
        devices = np.asarray(jax.devices()[:data * fsdp]).reshape(data, fsdp)
        mesh = Mesh(devices, invariant.BATCH_AXES)
        b = jax.device_put(batch, NamedSharding(mesh, P(invariant.BATCH_AXES)))
        p = jax.device_put(params, NamedSharding(mesh, P()))
        kwargs = {"reduction": "gather"} if reduction == "gather" else {}
        fn = jax.jit(lambda p, b: invariant.value_and_grad(p, cfg, b, key, False, mesh, **kwargs))
        block_sum, fixed = invariant.block_sum, (model._softmax_fixed, model._rms_norm_fixed)
        if reduction == "sequential":
            invariant.block_sum = _left_fold
        if reduction == "interleaved":
            model._softmax_fixed, model._rms_norm_fixed = interleaved_vjps()
        try:
            traced = fn.trace(p, b)
            compiled = traced.lower().compile()
        finally:
            invariant.block_sum = block_sum
            model._softmax_fixed, model._rms_norm_fixed = fixed
        (_, aux), grads = compiled(p, b)
        flat = jax.tree_util.tree_flatten_with_path(grads)[0]
        mem = compiled.memory_analysis()
        name = f"{reduction}:{data}x{fsdp}"
        arrays[name] = [np.asarray(g) for g in jax.tree.leaves(grads)]
        if reduction == "interleaved" and f"scatter:{data}x{fsdp}" in arrays:
            close[name] = all(
                np.allclose(r, s, rtol=1e-4, atol=1e-7) for r, s in zip(arrays[name], arrays[f"scatter:{data}x{fsdp}"]))
        out[name] = {
            "loss": _digest(aux["loss"]), "example_loss": _digest(aux["example_loss"]),
            "grads": {jax.tree_util.keystr(path): _digest(g) for path, g in flat},
            "memory": {"argument": int(mem.argument_size_in_bytes), "output": int(mem.output_size_in_bytes),
                       "temp": int(mem.temp_size_in_bytes), "alias": int(mem.alias_size_in_bytes)},
            "gradient_state": gradient_memory.gradient_state(traced.jaxpr, len(jax.tree.leaves(params)), grad_bytes),
        }
    units = {f"scattered_vs_gathered:{n}": scattered_vs_gathered(n) for n in (3,)}
    return {"jax": jax.__version__, "pool": invariant.pool_threads(), "units": units,
            "grad_bytes": grad_bytes, "close_to_scatter": close,
            "largest_leaf_bytes": int(max(np.asarray(g).nbytes for g in jax.tree.leaves(params))), "runs": out}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.trainer.invariant_probe")
    parser.add_argument("--runs", default=",".join(DEFAULT_RUNS))
    args = parser.parse_args(argv)
    runs = []
    for item in args.runs.split(","):
        reduction, layout = item.split(":")
        if reduction not in REDUCTIONS:
            parser.error(f"reduction {reduction!r} is not one of {REDUCTIONS}")
        data, fsdp = (int(v) for v in layout.split("x"))
        runs.append((reduction, data, fsdp))
    print(json.dumps(probe(runs)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
