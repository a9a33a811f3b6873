"""replay/verify/checks.py: reading the in-training re-run check back from a record (numpy only)."""

from __future__ import annotations

import numpy as np

from replay.verify.checks import describe
from traces import Schema
from traces.schema import StepRecord
from trainer.sdc import mask_microbatches

MANIFEST = {"config": {"mesh": {"n_microbatches": 8}, "check": {"rotate": 1}}, "mesh": {"devices": 8}}
SCHEMA = Schema(examples_per_step=0, rng_words=0, metrics=(), tensors=(("grad/x", "backward"), ("check/rerun", "backward")))


def record(mask: int, checked: bool = True) -> StepRecord:
    return StepRecord(10, np.zeros(0, np.uint32), 0, np.zeros(0, np.uint64), np.zeros(0, np.float32),
                      fingerprints=np.asarray([123, mask], np.uint64),
                      rms=np.asarray([0.5, 1.0 if checked else 0.0], np.float32))


def test_a_chip_disagrees_twice_and_is_named():
    # Device 3 computes microbatch 3 in the step and microbatch 4 in the re-run (rotate 1, strided).
    d = describe(MANIFEST, SCHEMA, record(1 << 3 | 1 << 4))
    assert d["checked"] and d["microbatches"] == [3, 4] and d["bad_devices"] == [3]
    assert "device(s) 3 computed wrongly" in d["line"]


def test_one_disagreement_names_two_candidates_not_a_chip():
    d = describe(MANIFEST, SCHEMA, record(1 << 5))
    assert d["bad_devices"] == [] and "5 or 4" in d["line"]


def test_an_agreeing_and_an_unchecked_step():
    assert describe(MANIFEST, SCHEMA, record(0))["line"].endswith("every microbatch agreed")
    assert describe(MANIFEST, SCHEMA, record(0, checked=False))["line"] == "not re-run"


def test_a_run_without_the_check_has_nothing_to_describe():
    schema = Schema(examples_per_step=0, rng_words=0, metrics=(), tensors=(("grad/x", "backward"),))
    rec = StepRecord(1, np.zeros(0, np.uint32), 0, np.zeros(0, np.uint64), np.zeros(0, np.float32),
                     fingerprints=np.asarray([1], np.uint64), rms=np.asarray([1.0], np.float32))
    assert describe(MANIFEST, schema, rec) is None


def test_mask_bits_are_microbatches_across_words():
    assert mask_microbatches([1 << 63 | 1, 1 << 2]) == [0, 63, 66]


def test_a_user_loops_config_without_the_trainers_sections_is_read_as_one_device():
    """A loop recorded with replay.init keeps its own config: "mesh" or "check" may be anything, or
    absent (a tensor it named "check/rerun" makes the run look checked). Was AttributeError (exit 3)."""
    for manifest in ({"config": {"mesh": "data", "check": 3}, "mesh": [1, 2]}, {"config": None}, {}):
        d = describe(manifest, SCHEMA, record(1 << 0))
        assert d["microbatches"] == [0] and d["pairs"] == [{"microbatch": 0, "step_device": 0, "rerun_device": 0}]
