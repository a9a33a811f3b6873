"""bench/scale.py runs end to end and its JSON says what the issue asks (timings are budgets,
not tested): every command at every size, bisect finding the planted step and cause."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_scale_bench_reports_every_command_and_finds_both_divergences(tmp_path):
    # --repeats 1: each command once (11 CLI processes, not 33); the repeats only steady the timings
    out = subprocess.run([sys.executable, "-m", "bench.scale", "--sizes", "300,700", "--examples", "32",
                          "--repeats", "1", "--dir", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, check=True)
    *sizes, summary = [json.loads(line) for line in out.stdout.strip().splitlines()]
    assert [s["steps"] for s in sizes] == summary["steps"] == [300, 700] and summary["repeats"] == 1
    assert summary["byte_compiled"] is True  # the commands read bytecode, as from an installed package
    for size in sizes:
        commands = size["commands"]
        assert set(commands) == {"show", "audit", "spike", "bisect_metric", "bisect_data"}
        assert commands["show"]["exit_code"] == commands["audit"]["exit_code"] == commands["spike"]["exit_code"] == 0
        assert (commands["bisect_metric"]["found_step"], commands["bisect_metric"]["cause"]) == (size["diverge_at"], "loss")
        assert (commands["bisect_data"]["found_step"], commands["bisect_data"]["cause"]) == (size["diverge_at"], "data")
        assert commands["bisect_data"]["repeated_in_b"] == 16  # half of the 32 examples were fed before
    for name, row in summary["commands"].items():
        assert row["budget_seconds"] > 0 and row["budget_rss_mb"] > 0 and row["exponent"] is not None, name
    # issue 34's budgets beside issue 12's, for the commands it names
    assert {n for n, row in summary["commands"].items() if "budget_34_seconds" in row} == {
        "show", "audit", "spike", "bisect_data"}
    assert summary["commands"]["audit"]["budget_34_seconds"] == 30.0
    assert all(isinstance(summary["commands"][n]["within_budget_34"], bool) for n in ("show", "audit", "spike", "bisect_data"))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("replay-scale-")]  # cleaned up



def test_cold_measurements_evict_before_every_repeat(tmp_path):
    # --cache cold evicts a command's files before each of its runs, not only before the first:
    # a second run would otherwise read the first one's pages from the page cache
    from bench.scale import measure

    log = tmp_path / "log"
    args = [sys.executable, "-c", f"open({str(log)!r}, 'a').write('run;')"]
    result = measure(args, tmp_path / "out", repeats=3, before=lambda: log.open("a").write("evict;"))
    assert result["exit_code"] == 0
    assert log.read_text() == "evict;run;" * 3


def test_the_commands_modules_are_byte_compiled_before_they_are_timed(tmp_path):
    import importlib.util

    from bench.scale import byte_compile

    app = Path(importlib.util.find_spec("replay.cli.app").origin)
    cached = Path(importlib.util.cache_from_source(str(app)))
    cached.unlink(missing_ok=True)
    assert byte_compile() is True and cached.exists()
