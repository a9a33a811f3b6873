"""bench/accelerator.py on the CPU with tiny sizes: every part runs and the one JSON line says so.

On the CPU the cross-backend pair is CPU against CPU, so its bits must be equal and its noise
verdict "not above"; the no-copy check must hold for every level, in the HLO and in the buffers;
the three levels must train identically. A failing part and the deadline still give the JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def bench(*args: str, timeout: int = 600) -> tuple[subprocess.CompletedProcess, dict]:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PJRT_NPROC")}
    env["JAX_PLATFORMS"] = "cpu"
    done = subprocess.run([sys.executable, "-m", "bench.accelerator", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return done, json.loads(lines[-1])


@pytest.mark.slow
def test_every_part_runs_on_the_cpu_with_tiny_sizes():
    done, r = bench("--preset", "tiny", "--steps", "4", "--steps-per-round", "2")
    assert len(done.stdout.strip().splitlines()) == 1  # one JSON line; progress goes to stderr
    assert r["errors"] == {} and r["complete"], r["errors"]
    assert r["environment"]["backend"] == "cpu"
    p = r["pair"]
    assert p["recorded_on"] == p["replayed_on"] == "cpu" and p["steps"] == 4
    assert p["identical_bits"] and p["noise"]["above"] is False and p["noise"]["replays"] == 1
    assert p["replay_run_on_cpu"]["exit_code"] == 0 and p["replay_run_on_cpu"]["all_bit_exact"]
    for level in ("off", "step", "layer"):
        nc = r["no_copy"][level]
        assert nc["hlo"]["in_place"] and nc["runtime"]["in_place"], (level, nc)
        assert nc["memory"]["alias"] == nc["hlo"]["donated_bytes"]
    m = r["mfu"]
    assert m["steps"] == 4 and m["median_step_s"] > 0 and m["tokens_per_step"] == 16 * 32
    assert m["peak_flops"] is None and m["mfu"] is None  # a CPU has no meaningful peak
    o = r["overhead"]
    assert o["identical_training"] and o["rounds"] == 2 and set(o["median_s"]) == {"off", "step", "layer"}
    assert "step_overhead" in o and o["budget_layer_overhead"] == 0.03


@pytest.mark.slow
def test_a_failing_part_and_the_deadline_still_print_the_json():
    _, r = bench("--preset", "tiny", "--skip", "pair", "--set", "model.no_such_field=1")
    assert "lanes" in r["errors"] and "no_such_field" in r["errors"]["lanes"] and not r["complete"]
    assert r["environment"]["backend"] == "cpu" and "mfu" not in r
    _, r = bench("--preset", "tiny", "--deadline-s", "3")
    assert not r["complete"] and any("deadline" in n for n in r["notes"]), r
