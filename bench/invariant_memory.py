"""Mesh-invariant mode's per-device gradient memory against the device count, from `replay plan`.

    python -m bench.invariant_memory [--preset tiny] [--devices 2,4,8,64] [--microbatches 64]
                                     [--no-reference] [--set model.vocab_size=4096 ...]

For each device count, in its own process with that many virtual CPU devices, compiles the
mesh-invariant train step (trace level step; `python -m trainer.plan`, what `replay plan` runs,
nothing allocated) with the trainer's reduction (strided microbatches reduce-scattered in the
scan on power-of-two counts, trainer/invariant.py) and, unless --no-reference, with the previous
one (`reduction="gather"`: consecutive microbatches, every device's partial sums all-gathered).
It reports XLA:CPU's per-device memory analysis (arguments, temporaries, total) of both, the
temporaries in gradients (G = the gradient's bytes) and least-squares fits of them to
a + b / devices and a + b / devices^2, so the table says at a glance how much of them shrinks
with the mesh and how much does not (a, in G).

The global batch is set to the microbatch count (one example a microbatch), so that
activations stay small beside the gradients and the temporaries are mostly gradients.
model.attention=explicit is set first (mesh-invariant mode refuses the fused attention, whose
backward has no fixed order; the olmo presets default to fused); a --set may follow it.

It also reports each plan's gradient state (`gradient_state_per_device`, trainer/gradient_memory.py:
what a device keeps of the gradient across microbatches, the scan's carry, plus the reduced
gradient's shard, read from the traced program), devices x state, and the temporaries less the
state (one microbatch's backward, the same program on every count).

Budgets: the reduce-scatter never needs more temporaries than the all-gather (1% slack); its
temporaries at the largest count are at most 3 G (one microbatch's gradient, the all_to_all's
shards of one scan step, the mean) where the previous one held n_devices of them; the gradient
state shrinks as 1/devices or faster (`gradient_state_scales_as_1_over_devices`: devices x state
never grows from one count to the next, 1% slack; every plan must report it). The temporaries'
fit verdict `temp_scales_as_1_over_devices` (a <= 0.1 G and every point within 10% of the fit)
is reported, not budgeted: one microbatch's backward does not shrink with the mesh (the
parameters are replicated inside the shard_map, so it makes every leaf's gradient whole once).

Measured (tiny, M = 64, global batch 64, G = 0.56 MB; temporaries per device; 2.5 minutes on
2 busy cores for the four counts and both reductions):

    | devices | all-gather (before) | reduce-scatter (now) | now, in G | G / devices |
    | ------- | ------------------- | -------------------- | --------- | ----------- |
    | 2       | 19.46 MB            | 9.83 MB              | 17.59     | 0.5         |
    | 4       | 9.74 MB             | 3.12 MB              | 5.58      | 0.25        |
    | 8       | 5.26 MB             | 1.44 MB              | 2.58      | 0.125       |
    | 64      | 14.45 MB            | 1.13 MB              | 2.03      | 0.016       |

Fits of "now, in G": a + b / n leaves up to 100% residuals (a = -0.52, b = 33.5); a + b / n^2
fits within 13% with a = 1.76 G and b = 63.1 G (= M G: the scan's stacked block sums). So the
temporaries shrink faster than 1/devices down to a floor of about 2 G that does not shrink:
temp_scales_as_1_over_devices is false.

Session 6 (the scan's block sums added as it goes, trainer/tree_sums.py Counter: log2(M / n) + 1
partial sums instead of M / n; 73 s, machine otherwise idle), temporaries per device:

    | devices | reduce-scatter, session 5 | reduce-scatter now | now, in G | reference ("gather") now |
    | ------- | ------------------------- | ------------------ | --------- | ------------------------ |
    | 2       | 9.83 MB                   | 2.70 MB            | 4.83      | 4.83 MB                  |
    | 4       | 3.12 MB                   | 1.59 MB            | 2.84      | 3.99 MB                  |
    | 8       | 1.44 MB                   | 1.17 MB            | 2.09      | 5.03 MB                  |
    | 64      | 1.13 MB                   | 1.13 MB            | 2.03      | 14.45 MB                 |

(the reference's consecutive path uses the Counter too, so its 2-device figure fell as well.)
Fits: a + b / n^2 within 5% with a = 2.01 G, b = 11.3 G. The floor of ~2 G is what is left: one
microbatch's backward (~1.4 G of temporaries on XLA:CPU even when each leaf is consumed at once)
and the mean, all-gathered whole for the grad norm and the replicated update.

Session 11 (the gradient leaves the shard_map as row shards, split_axis = axis 0; the clip and
AdamW on the shards; the grad norm from the shards in a fixed order, tree_sums.fixed_order_sums;
55 s on an Intel Xeon, machine otherwise idle), temporaries per device (the reference is
unchanged, it still returns the gradient whole):

    | devices | reduce-scatter, session 6 | reduce-scatter now | now, in G | reference ("gather") now |
    | ------- | ------------------------- | ------------------ | --------- | ------------------------ |
    | 2       | 2.70 MB                   | 2.74 MB            | 4.90      | 4.87 MB                  |
    | 4       | 1.59 MB                   | 1.58 MB            | 2.83      | 3.99 MB                  |
    | 8       | 1.17 MB                   | 1.16 MB            | 2.08      | 5.42 MB                  |
    | 64      | 1.13 MB                   | 0.87 MB            | 1.56      | 14.54 MB                 |

Fit a + b / n: a = 1.28 G (was 2.01), b = 7.0 G, within 11%. Where the rest is (XLA's buffer
assignment, `--xla_dump_to`): at 64 devices the peak is inside the scan body, one microbatch's
backward: a few whole leaves in flight (XLA reuses one leaf's buffer for the next) and the
activations; before, it was the end of the step (the mean gathered whole and the update's
whole-leaf temporaries). On a model whose activations are small beside G (`--set
model.seq_len=8 --set model.d_model=128 --set model.d_ff=512 --set model.n_layers=4`,
G = 4.27 MB, --no-reference): 4.64 / 1.92 / 0.92 / 0.52 G, the Counter's log2(M / n) + 1 shards
of G / n at the small counts and that backward floor at 64.

Session 12 (the gradient state added to the plan; the program unchanged; Intel Xeon, idle), in G:

    | devices | temp | gradient state | devices x state | temp - state | reference's state |
    | ------- | ---- | -------------- | --------------- | ------------ | ----------------- |
    | 2       | 4.90 | 3.5            | 7.0             | 1.40         | 7.0               |
    | 4       | 2.83 | 1.5            | 6.0             | 1.33         | 6.0               |
    | 8       | 2.08 | 0.625          | 5.0             | 1.45         | 5.0               |
    | 64      | 1.56 | 0.032          | 2.06            | 1.53         | 2.0               |

The state is bit_length(64 / n) Counter shards of G / n plus the reduced shard (a few leaves that
64 does not divide stay whole); the reference ("gather") keeps whole partial sums and the whole
mean, so its devices x state grows 14 / 24 / 40 / 128 G. The wide model above: the same state,
temp - state 1.14 / 0.42 / 0.30 / 0.49 G; the FSDP layout (mesh.data=1 mesh.fsdp=-1, tiny): the
same state, temp - state 2.39 / 2.33 / 2.45 / 2.26 G (the parameters all-gathered whole).

Prints one JSON object on the last line. Cost: one or two compiles per device count (5-40 s
each on 2 cores, more with the count); nothing depends on a run's length.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The previous implementation, as the trainer would run it: every value_and_grad with reduction="gather".
GATHER = ("import functools; from trainer import invariant; "
          "invariant.value_and_grad = functools.partial(invariant.value_and_grad, reduction='gather'); "
          "from trainer.plan import main; raise SystemExit(main())")
BUDGET = {"temp_scatter_over_gather_max": 1.01, "temp_scatter_at_largest_count_max_gradients": 3.0,
          # devices x gradient state may not grow from one count to the next (1% slack)
          "devices_x_gradient_state_growth_max": 1.01}
# The fit's verdict: what "shrinks as 1/devices" means here (a reported property, not a budget).
FLOOR_MAX_GRADIENTS = 0.1
FIT_MAX_RELATIVE_RESIDUAL = 0.1


def overrides(microbatches: int, extra: list[str]) -> list[str]:
    """The config overrides of every plan: explicit attention (mesh-invariant mode needs it),
    the mode, M microbatches of one example each, then the user's (which may change any)."""
    return ["model.attention=explicit", "mesh.mesh_invariant=true", f"mesh.n_microbatches={microbatches}",
            f"data.global_batch_size={microbatches}", *extra]


def fit_inverse(counts: list[int], values: list[float], power: int = 1) -> dict:
    """Least squares values ~ a + b / n**power over the device counts: a is what does not shrink
    with the mesh, b / n**power what does; max_relative_residual the worst |value - fit| / value."""
    xs = [1.0 / n ** power for n in counts]
    k = len(xs)
    mx, my = sum(xs) / k, sum(values) / k
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, values)) / sxx if sxx else 0.0
    a = my - b * mx
    worst = max(abs(y - (a + b * x)) / y for x, y in zip(xs, values)) if values else 0.0
    return {"a": a, "b": b, "max_relative_residual": worst}


def _plan(devices: int, reduction: str, args: argparse.Namespace) -> dict:
    from trainer.plan import plan_env

    head = ["-c", GATHER] if reduction == "gather" else ["-m", "trainer.plan"]
    cmd = [sys.executable, *head, "--preset", args.preset, "--devices", str(devices), "--json"]
    cmd += [a for s in overrides(args.microbatches, args.set or []) for a in ("--set", s)]
    done = subprocess.run(cmd, cwd=ROOT, env=plan_env(devices), capture_output=True, text=True)
    if done.returncode:
        return {"error": (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]}
    r = json.loads(done.stdout.strip().splitlines()[-1])
    mem = r["memory_per_device"]
    state = r.get("gradient_state_per_device") or {}
    return {"argument": mem["argument"], "temp": mem["temp"], "total": mem["total"],
            "grad_bytes": r["bytes"]["params_total"], "gradient_state": state.get("total"),
            "compile_s": r["seconds"]["compile"]}


def summarize(rows: dict[int, dict], args: argparse.Namespace) -> dict:
    """The JSON report from the plans of every count (rows[n]: "scatter" and maybe "gather")."""
    counts = sorted(rows)
    good = [n for n in counts if "error" not in rows[n]["scatter"]]
    grad = rows[good[0]]["scatter"]["grad_bytes"] if good else None
    per_device = {}
    for n in counts:
        s, g = rows[n]["scatter"], rows[n].get("gather")
        entry = {"scatter": s}
        if "error" not in s:
            entry["temp_scatter_gradients"] = round(s["temp"] / grad, 3)
            entry["ideal_gradients"] = round(1 / n, 4)  # G / n: the gradient's own shard
            if s.get("gradient_state") is not None:
                entry["gradient_state_gradients"] = round(s["gradient_state"] / grad, 4)
                entry["devices_x_gradient_state_gradients"] = round(n * s["gradient_state"] / grad, 3)
                # the rest of the temporaries: one microbatch's backward, the same on every count
                entry["temp_minus_gradient_state_gradients"] = round((s["temp"] - s["gradient_state"]) / grad, 3)
        if g is not None:
            entry["gather"] = g
            both = "error" not in s and "error" not in g
            entry["temp_scatter_over_gather"] = round(s["temp"] / g["temp"], 4) if both else None
        per_device[str(n)] = entry
    fits = {}
    if grad and len(good) >= 2:
        temps = [rows[n]["scatter"]["temp"] / grad for n in good]
        # 1/n: the promise (each device holds its shard); 1/n^2: the scan's stacked block sums,
        # (M / n steps) x (G / n shards), which is what the temporaries follow today
        for power, name in ((1, "a_plus_b_over_devices"), (2, "a_plus_b_over_devices_squared")):
            f = fit_inverse(good, temps, power)
            fits[name] = {"floor_a_gradients": round(f["a"], 3), "b_gradients": round(f["b"], 3),
                          "max_relative_residual": round(f["max_relative_residual"], 4)}
        one = fits["a_plus_b_over_devices"]
        fits["temp_scales_as_1_over_devices"] = bool(one["floor_a_gradients"] <= FLOOR_MAX_GRADIENTS
                                                     and one["max_relative_residual"] <= FIT_MAX_RELATIVE_RESIDUAL)
    compared = [n for n in good if "gather" in rows[n] and "error" not in rows[n]["gather"]]
    largest = rows[counts[-1]]["scatter"]
    # The gradient state shrinks as 1/devices (or faster) when devices x state never grows with
    # the count: the Counter's log2(M / n) + 1 shards make it fall faster at the small counts.
    stated = [n for n in good if rows[n]["scatter"].get("gradient_state") is not None]
    products = [n * rows[n]["scatter"]["gradient_state"] for n in stated]
    state_verdict = (len(stated) == len(counts) and len(stated) >= 2 and all(
        later <= BUDGET["devices_x_gradient_state_growth_max"] * earlier for earlier, later in zip(products, products[1:])))
    within = (len(good) == len(counts) and all(rows[n]["scatter"]["temp"] <= BUDGET["temp_scatter_over_gather_max"]
                                               * rows[n]["gather"]["temp"] for n in compared)
              and largest["temp"] <= BUDGET["temp_scatter_at_largest_count_max_gradients"] * grad
              and state_verdict)
    return {"bench": "invariant_memory", "preset": args.preset, "microbatches": args.microbatches,
            "overrides": overrides(args.microbatches, args.set or []), "cpu_count": os.cpu_count(),
            "gradient_bytes": grad, "per_device": per_device,
            "gradient_state_scales_as_1_over_devices": bool(state_verdict), "fit_temp_gradients": fits,
            "budget": BUDGET, "fit_verdict_limits": {"floor_max_gradients": FLOOR_MAX_GRADIENTS,
                                                     "max_relative_residual": FIT_MAX_RELATIVE_RESIDUAL},
            "within_budget": bool(within)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--devices", default="2,4,8,64")
    ap.add_argument("--microbatches", type=int, default=64)
    ap.add_argument("--no-reference", action="store_true", help="skip the previous (all-gather) reduction")
    ap.add_argument("--set", action="append", help="extra config override (repeatable)")
    args = ap.parse_args(argv)
    rows = {}
    for n in sorted(int(x) for x in args.devices.split(",")):
        reductions = ("scatter",) if args.no_reference else ("scatter", "gather")
        rows[n] = {red: _plan(n, red, args) for red in reductions}
        print(f"{n} devices: {json.dumps(rows[n])}", file=sys.stderr, flush=True)
    print(json.dumps(summarize(rows, args)))


if __name__ == "__main__":
    main()
