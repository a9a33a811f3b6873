"""`replay plan --preset P --devices N`: what one device needs to train P on N devices.

Compiles the train step (trace level "step", or --level) for a mesh of N devices from abstract
shapes, without allocating the state or the batch, and prints per-device memory from the
compiled program (XLA's memory analysis: arguments, outputs, temporaries, bytes aliased to the
donated state), whether the donated state is written in place (read from the compiled HLO:
trainer/donation.py), the parameter count, parameter and optimizer bytes per device, FLOPs per
step (the model's count and XLA's), whether it fits a device's HBM (--device-kind) and the
compile time. A JAX process's device count is fixed when JAX starts, so the work runs in a
child process, `python -m trainer.plan`, with N virtual CPU devices
(XLA_FLAGS=--xla_force_host_platform_device_count=N, JAX_PLATFORMS=cpu). Its progress lines
are relayed to stderr as they come; its result (JSON) is printed here. Its cost is one
compile, whatever the run's length.

Examples (olmo3-7b: about 45 s on 2 busy CPU cores for 8 or 64 devices, 41 s for 256, of which
33-38 s is XLA's compile; olmo-1b: about 15 s):

    replay plan --preset olmo3-7b --devices 256 --device-kind tpu-v5p
    replay plan --preset tiny --devices 4 --level layer --json
    replay plan --preset tiny --devices 8 --set mesh.mesh_invariant=true --set mesh.n_microbatches=8

Model options: `--remat none|full|dots`, `--scan` (one lax.scan over stacked layers),
`--precision fp32|bf16` (bf16: bfloat16 compute, float32 master weights and optimizer state);
they are config fields (model.remat, model.scan_layers, model.dtype / model.param_dtype), so
`--set model.FIELD=VALUE` works too, and the report shows the whole model section.

    replay plan --preset olmo3-7b --devices 256 --remat full --scan --device-kind tpu-v5p

Exit codes: 0 ok; 2 bad input (unknown preset or override, a device count the mesh or the
batch cannot use); 3 if the child process failed otherwise (a bug in replay).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from typing import Annotated, Any, Optional

import typer

from replay.cli import console
from replay.errors import EXIT_BAD_INPUT, EXIT_BUG
from trainer.config import apply_overrides
from trainer.presets import get_preset
from trainer.constants import TRACE_LEVELS
from trainer.plan import DEVICE_HBM, PRECISION, REMAT, plan_env


def register(app: typer.Typer) -> None:
    app.command("plan")(plan)


def plan(
    preset: Annotated[str, typer.Option("--preset", "-p", help="Config preset: tiny, demo, olmo-1b, olmo3-7b.")],
    devices: Annotated[int, typer.Option("--devices", "-n", help="Number of devices of the mesh (simulated as virtual CPU devices).")],
    overrides: Annotated[
        Optional[list[str]], typer.Option("--set", help="Config override section.field=value, e.g. mesh.fsdp=8; repeatable.")
    ] = None,
    level: Annotated[str, typer.Option("--level", help="Trace level of the compiled step: off, step, layer.")] = "step",
    device_kind: Annotated[
        Optional[str], typer.Option("--device-kind", help="Say whether it fits: tpu-v5p, tpu-v6e, h100, h200.")
    ] = None,
    remat: Annotated[
        Optional[str], typer.Option("--remat", help="Recompute each block in the backward: none, full, dots.")
    ] = None,
    scan: Annotated[bool, typer.Option("--scan", help="Run the blocks as one scan over stacked layers.")] = False,
    precision: Annotated[
        Optional[str], typer.Option("--precision", help="fp32, or bf16 (bf16 compute, fp32 weights and optimizer).")
    ] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout instead of a table.")] = False,
) -> None:
    """Compile the train step for N devices from abstract shapes and print per-device memory (nothing is allocated)."""
    if remat is not None and remat not in REMAT:
        console.fail(f"--remat {remat}: unknown; use one of {', '.join(REMAT)}")
    if precision is not None and precision not in PRECISION:
        console.fail(f"--precision {precision}: unknown; use one of {', '.join(PRECISION)}")
    apply_overrides(get_preset(preset), list(overrides or []))  # bad preset or key: exit 2 before starting JAX
    if devices < 1:
        console.fail(f"--devices {devices}: the mesh needs at least 1 device")
    if level not in TRACE_LEVELS:
        console.fail(f"--level {level}: not a trace level; use one of {', '.join(TRACE_LEVELS)}")
    if device_kind is not None and device_kind not in DEVICE_HBM:
        console.fail(f"--device-kind {device_kind}: unknown; use one of {', '.join(DEVICE_HBM)}")

    cmd = [sys.executable, "-m", "trainer.plan", "--preset", preset, "--devices", str(devices), "--json",
           "--level", level] + (["--device-kind", device_kind] if device_kind else [])
    cmd += (["--remat", remat] if remat else []) + (["--scan"] if scan else [])
    cmd += ["--precision", precision] if precision else []
    for item in overrides or []:
        cmd += ["--set", item]
    report, error, code = _run_child(cmd, plan_env(devices))
    if code == EXIT_BAD_INPUT:
        console.fail(error or f"the plan for {devices} devices was rejected as bad input")
    if code != 0 or report is None:
        console.fail(f"the planning process (python -m trainer.plan) failed with exit code {code}"
                     + (f": {error}" if error else "") + "; rerun with --debug or run it directly to see why", EXIT_BUG)
    if json_out:
        console.print_json(report)
    else:
        render(report)


def _run_child(cmd: list[str], env: dict[str, str]) -> tuple[dict[str, Any] | None, str | None, int]:
    """Runs the child, relaying its stderr line by line; returns (its JSON report, its error
    line without the "error: " prefix, its exit code)."""
    error = None
    last_line = None
    with tempfile.TemporaryFile(mode="w+") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.PIPE, env=env, text=True)
        try:
            assert proc.stderr is not None
            for line in proc.stderr:
                line = line.rstrip("\n")
                if not line.strip():
                    continue
                if line.startswith("error: "):
                    error = line[len("error: "):]
                    continue
                last_line = line
                console.status(line)
            code = proc.wait()
        finally:
            if proc.poll() is None:  # interrupted: do not leave the compile running
                proc.kill()
                proc.wait()
        out.seek(0)
        text = out.read().strip()
    report = None
    if code == 0 and text:
        try:
            report = json.loads(text.splitlines()[-1])
        except json.JSONDecodeError:
            error = error or "its output was not JSON"
    return report, error or (last_line if code not in (0, EXIT_BAD_INPUT) else None), code


# ------------------------------------------------------------------------------ for people


def _bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n} B"


def _count(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:,.2f}{unit}"
    return f"{n:g}"


def _donation(d: dict[str, Any] | None) -> str:
    if not d:
        return "-"
    verdict = "written in place (no copy)" if d["in_place"] else "NOT in place: the step copies the state"
    return (f"{verdict}: {d['aliased_leaves']} of {d['donated_leaves']} leaves aliased, "
            f"{_bytes(d['copied_bytes'])} copied, {_bytes(d['unaliased_bytes'])} unaliased, "
            f"of {_bytes(d['donated_bytes'])}")


def _fit(f: dict[str, Any]) -> str:
    if f["fits"] is None:
        return f"unknown (no memory analysis) for {f['device_kind']}"
    word = "fits" if f["fits"] else "does NOT fit"
    return (f"{word} {f['device_kind']} ({f['hbm_bytes'] / 1e9:g} GB HBM): {f['share']:.1%} of it per device "
            "(the runtime keeps part of it)")


def _options(r: dict[str, Any]) -> str:
    m, p = r["model"], r.get("precision") or {}
    window = (f"sliding window {m['sliding_window']} (every {m['full_attention_every']}th layer full)"
              if m.get("sliding_window") else "full attention")
    return (f"attention {m.get('attention')}, {window}, remat {m.get('remat')}, "
            f"{'scan over layers' if m.get('scan_layers') else 'layers unrolled'}; compute {p.get('compute')}, "
            f"params {p.get('params')}, optimizer {'/'.join(p.get('optimizer', []))}")


def render(r: dict[str, Any]) -> None:
    b, mem, sec = r["bytes"], r.get("memory_per_device") or {}, r["seconds"]
    inv = r.get("mesh_invariant")
    rows = [
        ("preset", r["preset"]),
        ("devices", f"{r['devices']} (virtual {r['backend']} devices; mesh data={r['mesh']['data']} x fsdp={r['mesh']['fsdp']})"),
        ("trace level", f"{r['trace_level']} (the step compiled with {r['trace_level']}-level recording)"),
        ("model options", _options(r)),
    ]
    if inv:
        rows.append(("mesh-invariant", f"{inv['n_microbatches']} microbatches, fixed-order reduce-scatter"))
    rows += [
        ("parameters", f"{_count(r['params'])} ({r['params']:,})"),
        ("params per device", f"{_bytes(b['params_per_device'])} (of {_bytes(b['params_total'])})"),
        ("optimizer per device", f"{_bytes(b['optimizer_per_device'])} (of {_bytes(b['optimizer_total'])})"),
        ("batch", f"{r['global_batch_size']} x {r['seq_len']} tokens = {r['tokens_per_step']:,} per step"),
        ("FLOPs per step", f"{r['flops_per_step']:.3e} (6N + attention, all devices)"),
    ]
    if r.get("xla_flops_per_step"):
        rows.append(("XLA FLOPs per step", f"{r['xla_flops_per_step']:.3e} (cost analysis x {r['devices']} devices; "
                                           "a loop body counted once)"))
    if mem:
        rows += [
            ("memory: arguments", _bytes(mem["argument"])),
            ("memory: outputs", f"{_bytes(mem['output'])} ({_bytes(mem['alias'])} aliased to donated arguments)"),
            ("memory: temporaries", _bytes(mem["temp"])),
            ("memory: generated code", _bytes(mem["generated_code"])),
            ("memory: total per device", f"{_bytes(mem['total'])} (arguments + outputs - aliased + temporaries)"),
        ]
    else:
        rows.append(("memory", "not reported by this backend"))
    state = r.get("gradient_state_per_device")
    if state:
        rows.append(("gradient state", f"{_bytes(state['total'])} ({state['in_gradients']:g} gradients: "
                                       f"{_bytes(state['accumulators'])} kept across {state['microbatch_steps']} "
                                       f"microbatch steps + {_bytes(state['reduced'])} reduced shard)"))
    rows.append(("donated state", _donation(r.get("donation"))))
    if r.get("fit"):
        rows.append(("fits", _fit(r["fit"])))
    rows.append(("time", f"trace {sec['trace']:.1f} s, lower {sec['lower']:.1f} s, compile {sec['compile']:.1f} s"))
    console.print_table([(k, str(v)) for k, v in rows], title=f"plan: {r['preset']} on {r['devices']} devices (per device)")
    console.status("memory is XLA:CPU's buffer assignment for one device's program: arguments and outputs are "
                   "exact for this sharding; temporaries depend on the backend's fusion, so they are an estimate")
