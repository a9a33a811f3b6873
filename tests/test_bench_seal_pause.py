"""bench.seal_pause runs at tiny sizes and its JSON holds measured figures for every seal (its
timings are budgets for a real run, never asserted here)."""

from tests.test_bench_smoke import run_bench


def test_seal_pause_bench_measures_every_seal():
    result = run_bench("bench.seal_pause", "--examples", "16", "--segment-records", "64", "--segments", "3",
                       "--after", "32", "--step-ms", "0")
    assert (result["seals"], result["appends"], result["examples_per_step"]) == (3, 3 * 64 + 32, 16)
    assert result["budget_max_pause_ms"] == 20 and result["budget_seal_peak_mb"] >= 0
    assert len(result["per_seal"]) == 3
    for seal in result["per_seal"]:  # each seal finished (its index file appeared) and was timed
        assert seal["append_ms"] > 0 and seal["max_pause_during_ms"] >= seal["append_ms"]
        assert seal["appends_during"] >= 1 and seal["seconds"] is not None and seal["peak_mb"] is not None
    assert result["max_pause_during_seal_ms"] == max(s["max_pause_during_ms"] for s in result["per_seal"])
    assert result["seal_pause_within_budget"] == (result["max_pause_during_seal_ms"] <= 20)
    assert result["max_pause_ms"] == max(result["max_pause_during_seal_ms"], result["max_pause_without_seal_ms"])
    assert 0 < result["p50_append_ms"] <= result["p99_append_ms"] <= result["max_pause_ms"]
    assert result["seal_seconds"] == max(s["seconds"] for s in result["per_seal"])
    assert result["peak_mb"] >= 0
    during = result["appends_during_seal"]
    assert during + result["appends_without_seal"] == result["appends"]
    assert during <= sum(s["appends_during"] for s in result["per_seal"])  # a seal may end in the next one's filling append
    assert 0 <= result["appends_over_budget_during_seal"] <= during
    assert 0 <= result["appends_over_budget_without_seal"] <= result["appends_without_seal"]
    assert 0 < result["p99_append_during_seal_ms"] <= result["max_pause_during_seal_ms"]
    assert 0 < result["p99_append_without_seal_ms"] <= result["max_pause_without_seal_ms"]
