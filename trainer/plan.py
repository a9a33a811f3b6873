"""Plan a run without running it: compile the train step for N devices from abstract shapes.

    python -m trainer.plan --preset olmo3-7b --devices 256 [--level step] [--device-kind tpu-v5p]
                           [--json] [--set key=value ...]

lowers and compiles the jitted train step (trace level "step" by default, what a production
run records every step) for a mesh of N devices, with the state and batch given as
ShapeDtypeStructs carrying their shardings, so no parameter, optimizer or batch array is ever
allocated. It reports what the compiled per-device program needs (XLA's memory analysis:
arguments, outputs, temporaries, bytes aliased to the donated state, generated code), whether
the donated state is written in place (trainer/donation.py: input_output_alias and copies in
the compiled HLO), in mesh-invariant mode the gradient state a device keeps across microbatches
(trainer/gradient_memory.py, from the traced program), the parameter count, parameter and optimizer bytes per device, FLOPs per
step (the model's 6N + attention, trainer/model.py, and XLA's cost analysis of the program),
whether it fits a named device's HBM (DEVICE_HBM) and the time it took to trace, lower and
compile. Model options: `--remat none|full|dots` (model.remat), `--scan` (model.scan_layers),
`--precision fp32|bf16` (bf16: bfloat16 compute with float32 master weights and optimizer
state; model.dtype / model.param_dtype), or any `--set model.FIELD=VALUE`; the report carries
the whole model section and the precision policy.

The device count of a JAX process is fixed when JAX initialises, so this module runs in its
own process with N virtual CPU devices (`plan_env(N)`: XLA_FLAGS
--xla_force_host_platform_device_count=N, JAX_PLATFORMS=cpu); `replay plan` starts it so.
The numbers are those of XLA:CPU's SPMD partitioning and buffer assignment: the sharding,
and so the argument and output bytes, are what an accelerator gets; temporaries depend on
the backend's fusion and scheduling, so treat them as an estimate.

Output: one JSON object on stdout with --json; errors are one line `error: ...` on stderr
with exit code 2. This module imports no jax at module level (plan_env is used by the CLI).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
import time
from typing import Any

from trainer.constants import TRACE_LEVELS
from trainer.config import ConfigError, apply_overrides
from trainer.presets import get_preset

LEVEL = "step"  # trace level planned by default: loss, grad norm, lr, param norm, per-example loss, RNG
EXIT_BAD_INPUT = 2
_COUNT_FLAG = "--xla_force_host_platform_device_count"
# HBM per chip as the vendors state it, in GB (10^9 bytes): Cloud TPU docs (v5p 95 GB, v6e 32 GB),
# NVIDIA (H100 SXM 80 GB, H200 141 GB). Runtimes keep part of it (JAX on GPU preallocates 75% by
# default, XLA_PYTHON_CLIENT_MEM_FRACTION), so "fits" is a necessary condition, not a promise.
DEVICE_HBM: dict[str, int] = {"tpu-v5p": 95 * 10**9, "tpu-v6e": 32 * 10**9, "h100": 80 * 10**9,
                              "h200": 141 * 10**9}
REMAT = ("none", "full", "dots")  # as trainer.config.ModelConfig.remat
# --precision: (model.dtype, model.param_dtype). The optimizer state takes the parameters' dtype.
PRECISION: dict[str, tuple[str, str]] = {"fp32": ("float32", "float32"), "bf16": ("bfloat16", "float32")}


def option_overrides(remat: str | None = None, scan: bool = False, precision: str | None = None) -> list[str]:
    """The config overrides the --remat, --scan and --precision options stand for."""
    out = [] if remat is None else [f"model.remat={remat}"]
    out += ["model.scan_layers=true"] if scan else []
    if precision is not None:
        compute, params = PRECISION[precision]
        out += [f"model.dtype={compute}", f"model.param_dtype={params}"]
    return out


def plan_env(n_devices: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a process with `n_devices` virtual CPU devices: the device-count
    flag appended to (or replacing one in) the existing XLA_FLAGS, and JAX_PLATFORMS=cpu."""
    env = dict(os.environ if base is None else base)
    flags = re.sub(_COUNT_FLAG + r"=\S*", "", env.get("XLA_FLAGS", "")).split()
    env["XLA_FLAGS"] = " ".join(flags + [f"{_COUNT_FLAG}={n_devices}"])
    env["JAX_PLATFORMS"] = "cpu"
    return env


def fit(total_bytes: int | None, device_kind: str) -> dict[str, Any]:
    """Whether `total_bytes` per device fit `device_kind`'s HBM (DEVICE_HBM)."""
    hbm = DEVICE_HBM[device_kind]
    return {"device_kind": device_kind, "hbm_bytes": hbm, "total_per_device": total_bytes,
            "fits": None if total_bytes is None else total_bytes <= hbm,
            "share": None if total_bytes is None else round(total_bytes / hbm, 4)}


def plan(cfg: Any, n_devices: int | None = None, preset: str | None = None,
         log=lambda msg: None, level: str = LEVEL, device_kind: str | None = None) -> dict[str, Any]:
    """Compile the train step of `cfg` at trace `level` for the devices of this process (which
    must number `n_devices` when given) from abstract state and batch; return the report as
    plain data (with `device_kind`, whether it fits that device). Raises trainer.mesh.MeshError
    when the mesh or the batch does not fit the devices."""
    import jax
    import numpy as np

    from trainer import donation, gradient_memory, invariant, model, step
    from trainer import mesh as mesh_lib

    devices = jax.devices()
    if n_devices is not None and len(devices) != n_devices:
        raise mesh_lib.MeshError(
            f"this process has {len(devices)} devices, not {n_devices}; run it with "
            f"XLA_FLAGS={_COUNT_FLAG}={n_devices} JAX_PLATFORMS=cpu (as `replay plan` does)")
    mesh = mesh_lib.make_mesh(cfg.mesh, devices)
    mesh_lib.check_batch(cfg.data.global_batch_size, mesh)
    if cfg.mesh.mesh_invariant:
        invariant.check(cfg, int(mesh.size))

    abstract = mesh_lib.abstract_state(cfg)
    shardings = mesh_lib.state_shardings(mesh, abstract)
    state_in = mesh_lib.abstract_with_shardings(abstract, shardings)
    batch_in = mesh_lib.abstract_batch(cfg, mesh)
    fn = step.compile_step(cfg, level, shardings, mesh_lib.batch_sharding(mesh))

    log(f"tracing the train step (trace level {level!r}) for {len(devices)} devices, "
        f"mesh data={mesh.shape['data']} x fsdp={mesh.shape['fsdp']}")
    t0 = time.perf_counter()
    traced = fn.trace(state_in, batch_in)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    log(f"traced in {t1 - t0:.1f} s, lowered in {t2 - t1:.1f} s; compiling (XLA:CPU, "
        f"{len(devices)} virtual devices)")
    compiled = lowered.compile()
    t3 = time.perf_counter()
    log(f"compiled in {t3 - t2:.1f} s")

    def shard_bytes(tree: Any, shard_tree: Any) -> int:
        total = 0
        for a, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shard_tree)):
            total += math.prod(s.shard_shape(a.shape)) * np.dtype(a.dtype).itemsize
        return total

    def full_bytes(tree: Any) -> int:
        return sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))

    n_params = sum(math.prod(a.shape) for a in jax.tree.leaves(abstract.params))
    assert n_params == model.param_count(cfg), (n_params, model.param_count(cfg))
    tokens = cfg.data.global_batch_size * cfg.model.seq_len
    fpt = model.flops_per_token(cfg)

    mem = compiled.memory_analysis()
    memory = None
    if mem is not None:
        memory = {
            "argument": int(mem.argument_size_in_bytes),
            "output": int(mem.output_size_in_bytes),
            "alias": int(mem.alias_size_in_bytes),  # outputs written in place of donated inputs
            "temp": int(mem.temp_size_in_bytes),
            "generated_code": int(mem.generated_code_size_in_bytes),
            # what the program needs live at once: arguments + outputs not aliased + temporaries
            "total": int(mem.argument_size_in_bytes + mem.output_size_in_bytes
                         - mem.alias_size_in_bytes + mem.temp_size_in_bytes),
        }
    xla_flops = None
    try:
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        if cost and "flops" in cost:
            xla_flops = float(cost["flops"])
    except Exception:  # cost analysis is best effort and backend dependent
        pass

    report = {
        "preset": preset,
        "devices": len(devices),
        "backend": jax.default_backend(),
        "mesh": {"data": int(mesh.shape["data"]), "fsdp": int(mesh.shape["fsdp"])},
        "mesh_invariant": ({"n_microbatches": cfg.mesh.n_microbatches} if cfg.mesh.mesh_invariant else None),
        "model": dataclasses.asdict(cfg.model),
        "precision": {"compute": cfg.model.dtype, "params": cfg.model.param_dtype,
                      "optimizer": sorted({str(a.dtype) for a in jax.tree.leaves(abstract.opt_state)
                                           if np.issubdtype(a.dtype, np.floating)})},
        "trace_level": level,
        "params": int(n_params),
        "global_batch_size": cfg.data.global_batch_size,
        "seq_len": cfg.model.seq_len,
        "tokens_per_step": tokens,
        "flops_per_token": fpt,
        "flops_per_step": fpt * tokens,
        # XLA's cost analysis of one device's program (every device runs it: SPMD); it counts a
        # loop's body once (mesh-invariant mode's scan over microbatches), so it undercounts there
        "xla_flops_per_device": xla_flops,
        "xla_flops_per_step": None if xla_flops is None else xla_flops * len(devices),
        "bytes": {
            "params_total": full_bytes(abstract.params),
            "optimizer_total": full_bytes(abstract.opt_state),
            "params_per_device": shard_bytes(abstract.params, shardings.params),
            "optimizer_per_device": shard_bytes(abstract.opt_state, shardings.opt_state),
            "batch_per_device": shard_bytes(batch_in, {k: v.sharding for k, v in batch_in.items()}),
        },
        "memory_per_device": memory,
        # mesh-invariant mode: what a device keeps of the gradient across microbatches (the scan's
        # carry) and the reduced gradient's shard, from the traced program (trainer/gradient_memory.py)
        "gradient_state_per_device": (gradient_memory.gradient_state(
            traced.jaxpr, len(jax.tree.leaves(abstract.params)), full_bytes(abstract.params))
            if cfg.mesh.mesh_invariant else None),
        "donation": donation.check(compiled),  # the donated state written in place, read from the HLO
        "seconds": {"trace": round(t1 - t0, 3), "lower": round(t2 - t1, 3), "compile": round(t3 - t2, 3)},
        "versions": {"jax": jax.__version__},
    }
    if device_kind is not None:
        report["fit"] = fit(memory["total"] if memory else None, device_kind)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.plan", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", required=True, help="config preset (trainer/presets.py PRESETS)")
    parser.add_argument("--devices", type=int, required=True, help="devices of the mesh (virtual CPU devices)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="config override, e.g. mesh.fsdp=8 (repeatable)")
    parser.add_argument("--level", choices=TRACE_LEVELS, default=LEVEL, help="trace level of the compiled step")
    parser.add_argument("--device-kind", choices=sorted(DEVICE_HBM), help="say whether it fits this device's HBM")
    parser.add_argument("--remat", choices=REMAT, help="recompute each block in the backward (model.remat)")
    parser.add_argument("--scan", action="store_true", help="scan over stacked layers (model.scan_layers)")
    parser.add_argument("--precision", choices=sorted(PRECISION), help="fp32, or bf16 compute with fp32 master weights")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args(argv)


    def log(msg: str) -> None:
        print(f"plan: {msg}", file=sys.stderr, flush=True)

    try:
        options = option_overrides(args.remat, args.scan, args.precision)
        cfg = apply_overrides(get_preset(args.preset), options + args.overrides)
        from trainer.mesh import MeshError

        try:
            report = plan(cfg, args.devices, preset=args.preset, log=log, level=args.level,
                          device_kind=args.device_kind)
        except MeshError as e:
            raise ConfigError(str(e)) from None
    except ConfigError as e:
        print(f"error: {' '.join(str(e).splitlines())}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    if args.json:
        print(json.dumps(report), flush=True)
    else:
        for key, value in report.items():
            print(f"{key}: {json.dumps(value)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
