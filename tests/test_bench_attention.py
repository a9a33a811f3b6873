"""bench/_attention.py (bench/overhead.py --attention-only): the interval and verdict arithmetic,
and that the comparison runs end to end at a tiny size (its timings are never asserted)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench._attention import median_interval, verdict

ROOT = Path(__file__).resolve().parents[1]


def test_the_median_interval_is_the_binomial_order_statistics():
    xs = [float(i) for i in range(24)]  # sorted 0..23; P(Bin(24, 1/2) <= 6) = 0.011, <= 7: 0.032
    assert median_interval(xs) == (6.0, 17.0)
    assert sum(math.comb(24, i) for i in range(7)) / 2 ** 24 <= 0.025 < sum(math.comb(24, i) for i in range(8)) / 2 ** 24
    assert median_interval(list(reversed(xs))) == (6.0, 17.0)  # order of the rounds does not matter
    assert median_interval([0.0] * 5) is None and median_interval([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]) == (1.0, 6.0)


def test_the_verdict_needs_the_whole_interval_on_one_side_of_the_budget():
    assert verdict((-0.05, 0.009), 0.01) == "no slower"
    assert verdict((-0.05, 0.02), 0.01) == "undecided"
    assert verdict((0.011, 0.2), 0.01) == "slower"
    assert verdict(None, 0.01) == "too few rounds"


@pytest.mark.slow  # compiles the step twice in a new process
def test_attention_only_runs_and_reports_both_clocks():
    out = subprocess.run(
        [sys.executable, "-m", "bench.overhead", "--preset", "tiny", "--attention-only", "--attention-rounds", "2",
         "--steps-per-round", "1", "--warmup-rounds", "0", "--set", "model.n_layers=1", "--set", "model.seq_len=16",
         "--api-example", ""],
        cwd=ROOT, capture_output=True, text=True, check=True, timeout=600)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    a = result["attention"]
    assert a["overrides"][-1] == "model.seq_len=16" and a["order"] == "ABBA" and a["rounds"] == 2
    for key in ("median_explicit_s", "median_fused_s", "median_cpu_explicit_s", "median_cpu_fused_s"):
        assert a[key] > 0, key
    assert a["verdict"] == a["cpu_verdict"] == "too few rounds" and a["no_slower"] is False
    assert result["within_budget"] is False and "step_overhead" not in result  # only the comparison ran
