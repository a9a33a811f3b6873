"""README claims about bisect and bug reports, checked on fresh runs with today's code.

* The first intermediate inside a layer is pinned, derived from the fault's definition: a
  `layer-bf16` fault makes block n_layers // 2 compute in bfloat16 (trainer/faults.py,
  `FaultPlan.model_cfg`). Entering that block at the fault step both runs hold the same bits
  (the state and the blocks before it are untouched), and the block's first computation is its
  q projection (`model.block_capture_names(...)[0]`), a Dense whose output dtype the fault makes
  bfloat16. So the first intermediate that differs is `block_NN.attn.q`, float32 in A and
  bfloat16 in B, with (almost) every element rounded away from A's.
* REPORT.md generated now (`replay pack --from-bisect`), not the checked-in fixture: the same
  sections and table rows as tests/replay/fixtures/REPORT.md (so the fixture shows what today's
  code writes), and every number it states is the trace's: metrics, loss range, the divergent
  step, cause and layer, the RMS of the first differing field in both runs, the refined first
  intermediate, the checkpoint and examples carried.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.replay.test_bisect import assert_refinement_is_consistent
from tests.replay.test_pack import REPORT_FIXTURE, check_report, invoke, read_report
from traces import Run
from trainer import faults, model
from trainer.config import apply_overrides
from trainer.presets import get_preset

STEPS, EVERY, FAULT = 12, 6, 9  # checkpoints 0, 6, 12; the fault from step 9
PACKED = (EVERY, STEPS - 1)  # the steps packed: from checkpoint 6 to the end
# One block (the faulty one, block_00, entered from the untouched embedding): no claim here needs a
# second, and each of the module's programs (both runs' steps, both refinements' captures) compiles
# about a third faster; tests/replay/test_noise.py trains the same one-block tiny on one device.
ONE_BLOCK = ["model.n_layers=1"]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(cfg, A: a clean tiny run, B: the same with layer-bf16 from step FAULT), 1 device each."""
    from trainer.loop import train

    root = tmp_path_factory.mktemp("claims")
    cfg = apply_overrides(get_preset("tiny"), [*ONE_BLOCK, f"steps={STEPS}", f"checkpoint.every_steps={EVERY}"])
    train(cfg, root / "A", preset="tiny")
    train(cfg, root / "B", preset="tiny", faults=faults.FaultPlan([faults.Fault("layer-bf16", FAULT)], cfg))
    return cfg, root / "A", root / "B"


def faulty_block(cfg) -> str:
    """The block layer-bf16 computes in bfloat16, as the fault defines it."""
    faulty = faults.FaultPlan([faults.Fault("layer-bf16", FAULT)], cfg).model_cfg(FAULT)
    return model.block_names(cfg.model)[faulty.model.bf16_block]


@pytest.fixture(scope="module")
def bisected(runs):
    _, a, b = runs
    as_json = invoke("bisect", a, b, "--json")
    as_text = invoke("bisect", a, b)
    return as_json, as_text


def test_layer_bf16_first_intermediate_is_the_faulty_blocks_q_projection(runs, bisected):
    cfg, _, _ = runs
    as_json, as_text = bisected
    block = faulty_block(cfg)
    expected = model.block_capture_names(cfg.model, block)[0]  # the block's first computation
    assert expected == f"{block}.attn.q"
    assert as_json.exit_code == 1, as_json.output
    report = json.loads(as_json.stdout)
    assert (report["first_step"], report["cause"], report["layer"]) == (FAULT, "forward", f"{block}.attn")
    r = report["refinement"]
    assert r["step"] == FAULT and r["first_intermediate"] == expected
    assert r["compared"][0]["name"] == expected and not r["compared"][0]["equal"]
    assert (r["dtype_a"], r["dtype_b"]) == ("float32", "bfloat16")
    # bfloat16 keeps 8 of float32's 24 significand bits: only values already that short survive.
    assert r["share_differing"] > 0.99 and r["distances"]["max_ulp"] > 0
    assert r["reproduces_trace"] == {"A": True, "B": True}
    assert as_text.exit_code == 1
    assert re.search(rf"first intermediate that differs\s*│?\s*{re.escape(expected)}\b", as_text.output), as_text.output


def test_layer_bf16_refinement_compares_the_layers_intermediates_in_order(runs, bisected):
    """The refinement's own bookkeeping (was tests/replay/test_bisect.py's layer-bf16 test, which
    trained this same scenario again): every capture of the layer compared in causal order, all
    equal before the first intermediate, the faulty program replayed for B from checkpoint EVERY."""
    cfg, _, _ = runs
    as_json, as_text = bisected
    block = faulty_block(cfg)
    report = json.loads(as_json.stdout)
    for key in ("identical", "first_step", "cause", "layer", "examples", "replays"):
        assert key in report
    assert report["identical"] is False
    r = report["refinement"]
    assert r["layer"] == f"{block}.attn" and r["found_by"] == "trace"
    inside = model.block_capture_names(cfg.model, block)
    assert r["first_intermediate"] in inside and [row["name"] for row in r["compared"]] == inside
    assert_refinement_is_consistent(r)
    assert r["programs"]["B"] != r["programs"]["A"]  # B's step ran the faulty (bf16) program
    assert report["replays"] == 1 and report["replayed_steps"] == 2 * (FAULT - EVERY)  # both from checkpoint EVERY
    assert "inside the layer" in as_text.output and r["first_intermediate"] in as_text.output


def test_no_refine_is_the_trace_scan_alone(runs):
    from replay.bisect import bisect

    cfg, a, b = runs
    report = bisect(Run.open(a), Run.open(b), refine=False)
    assert (report.first_step, report.cause, report.layer) == (FAULT, "forward", f"{faulty_block(cfg)}.attn")
    assert report.refinement is None and report.replays == 0 and report.replayed_steps == 0


@pytest.fixture(scope="module")
def report(runs, tmp_path_factory):
    cfg, a, b = runs
    tmp = tmp_path_factory.mktemp("claims-report")
    out = tmp / "A.rpk"
    packed = invoke("pack", a, "--steps", f"{PACKED[0]}:{PACKED[1]}", "--from-bisect", b, "-o", out)
    assert packed.exit_code == 0, packed.stderr
    text, unpacked = read_report(out, tmp)
    return cfg, Run.open(a), Run.open(b), text, unpacked


def _headings(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("## ")]


def _table_keys(text: str, section: str) -> list[str]:
    body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    return [line.split("|")[1].strip() for line in body.splitlines() if line.startswith("| ") and not
            line.startswith("| |") and not line.startswith("| ---")]


def test_report_written_now_has_the_fixtures_structure(report):
    *_, text, _ = report
    fixture = REPORT_FIXTURE.read_text()
    assert _headings(text) == _headings(fixture)
    for section in ("The run", "Environment"):
        assert _table_keys(text, section) == _table_keys(fixture, section), section


def test_report_written_now_states_the_traces_numbers(report):
    cfg, a, b, text, unpacked = report
    first, last = PACKED
    records = {s: a.trace.read(s) for s in range(first, last + 1)}
    check_report(text, records, a.schema, first, last, "A.rpk", lite=False)  # sections, metrics table, replay line
    info = unpacked.manifest["bundle"]
    assert info["steps"] == [first, last] and info["checkpoint"] == EVERY
    loss = [records[s].metrics[a.schema.metric_index("loss")] for s in range(first, last + 1)]
    assert f"(min {min(loss)!s}, max {max(loss)!s})." in text
    assert (f"- Run: `{a.path.absolute()}`, preset `tiny`, {model.param_count(cfg.model):,} parameters; "
            f"{STEPS} steps configured, steps 0..{STEPS - 1} recorded (complete).") in text
    m, env = a.manifest, a.manifest["environment"]
    for row in (f"| seed | {cfg.seed} |", "| trace level | layer (layer fingerprints every step) |",
                "| faults injected | none |", f"| program hash | {m['program_hash'][:16]} |",
                f"| backend | {env['backend']} |", f"| devices | 1 x {env['device_kind']}, 1 process |",
                f"| jax | {env['versions']['jax']} |", f"| parameters | {model.param_count(cfg.model):,} |"):
        assert row in text, row
    n_examples = info["example_count"]
    assert 0 < n_examples <= (last - EVERY + 1) * cfg.data.global_batch_size
    assert f"the token rows of the {n_examples} examples that the batches of steps {EVERY}..{last}" in text
    assert f"- Checkpoint: step {EVERY}, the newest at or before step {first}." in text


def test_report_written_now_states_the_finding_of_bisect(report):
    cfg, a, b, text, _ = report
    block = faulty_block(cfg)
    layer = f"{block}.attn"
    assert f"- Finding: first divergence at step {FAULT}: forward in {layer}." in text
    finding = text.split("\n## Finding\n", 1)[1].split("\n## ", 1)[0]
    assert f"| faults | [] | ['layer-bf16@{FAULT}'] |" in finding
    for row in (f"| first divergent step | {FAULT} |", "| cause (first field in causal order) | forward |",
                f"| layer | {layer} |"):
        assert row in finding, row
    # The first differing field's row holds both traces' RMS of that tensor at the step.
    i = a.schema.tensor_names.index(layer)
    rms_a, rms_b = a.trace.read(FAULT).rms[i], b.trace.read(FAULT).rms[i]
    assert rms_a != rms_b
    table = [line for line in finding.splitlines() if line.startswith("| forward |")]
    assert table[0].startswith(f"| forward | {layer} | {rms_a!s} | {rms_b!s} | abs ")
    assert f"first_intermediate {block}.attn.q," in finding and f"step {FAULT}," in finding
