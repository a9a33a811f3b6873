"""bench.remote runs, and what it measures is a remote run read as its local copy (its timings are
budgets, not tested here)."""

import pytest

from tests.test_bench_smoke import run_bench

pytest.importorskip("moto.server", reason="pip install -e '.[dev]' brings moto[server]")


def test_remote_bench_reads_the_runs_as_their_local_copies():
    result = run_bench("bench.remote", "--steps", "3000", "--segment-records", "512", "--latency-ms", "0")
    assert result["same_output_as_local"] == {"show": True, "audit": True, "bisect": True}
    figures = result["figures"]
    assert figures["bisect:local"]["requests"] == 0 and figures["bisect:remote"]["requests"] > 0
    # opening: a request or two a segment (its header and seal, in parallel) and a few more, not one a step
    assert result["segments"] == 6 and figures["open:remote"]["requests"] <= 2 * result["segments"] + 8
    assert set(result["budgets"]) >= {"open_s", "open_remote_s", "bisect_s", "bisect_remote_s", "within"}
