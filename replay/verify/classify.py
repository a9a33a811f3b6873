"""Which device computed wrongly, from several executions of the same microbatches (numpy only).

For one step, every microbatch gradient has been computed by up to four devices: the one that
computed it in training (its fingerprint is in the trace when the run records per-replica
fingerprints) and the ones that re-computed it in `replay verify`, each execution with the work
rotated by another amount. In mesh-invariant mode all of them must agree bit for bit, so:

    vote        per microbatch, the value most distinct devices computed is the right one
                (`majority`); a device whose value differs computed wrongly: an SDC event
    persistent  a device that computes wrongly again in the re-executions (it is still bad: the
                chip is named); also one that computed wrongly in training at two or more steps
    transient   a device that computed wrongly in training only, once: the re-executions all agree
    genuine     in training, the work of two or more devices differs from what every re-execution
                reproduces: not one chip, a software or data cause: hand it to `replay bisect`
    trace       the step re-run as recorded differs from the trace while the re-executions agree
                with each other and nothing above explains it: the trace, not a device now, is the
                odd one out (a transient in training that no per-replica fingerprint names, or a
                changed environment); `trace_findings`

Costs nothing beyond the step's fingerprints: M x G 64-bit values per execution, held per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Event:
    """One execution of one microbatch that disagreed with the majority."""

    step: int
    microbatch: int
    device: int
    in_training: bool  # False: in a re-execution by `replay verify`
    layers: list[int]  # indices of the layers whose fingerprints differ from the majority's


@dataclass
class Finding:
    kind: str  # "persistent" | "transient" | "genuine"
    device: int | None  # None for genuine
    steps: list[int]
    microbatches: list[int] = field(default_factory=list)  # of the first step
    layers: list[str] = field(default_factory=list)  # layers that differ at the first step
    why: str = ""
    fields: list[str] = field(default_factory=list)  # trace: the recorded fields the re-run differs in

    @property
    def step(self) -> int:
        return self.steps[0]

    def to_json(self) -> dict:
        return {"class": self.kind, "device": self.device, "step": self.step, "steps": self.steps,
                "microbatches": self.microbatches, "layers": self.layers, "fields": self.fields, "why": self.why}


def owner(mb: int, n_devices: int, n_microbatches: int) -> int:
    """As trainer/sdc.py: the device computing microbatch `mb` unrotated (strided on powers of two)."""
    strided = n_devices > 1 and n_devices & (n_devices - 1) == 0
    return mb % n_devices if strided else mb // (n_microbatches // n_devices)


def executor(mb: int, n_devices: int, n_microbatches: int, rotate: int) -> int:
    return (owner(mb, n_devices, n_microbatches) - rotate) % n_devices


def majority(values: list[tuple[int, np.ndarray]]) -> np.ndarray | None:
    """The value (uint64[G]) computed by the most distinct devices, or None on a tie of the top two."""
    counts: dict[bytes, tuple[set[int], np.ndarray]] = {}
    for device, value in values:
        devices, _ = counts.setdefault(value.tobytes(), (set(), value))
        devices.add(device)
    ranked = sorted(counts.values(), key=lambda dv: -len(dv[0]))
    if len(ranked) > 1 and len(ranked[0][0]) == len(ranked[1][0]):
        return None
    return ranked[0][1]


def step_events(step: int, trace_MxG: np.ndarray | None, runs: dict[int, np.ndarray], n_devices: int) -> tuple[list[Event], list[int]]:
    """(events, unresolved microbatches) of one step. `runs`: rotation -> uint64[M, G] re-executed."""
    any_run = next(iter(runs.values()))
    m = any_run.shape[0]
    events, unresolved = [], []
    for i in range(m):
        values = [(executor(i, n_devices, m, k), run[i]) for k, run in runs.items()]
        if trace_MxG is not None:
            values.append((owner(i, n_devices, m), trace_MxG[i]))
        if all(np.array_equal(v, values[0][1]) for _, v in values):
            continue
        right = majority(values)
        if right is None:
            unresolved.append(i)
            continue
        for j, (device, value) in enumerate(values):
            if not np.array_equal(value, right):
                events.append(Event(step, i, device, trace_MxG is not None and j == len(values) - 1,
                                    [int(g) for g in np.flatnonzero(value != right)]))
    return events, unresolved


def classify(events: list[Event], layer_names: list[str]) -> list[Finding]:
    """Findings from every step's events, in step order (persistent first per device)."""
    findings: list[Finding] = []
    again = sorted({e.device for e in events if not e.in_training})
    training: dict[int, list[Event]] = {}
    for e in events:
        if e.in_training:
            training.setdefault(e.step, []).append(e)
    chip_steps = {d: sorted({e.step for e in events if e.device == d}) for d in again}
    trained_bad: dict[int, set[int]] = {}
    for step, evs in training.items():
        for e in evs:
            trained_bad.setdefault(e.device, set()).add(step)
    for d, steps in trained_bad.items():  # wrong in training at several steps, never re-run wrongly
        if d not in chip_steps and len(steps) > 1 and all(len({e.device for e in training[s]}) == 1 for s in steps):
            chip_steps[d] = sorted(steps)
    for d, steps in sorted(chip_steps.items()):
        first = [e for e in events if e.device == d and e.step == steps[0]]
        findings.append(Finding("persistent", d, steps, sorted({e.microbatch for e in first}),
                                _names(first, layer_names),
                                f"device {d} computed wrongly at {len(steps)} step(s), "
                                + ("also when re-run" if d in again else "in training")))
    for step in sorted(training):
        evs = [e for e in training[step] if e.device not in chip_steps]  # a bad chip's work is its finding
        devices = sorted({e.device for e in evs})
        if not devices:
            continue
        if len(devices) > 1:
            findings.append(Finding("genuine", None, [step], sorted({e.microbatch for e in evs}), _names(evs, layer_names),
                                    f"the work of {len(devices)} devices differs from what every re-execution "
                                    "reproduces: not one chip; a software or data cause (replay bisect)"))
        else:
            findings.append(Finding("transient", devices[0], [step], sorted({e.microbatch for e in evs}),
                                    _names(evs, layer_names),
                                    f"device {devices[0]} computed wrongly once in training; every re-execution agrees"))
    findings.sort(key=lambda f: (f.step, f.kind))
    return findings


def _names(events: list[Event], layer_names: list[str]) -> list[str]:
    return [layer_names[g] for g in sorted({g for e in events for g in e.layers})]


def trace_findings(differing: dict[int, list[str]], events: list[Event], findings: list[Finding],
                   unresolved: list[tuple[int, int]], environment: str | None = None) -> list[Finding]:
    """Findings for the steps whose re-run as recorded differs from the trace (`differing`: step ->
    the recorded fields that differ, in causal order) where nothing else explains it: no device
    computed wrongly in training at that step, no microbatch is unresolved, no device found bad now
    computed it. Consecutive steps make one finding (a later step's state follows from the first's).
    `environment`: the contract's line when it does not promise bits here, None when it does."""
    explained = {e.step for e in events if e.in_training} | {s for s, _ in unresolved}
    explained |= {s for f in findings if f.kind == "persistent" for s in f.steps}
    steps = sorted(s for s in differing if s not in explained)
    runs: list[list[int]] = []
    for s in steps:
        if runs and runs[-1][-1] == s - 1:
            runs[-1].append(s)
        else:
            runs.append([s])
    out = []
    for run in runs:
        first, fields = run[0], differing[run[0]]
        cause = (f"the environment differs from the recording ({environment})" if environment else
                 "a transient fault during training (record per-replica fingerprints, check.replicas=true, to "
                 "name its device), or a changed environment (see the contract line)")
        more = f"; steps {run[1]}..{run[-1]} differ too (their state follows from step {first})" if len(run) > 1 else ""
        shown = ", ".join(fields[:6]) + (f" and {len(fields) - 6} more" if len(fields) > 6 else "")
        out.append(Finding("trace", None, run, [], [], (
            f"no re-execution reproduces the recorded step {first}: re-run as recorded it differs in {shown}, and "
            f"the re-executions on rotated devices agree with each other: the trace, not a device now, is the odd "
            f"one out: {cause}{more}"), list(fields)))
    return out

