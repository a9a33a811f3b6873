"""The trace benchmarks run and their JSON is right (their timings are budgets, not tested here)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_bench(*args):
    out = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_trace_compare_bench_finds_the_planted_divergence():
    for seed in (1, 2):
        result = run_bench("bench.trace_compare", "--steps", "40000", "--seed", str(seed))
        assert result["found_step"] == result["first_divergence"]
        assert result["steps"] == 40000 and result["bytes_per_step"] > 0 and result["seconds"] > 0


def test_trace_write_bench_reports_throughput():
    result = run_bench("bench.trace_write", "--records", "5000")
    assert result["records"] == 5000 and result["records_per_second"] > 0


def test_bisect_bench_finds_the_planted_divergence():
    result = run_bench("bench.bisect", "--steps", "3000", "--seed", "5", "--no-sparse")
    assert result["found_step"] == result["first_divergence"] == result["found_step_data"]
    assert (result["cause"], result["cause_data"]) == ("loss", "data")
