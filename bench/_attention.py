"""The attention comparison of bench/overhead.py (issue 14): is the fused attention no slower?

    python -m bench.overhead --attention-only --attention-rounds 16 --steps-per-round 2 --warmup-rounds 1

The preset's train step at trace level off (what `replay train` compiles, bench/overhead.py's
Lane) with model.attention=explicit (the hand-written softmax, fixed-order backward) and
=fused (jax.nn.dot_product_attention), at a size where attention is a real share of the step:
by default demo at 512 tokens (ATTENTION_SETS; its [B, K, G, L, S] float32 logits are 64 MiB a
layer). Rounds are interleaved in ABBA order (explicit, fused, fused, explicit, ...) so that a
linear drift in machine load hits both alike; each round gives the two lanes' wall and
process CPU seconds per step, and the statistic is the median over rounds of the paired ratio
fused / explicit - 1, with a distribution-free 95% confidence interval of that median
(binomial order statistics: no assumption on the noise's shape). CPU time (all of the
process's threads) is printed beside wall time because other processes' load moves wall time
far more than it moves the work a step does.

Verdict, per clock: "no slower" when the interval's upper end is <= the budget (+1%),
"slower" when its lower end is above it, else "undecided" (the noise is wider than the
question: rerun with more rounds on a quieter machine); "too few rounds" under 6 rounds. `no_slower` is the wall-clock verdict
(the budget is about time), `no_slower_cpu` the CPU one. The 1-minute load average before,
after and its range over the rounds are reported: judge a result taken above ~1.5 x cores
with care.

Measured (2 cores shared with other jobs, load 7-8; fused / explicit - 1, median of the paired
rounds [95% interval]; a quiet-machine run is still to be taken):

    | size                     | rounds x steps | wall                     | CPU                      |
    | ------------------------ | -------------- | ------------------------ | ------------------------ |
    | demo at 512 tokens       | 6 x 1          | -34.9% [-47.1%, -24.4%]  | -38.8% [-40.8%, -36.1%]  |
    | demo at 128 (its default)| 8 x 3          | +8.7% [-32.1%, +71.5%]   | -3.2% [-9.5%, -1.6%]     |

The explicit path itself is unchanged by the attention change: the compiled train step of
tiny and demo (levels off and layer) is the same HLO, metadata aside, before (c1ae22a^) and after.
"""

from __future__ import annotations

import math
import os
import statistics
import tempfile
from pathlib import Path

# A size where attention matters: 512 tokens (demo trains at 128), the rest of demo unchanged.
ATTENTION_SETS = ("model.seq_len=512",)
IMPLS = ("explicit", "fused")


def median_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float] | None:
    """A distribution-free interval for the median of `values` at `confidence` (at least): the
    k-th smallest and k-th largest, k the largest with P(Binomial(n, 1/2) < k) <= (1 - c) / 2.
    None when there is no such k (fewer than 6 values at 95%)."""
    xs = sorted(values)
    n = len(xs)
    tail, k, below = (1 - confidence) / 2, 0, 0.0
    while k < n // 2:
        below += math.comb(n, k) / 2 ** n  # now P(Binomial(n, 1/2) <= k) = P(< k + 1)
        if below > tail:
            break
        k += 1
    return (xs[k - 1], xs[n - k]) if k else None


def verdict(interval: tuple[float, float] | None, budget: float) -> str:
    if interval is None:
        return "too few rounds"
    low, high = interval
    return "no slower" if high <= budget else "slower" if low > budget else "undecided"


def compare(preset: str, rounds: int, steps_per_round: int, warmup_rounds: int, overrides: list[str],
            budget: float, sizes: tuple[str, ...] = ATTENTION_SETS) -> dict:
    """Both attentions' level-off steps, ABBA-interleaved; the paired ratios and their verdicts."""
    from bench.overhead import Lane
    from trainer.config import apply_overrides
    from trainer.presets import get_preset

    wall: dict[str, list[float]] = {a: [] for a in IMPLS}
    cpu: dict[str, list[float]] = {a: [] for a in IMPLS}
    loads = [os.getloadavg()[0]]
    sets = list(sizes) + list(overrides)
    with tempfile.TemporaryDirectory(prefix="replay-bench-attention-") as tmp:
        lanes = {a: Lane(apply_overrides(get_preset(preset), sets + [f"model.attention={a}"]), "off", Path(tmp) / a)
                 for a in IMPLS}
        try:
            for r in range(warmup_rounds + rounds):
                for a in (IMPLS if r % 2 == 0 else IMPLS[::-1]):  # ABBA: E F, F E, E F, ...
                    seconds, cpu_seconds = lanes[a].run_round(steps_per_round)
                    if r >= warmup_rounds:
                        wall[a].append(seconds)
                        cpu[a].append(cpu_seconds)
                loads.append(os.getloadavg()[0])
        finally:
            for lane in lanes.values():
                lane.close()
    out = {"preset": preset, "overrides": sets, "rounds": rounds, "warmup_rounds": warmup_rounds,
           "steps_per_round": steps_per_round, "order": "ABBA", "budget_fused_vs_explicit": budget}
    for clock, samples, prefix in (("wall", wall, ""), ("cpu", cpu, "cpu_")):
        paired = [f / e - 1 for f, e in zip(samples["fused"], samples["explicit"])]
        interval = median_interval(paired)
        out.update({
            f"median_{prefix}explicit_s": round(statistics.median(samples["explicit"]), 6),
            f"median_{prefix}fused_s": round(statistics.median(samples["fused"]), 6),
            f"{prefix}paired_fused_vs_explicit": round(statistics.median(paired), 5),
            f"{prefix}paired_interval_95": None if interval is None else [round(x, 5) for x in interval],
            f"{prefix}rounds_fused_faster": sum(p < 0 for p in paired),
            f"{prefix}verdict": verdict(interval, budget),
        })
    # the ratio of medians, as before (less robust to drift than the paired one)
    out["fused_vs_explicit"] = round(out["median_fused_s"] / out["median_explicit_s"] - 1, 5)
    out["no_slower"] = out["verdict"] == "no slower"
    out["no_slower_cpu"] = out["cpu_verdict"] == "no slower"
    out["load_average"] = {"before": round(loads[0], 2), "after": round(loads[-1], 2),
                           "min": round(min(loads), 2), "max": round(max(loads), 2), "cpus": os.cpu_count()}
    return out
