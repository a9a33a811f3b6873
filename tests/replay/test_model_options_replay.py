"""Issue 14's model options end to end: with the scan over layers and remat on (and, in a second
run, every option at once: fused attention, remat of the dots, microbatches, bf16 compute and the
sliding window too), `replay run` is bit-exact, and bisect of a `layer-bf16` fault names the faulty
block through the scan, down to its first intermediate (`block_NN.attn.q`, as
tests/replay/test_claims.py derives it).

The runs are tests/trainer/test_model_options.py's two option sets (its small 2-block model) as
the trainer records them: their layer-level steps are that file's programs, so the session's
compilation cache (tests/conftest.py) compiles each once for both files."""

from __future__ import annotations

import json

import pytest

from tests.cli_util import invoke
from tests.trainer.test_model_options import BASE, OPTIONS
from trainer import faults, model
from trainer.config import apply_overrides
from trainer.presets import get_preset

pytestmark = pytest.mark.slow
STEPS, EVERY, FAULT = 8, 4, 5


def _cfg(options: str):
    return apply_overrides(get_preset("tiny"), [f"steps={STEPS}", f"checkpoint.every_steps={EVERY}"]
                           + BASE + OPTIONS[options])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from trainer.loop import train

    root = tmp_path_factory.mktemp("options")
    cfg = _cfg("scan+remat-full")
    train(cfg, root / "A", preset="tiny")
    train(cfg, root / "B", preset="tiny", faults=faults.FaultPlan([faults.Fault("layer-bf16", FAULT)], cfg))
    train(_cfg("all+bf16"), root / "C", preset="tiny")
    return cfg, root


@pytest.mark.parametrize("run", ["A", "C"])
def test_replay_run_is_bit_exact_with_the_options_on(runs, run):
    _, root = runs
    result = invoke("run", str(root / run), "--steps", f"{EVERY}:{STEPS - 1}", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert (report["replayed"], report["bit_exact"], report["all_bit_exact"]) == (STEPS - EVERY, STEPS - EVERY, True)


def test_bisect_names_the_faulty_block_through_the_scan(runs):
    cfg, root = runs
    faulty = faults.FaultPlan([faults.Fault("layer-bf16", FAULT)], cfg).model_cfg(FAULT)
    block = model.block_names(cfg.model)[faulty.model.bf16_block]
    result = invoke("bisect", str(root / "A"), str(root / "B"), "--json")
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert (report["first_step"], report["cause"], report["layer"]) == (FAULT, "forward", f"{block}.attn")
    r = report["refinement"]
    assert r["first_intermediate"] == f"{block}.attn.q" and (r["dtype_a"], r["dtype_b"]) == ("float32", "bfloat16")
