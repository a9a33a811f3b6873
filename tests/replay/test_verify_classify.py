"""replay/verify/classify.py on synthetic fingerprints (numpy only, no JAX devices): which device
computed wrongly, and the class. The end-to-end runs are tests/replay/test_verify_e2e.py."""

from __future__ import annotations

import numpy as np
import pytest

from replay.verify.classify import classify, executor, owner, step_events, trace_findings
from trainer.faults import FaultError, SdcFault, parse

N, M, G = 8, 8, 4
ROT = (0, 3, 6)
LAYERS = ["embed", "block_00", "block_01", "lm_head"]


def right(step: int) -> np.ndarray:
    return np.random.default_rng(step).integers(0, 2**63, size=(M, G), dtype=np.uint64)


def executions(step: int, bad: dict[int, int] | None = None, trace_bad: dict[int, int] | None = None,
               rotations=ROT) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    """(trace, runs) of one step; `bad`: device -> layer it corrupts whenever it computes (a chip);
    `trace_bad`: device -> layer it corrupted in training only (a transient)."""
    bad, trace_bad = bad or {}, trace_bad or {}
    ok = right(step)
    runs = {}
    for k in rotations:
        run = ok.copy()
        for i in range(M):
            d = executor(i, N, M, k)
            if d in bad:
                run[i, bad[d]] ^= np.uint64(1 << (d + 1))
        runs[k] = run
    trace = runs[0].copy()
    for i in range(M):
        if owner(i, N, M) in trace_bad:
            trace[i, trace_bad[owner(i, N, M)]] ^= np.uint64(1 << 40)
    return trace, runs


def findings_of(steps: dict[int, tuple[np.ndarray | None, dict]]) -> list:
    events = []
    for step, (trace, runs) in steps.items():
        ev, unresolved = step_events(step, trace, runs, N)
        assert not unresolved
        events += ev
    return classify(events, LAYERS)


def test_clean_steps_have_no_findings():
    assert findings_of({s: executions(s) for s in range(20)}) == []


def test_a_transient_is_named_with_its_step_device_and_layer():
    steps = {s: executions(s, trace_bad={5: 2} if s == 7 else None) for s in range(10)}
    (f,) = findings_of(steps)
    assert (f.kind, f.device, f.step, f.layers) == ("transient", 5, 7, ["block_01"])


def test_a_bad_chip_is_persistent_and_named_from_the_first_step_it_is_bad():
    steps = {s: executions(s, bad={2: 1} if s >= 4 else None) for s in range(9)}
    (f,) = findings_of(steps)
    assert (f.kind, f.device, f.step, f.steps) == ("persistent", 2, 4, [4, 5, 6, 7, 8])


def test_a_bad_chip_is_found_without_the_traces_replicas():
    steps = {s: (None, executions(s, bad={6: 0} if s >= 2 else None)[1]) for s in range(4)}
    (f,) = findings_of(steps)
    assert (f.kind, f.device, f.step) == ("persistent", 6, 2)


def test_a_difference_in_every_replica_is_genuine_not_hardware():
    ok_trace, runs = executions(3)
    steps = {3: (ok_trace ^ np.uint64(1), runs)}
    (f,) = findings_of(steps)
    assert (f.kind, f.device, f.step) == ("genuine", None, 3)


def test_twenty_corruptions_at_once_are_each_found():
    # 16 transients (two steps per device) and 4 chips, the chips 4 devices apart (rotations 0, 3, 6).
    want, steps = set(), {}
    chips = {0: 1, 4: 3}
    for s in range(16):
        t = [d for d in range(N) if d not in chips][s % 6]
        steps[s] = executions(s, bad=chips if s >= 10 else None, trace_bad={t: s % G})
        want.add(("transient", t, s))
    got = findings_of(steps)
    found = {(f.kind, f.device, f.step) for f in got}
    assert want <= found
    assert {("persistent", 0, 10), ("persistent", 4, 10)} <= found
    assert len(got) == len(want) + 2


def test_a_trace_no_re_execution_reproduces_is_a_finding_unless_a_device_explains_it():
    # Steps 3, 4 and 9 re-ran to other bits than the trace; at 4 and 9 nothing explains it, at 3 the
    # trace's replicas name device 5 (a transient). 4 and 5 are one finding (5 follows from 4).
    steps = {s: executions(s, trace_bad={5: 1} if s == 3 else None) for s in range(10)}
    events = [e for s, (trace, runs) in steps.items() for e in step_events(s, trace, runs, N)[0]]
    found = classify(events, LAYERS)
    differing = {3: ["grad_norm"], 4: ["loss", "grad_norm"], 5: ["loss"], 9: ["param/x"]}
    got = trace_findings(differing, events, found, [])
    assert [(f.kind, f.device, f.steps, f.fields) for f in got] == [
        ("trace", None, [4, 5], ["loss", "grad_norm"]), ("trace", None, [9], ["param/x"])]
    assert "the trace, not a device now, is the odd one out" in got[0].why and "loss, grad_norm" in got[0].why
    assert "environment differs" in trace_findings({9: ["loss"]}, [], [], [], "measured only: x differ")[0].why
    assert trace_findings({}, events, found, []) == []


def test_two_executions_on_one_device_do_not_outvote_a_third():
    # The bad chip computes microbatch 2 both in training and unrotated: two equal wrong values from
    # one device; the two other devices agree with each other and win.
    trace, runs = executions(1, bad={2: 0})
    ev, unresolved = step_events(1, trace, runs, N)
    assert not unresolved and {e.device for e in ev} == {2}


@pytest.mark.parametrize("spec", ["sdc@3:device=5", "sdc@7:device=0,tensor=embed.embedding,elem=4,bit=30",
                                  "sdc-chip@2:device=3,p=0.25,bit=1", "sdc-chip@1:device=1"])
def test_sdc_specs_round_trip_through_the_manifest(spec):
    fault = parse(spec)
    assert isinstance(fault, SdcFault) and parse(str(fault)) == fault


def test_a_chip_without_a_step_starts_at_step_1():
    assert parse("sdc-chip:device=3") == parse("sdc-chip@1:device=3")


@pytest.mark.parametrize("spec", ["sdc:device=1", "sdc@2", "sdc@2:device=1,p=0.5", "sdc@2:device=1,bit=32",
                                  "sdc-chip:device=1,p=0", "sdc@0:device=1", "sdc@2:device=x", "sdc@2:core=1"])
def test_malformed_sdc_specs_are_one_line_errors(spec):
    with pytest.raises(FaultError) as e:
        parse(spec)
    assert "\n" not in str(e.value) and spec in str(e.value)
