"""The accelerator checks (issue 14), one short script: MFU, recording overhead, no-copy, cross-backend.

    python -m bench.accelerator                      # on a GPU/TPU machine: olmo-1b, about 3-5 min
    python -m bench.accelerator --preset tiny        # anywhere (the CPU test runs this)

Parts, in this order, each timed and guarded (a failure is recorded under "errors" and the
rest still runs; a watchdog prints what was measured so far and exits at --deadline-s):

  pair       the cross-backend pair: `--pair-preset` (demo; tiny with --preset tiny) trained
             here for --pair-steps at trace level layer (run A), then, in a child process on
             the CPU (JAX_PLATFORMS=cpu), the same config trained from the same seed (run B:
             A replayed on the CPU, recorded) and `replay run A` on the CPU; B is judged
             against A with replay/engine/noise.py (A's noise floor, measured on the CPU by replaying
             A with every parameter one ULP off). Across backends bits are not expected; the
             verdict says whether any recorded quantity is above the floor.
  lanes      `--preset` (olmo-1b) with `data.global_batch_size=--batch` (one 4096-token example
             per device by default) on this machine's devices, three
             programs as `replay train` builds them (trace levels off, step, layer), each with
             its own state from the same initial state (bench/overhead.py's Lane).
  no_copy    per level: the compiled HLO's input_output_alias and copies of the donated state
             (trainer/donation.py), the memory analysis, and the backend's own word: whether the
             state came back from the first step in the very buffers it went in.
  mfu        30 (--steps) timed steps of level off: model FLOPs (6N + attention,
             trainer/model.py) / step time / the device's peak (replay/record/environment.py).
  overhead   rotating rounds of --steps-per-round steps over the three levels (one warm-up
             round, then rounds up to --steps steps a level): step and layer overhead as ratios
             of median step times, and whether the three trained bit-identically.

Prints ONE JSON object on the last line (also on a failure or at the deadline, with what it
has): figures beside their budgets (overhead budgets as bench/overhead.py: step <= 1%, layer
<= 3%). Sizes: olmo-1b at batch 1 x 4096 tokens holds three states (3 x 18 GB) and one step's
temporaries; XLA_PYTHON_CLIENT_MEM_FRACTION is set to 0.92 unless given. Nothing here grows
with anything but the steps asked for.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from trainer.constants import TRACE_LEVELS  # no JAX import

ROOT = Path(__file__).resolve().parents[1]
BUDGETS = {"step_overhead": 0.01, "layer_overhead": 0.03}  # as bench/overhead.py

_result: dict = {"bench": "accelerator", "complete": False, "errors": {}, "seconds": {}}
_printed = threading.Lock()
_T0 = time.perf_counter()
_cleanup: dict = {"children": [], "tmp": None}  # what the watchdog ends before it exits


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:6.1f} s] {msg}", file=sys.stderr, flush=True)


def emit_and_exit(code: int = 0) -> None:
    """Print the one JSON line (once, whoever gets here first: the end, a failure, the watchdog)."""
    if _printed.acquire(blocking=False):
        _result["seconds"]["total"] = round(time.perf_counter() - _T0, 1)
        print(json.dumps(_result, default=str), flush=True)
    if threading.current_thread() is not threading.main_thread():
        for child in _cleanup["children"]:
            if child.poll() is None:  # its own process group: the CPU child's `replay run` goes too
                with contextlib.suppress(OSError):
                    os.killpg(child.pid, signal.SIGKILL)
        if _cleanup["tmp"]:
            for _ in range(3):  # the main thread may be writing into it meanwhile: sweep until it stays gone
                shutil.rmtree(_cleanup["tmp"], ignore_errors=True)
                time.sleep(0.3)
                if not os.path.exists(_cleanup["tmp"]):
                    break
        os._exit(code)  # the watchdog: the main thread may be inside a compile


def run_child(cmd: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    """subprocess.run, with the child known to the watchdog (ended with this script)."""
    child = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    _cleanup["children"].append(child)
    try:
        out, err = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        out, err = child.communicate()
    return subprocess.CompletedProcess(cmd, child.returncode, out, err)


def part(name: str, fn, *args):
    """Run one part, record its seconds, or its error (type: message) and go on."""
    t0 = time.perf_counter()
    log(f"{name} ...")
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - a part's failure is a figure, never the end of the script
        _result["errors"][name] = f"{type(e).__name__}: {' '.join(str(e).split())[:500]}"
        log(f"{name} failed: {_result['errors'][name]}")
        return None
    finally:
        _result["seconds"][name] = round(time.perf_counter() - t0, 1)


# ------------------------------------------------------------------------------ the pair

def record_pair_a(args: argparse.Namespace, out: Path) -> Path:
    from trainer.config import apply_overrides
    from trainer.presets import get_preset
    from trainer.loop import train

    cfg = apply_overrides(get_preset(args.pair_preset), [
        f"steps={args.pair_steps}", "trace.level=layer", "trace.layer_every=1",
        f"checkpoint.every_steps={max(1, args.pair_steps // 2)}", "checkpoint.keep=0", *(args.pair_set or [])])
    train(cfg, out / "A", preset=args.pair_preset)
    return out / "A"


def cpu_side(a_path: Path, out: Path) -> dict:
    """In the CPU child: train B (A's config, here), replay A here, judge B against A's floor."""
    from replay.engine.noise import judge
    from traces import Run, compare
    from trainer.config import from_dict
    from trainer.loop import train

    run_a = Run.open(a_path)
    cfg = from_dict(run_a.manifest["config"])
    train(cfg, out / "B", preset=run_a.manifest.get("preset"))
    run_b = Run.open(out / "B")
    cmp = compare(run_a.trace, run_b.trace)
    last = run_a.trace.end - 1
    replayed = run_child([sys.executable, "-m", "replay.cli.app", "run", str(a_path), "--steps", f"0:{last}",
                          "--json"], os.environ.copy(), 600)
    try:
        rep = json.loads(replayed.stdout.strip().splitlines()[-1])
        replay_run = {"exit_code": replayed.returncode, "all_bit_exact": rep.get("all_bit_exact"),
                      "replayed": rep.get("replayed"), "contract": (rep.get("contract") or {}).get("line"),
                      "first_mismatch": _short_mismatch(rep.get("first_mismatch"))}
    except (ValueError, IndexError):
        replay_run = {"exit_code": replayed.returncode, "error": replayed.stderr.strip()[-300:]}
    verdict = judge(run_a, run_b, 0, run_a.trace.end)
    return {"recorded_on": run_a.manifest["environment"].get("device_kind"),
            "replayed_on": run_b.manifest["environment"].get("device_kind"),
            "steps": run_a.trace.end, "identical_bits": cmp.identical,
            "first_difference": None if cmp.identical else {"step": cmp.first_step, "kind": cmp.diffs[0].kind,
                                                            "name": cmp.diffs[0].name},
            "noise": verdict.to_json(), "replay_run_on_cpu": replay_run}


def _short_mismatch(m):
    if not m:
        return m
    fields = m.get("fields") or []
    return {"step": m.get("step"), "fields": [{k: f.get(k) for k in ("name", "kind", "distance")} for f in fields[:3]]}


def pair(args: argparse.Namespace, tmp: Path) -> dict:
    a = record_pair_a(args, tmp)
    log("pair: run A recorded; training B and replaying A on the CPU in a child process")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "XLA_PYTHON_CLIENT_MEM_FRACTION")}
    env["JAX_PLATFORMS"] = "cpu"
    child = run_child([sys.executable, "-m", "bench.accelerator", "--cpu-side", str(a), "--out", str(tmp)], env,
                      max(30, args.remaining()))
    if child.returncode:
        raise RuntimeError(f"the CPU child failed (exit {child.returncode}): {child.stderr.strip()[-400:]}")
    return json.loads(child.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------ the lanes

def _lane(lane_cls, cfg, level: str, trace_dir: Path):
    """One level's Lane, built and stepped once, and its no-copy figures."""
    from trainer import donation

    t0 = time.perf_counter()
    lane = lane_cls(cfg, level, trace_dir)
    _result["lanes"]["compile_s"][level] = round(time.perf_counter() - t0, 1)
    compiled = lane.built.compiled[level]
    mem = compiled.memory_analysis()
    before = donation.buffer_pointers(lane.state)
    lane.run_round(1)  # step 0: also the first warm-up
    return lane, {"hlo": donation.check(compiled),
                  "runtime": donation.runtime_in_place(before, donation.buffer_pointers(lane.state)),
                  "memory": None if mem is None else {
                      "argument": int(mem.argument_size_in_bytes), "output": int(mem.output_size_in_bytes),
                      "alias": int(mem.alias_size_in_bytes), "temp": int(mem.temp_size_in_bytes)}}


def build_lanes(args: argparse.Namespace, tmp: Path) -> dict:
    from bench.overhead import Lane
    from trainer import model
    from trainer.config import apply_overrides
    from trainer.presets import get_preset

    overrides = [f"data.global_batch_size={args.batch}"] + list(args.set or [])
    cfg = apply_overrides(get_preset(args.preset), overrides)
    _result["lanes"] = {"preset": args.preset, "overrides": overrides, "batch": cfg.data.global_batch_size,
                        "seq_len": cfg.model.seq_len, "params": model.param_count(cfg), "compile_s": {}}
    lanes, no_copy = {}, {}
    for level in TRACE_LEVELS:
        if args.remaining() < 30:  # keep what was built: MFU needs only level off
            _result.setdefault("notes", []).append(f"lanes: no time left to build level {level}")
            break
        try:
            lanes[level], no_copy[level] = _lane(Lane, cfg, level, tmp / "lanes")
        except Exception as e:  # noqa: BLE001 - keep the levels built (an OOM at level layer still leaves MFU)
            _result["errors"][f"lanes:{level}"] = f"{type(e).__name__}: {' '.join(str(e).split())[:500]}"
            log(f"lanes: level {level} failed: {_result['errors'][f'lanes:{level}']}")
            break
        _result["no_copy"] = no_copy
        log(f"lanes: level {level} built in {_result['lanes']['compile_s'][level]} s; "
            f"in place: hlo {no_copy[level]['hlo']['in_place']}, runtime {no_copy[level]['runtime']['in_place']}")
    return {"cfg": cfg, "lanes": lanes}


def mfu(args: argparse.Namespace, built: dict) -> dict:
    import jax

    from replay.record.environment import peak_flops
    from trainer import model

    cfg, lane = built["cfg"], built["lanes"]["off"]
    lane.run_round(2)  # warm
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        lane.run_round(1)  # dispatch, then wait for the state: one step's wall time
        times.append(time.perf_counter() - t0)
    tokens = cfg.data.global_batch_size * cfg.model.seq_len
    flops = model.flops_per_token(cfg) * tokens
    kind = jax.devices()[0].device_kind
    peak = peak_flops(kind)
    peak = None if peak is None else peak * jax.device_count()  # the step runs on all of them
    med = statistics.median(times)
    return {"steps": args.steps, "median_step_s": round(med, 6), "tokens_per_step": tokens,
            "tokens_per_s": round(tokens / med, 1), "model_flops_per_step": flops, "device_kind": kind,
            "peak_flops": peak, "mfu": None if peak is None else round(flops / med / peak, 4)}


def overhead(args: argparse.Namespace, built: dict) -> dict:
    import jax

    from trainer import mesh as meshlib

    lanes = built["lanes"]
    for lane in lanes.values():  # the same start for all three: training must then be identical
        lane.state = meshlib.init_sharded_state(lane.built.cfg, lane.built.mesh)
        lane.step = 0
    order = list(lanes.values())
    rounds = max(1, args.steps // args.steps_per_round)
    wall = {lvl: [] for lvl in lanes}
    for r in range(1 + rounds):  # round 0 warms up
        if r and args.remaining() < 10:
            break
        for lane in order[r % 3:] + order[:r % 3]:
            seconds, _ = lane.run_round(args.steps_per_round)
            if r:
                wall[lane.level].append(seconds)
    med = {lvl: statistics.median(v) for lvl, v in wall.items() if v}
    finals = {lvl: jax.device_get(lane.state.params) for lvl, lane in lanes.items()}
    identical = all(all((a == b).all() for a, b in zip(jax.tree.leaves(finals["off"]), jax.tree.leaves(f)))
                    for f in finals.values())
    out = {"rounds": len(wall["off"]), "steps_per_round": args.steps_per_round,
           "median_s": {k: round(v, 6) for k, v in med.items()}, "identical_training": bool(identical),
           "budget_step_overhead": BUDGETS["step_overhead"], "budget_layer_overhead": BUDGETS["layer_overhead"]}
    if len(med) == 3:
        out["step_overhead"] = round(med["step"] / med["off"] - 1, 5)
        out["layer_overhead"] = round(med["layer"] / med["off"] - 1, 5)
        out["within_budget"] = (out["step_overhead"] <= BUDGETS["step_overhead"]
                                and out["layer_overhead"] <= BUDGETS["layer_overhead"])
    for lane in lanes.values():
        lane.close()
    return out


def environment() -> dict:
    import jax

    dev = jax.devices()[0]
    stats = {}
    try:
        stats = dev.memory_stats() or {}
    except Exception:  # noqa: BLE001 - not every backend reports memory
        pass
    return {"backend": jax.default_backend(), "device_kind": dev.device_kind, "device_count": jax.device_count(),
            "jax": jax.__version__, "bytes_limit": stats.get("bytes_limit"),
            "mem_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")}


# ------------------------------------------------------------------------------ main

def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="olmo-1b", help="the lanes' preset (tiny: the CPU smoke run)")
    ap.add_argument("--batch", type=int, default=None,
                    help="global batch of the lanes (default: one example per device; tiny: 16)")
    ap.add_argument("--set", action="append", help="extra config override of the lanes (repeatable)")
    ap.add_argument("--steps", type=int, default=30, help="timed steps for MFU, and per level for the overhead")
    ap.add_argument("--steps-per-round", type=int, default=5)
    ap.add_argument("--pair-preset", default=None, help="the cross-backend pair's preset (default demo; tiny: tiny)")
    ap.add_argument("--pair-steps", type=int, default=None, help="steps of the pair's runs (default 20; tiny: 4)")
    ap.add_argument("--pair-set", action="append",
                    help="extra config override of the pair's runs (repeatable; B takes A's config from its manifest)")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: pair, lanes")
    ap.add_argument("--deadline-s", type=float, default=290.0, help="print what was measured and exit at this age")
    ap.add_argument("--cpu-side", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.cpu_side:  # the pair's child process, on the CPU
        print(json.dumps(cpu_side(Path(args.cpu_side), Path(args.out)), default=str), flush=True)
        return
    tiny = args.preset == "tiny"
    args.pair_preset = args.pair_preset or ("tiny" if tiny else "demo")
    args.pair_steps = args.pair_steps or (4 if tiny else 20)
    args.remaining = lambda: args.deadline_s - (time.perf_counter() - _T0)
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")  # before JAX starts: three states + a step
    watchdog = threading.Timer(args.deadline_s, lambda: (_result.setdefault("notes", []).append(
        f"stopped at the {args.deadline_s:g} s deadline"), emit_and_exit(0)))
    watchdog.daemon = True
    watchdog.start()
    skip = set(filter(None, args.skip.split(",")))
    _result["environment"] = part("environment", environment)
    devices = (_result["environment"] or {}).get("device_count") or 1
    args.batch = args.batch or (16 if tiny else devices)  # olmo-1b: one 4096-token example per device
    _result["args"] = {k: v for k, v in vars(args).items() if k not in ("remaining", "cpu_side", "out")}
    with tempfile.TemporaryDirectory(prefix="replay-bench-accelerator-") as tmp:
        _cleanup["tmp"] = tmp
        if "pair" not in skip:
            _result["pair"] = part("pair", pair, args, Path(tmp))
        if "lanes" not in skip:
            built = part("lanes", build_lanes, args, Path(tmp))
            if built and "off" in built["lanes"]:
                _result["mfu"] = part("mfu", mfu, args, built)
            if built and len(built["lanes"]) == len(TRACE_LEVELS):
                _result["overhead"] = part("overhead", overhead, args, built)
    _result["complete"] = not _result["errors"] and not skip and not _result.get("notes")
    watchdog.cancel()
    emit_and_exit(0)


if __name__ == "__main__":
    main()
