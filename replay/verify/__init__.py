"""`replay verify`: re-run recorded steps with the work on other devices and name a bad chip.

In mesh-invariant mode each microbatch gradient has the same bits whichever device computes it
(trainer/microbatches.py), so one device's work can be checked against another's. For each step
A..B this restores the state entering it (the newest checkpoint at or before A, then the run's own
steps replayed, faults included, as `replay run` does), and computes every microbatch's per-layer
gradient fingerprints three times, with the work rotated by 0, K and 2K devices along the data
axis: the run's replayable's `replica_fingerprints` capability (replay/engine/protocol.py; the trainer's
runs it through trainer/sdc.py `replica_lanes`: no reduction, no update). With the trace's own per-replica
fingerprints (check.replicas=true) that is four values from three distinct devices per microbatch;
replay/verify/classify.py votes and names the device that computed wrongly and the class.

Every verified step is also re-run as recorded (same devices, same placement) and its record
compared with the trace's, field by field as `replay run` compares (traces.diff_records): metric
bits, per-example hashes, RNG words, and the layer fingerprints where the trace has them. A step
whose re-run differs from the trace while the rotated re-executions agree with each other, and
that no device explains, is a finding of class "trace": the trace, not a device now, is the odd
one out (a transient fault in training, which without per-replica fingerprints cannot be pinned
to a device, or a changed environment per the contract), never "clean".

Cost: per verified step three forward+backward passes besides the replayed step; the re-run as
recorded is that replayed step itself (the one that carries the state to the next step), so
comparing it costs a fetch of its metrics and fingerprints to the host (one sync a step, a few
hundred bytes; nothing accumulates), not another step. Only where the run's loop simulates a
fault that would not recur (the trainer's sdc@S) does the loop's `rerun_step` run step S once
more without it. Memory: one step's fingerprints (M x layers x 3), one record, and the findings;
the replay from the checkpoint to A as `replay run`. A million-step run costs what its range A..B
costs, nothing more: verifying all of it is a million replayed steps, three million
forward+backward passes, and a million host syncs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from replay.engine.engine import ReplayInputError
from replay.verify.classify import Finding, classify, step_events, trace_findings
from replay.verify.names import replica_name

CAPABILITY = "replica_fingerprints"  # what verify asks of a run's replayable (replay/engine/protocol.py)


class VerifyInputError(ReplayInputError):
    """A run or range `replay verify` cannot check; one line, exit 2."""


@dataclass
class VerifyReport:
    run: str
    first: int
    last: int
    rotate: int
    devices: int
    microbatches: int
    checkpoint: int
    trace_replicas: bool  # the trace holds per-replica fingerprints (training's own values compared)
    findings: list[Finding] = field(default_factory=list)
    unresolved: list[tuple[int, int]] = field(default_factory=list)  # (step, microbatch) with no majority
    steps_verified: int = 0
    trace_differs: list[int] = field(default_factory=list)  # steps whose re-run as recorded differs from the trace
    notes: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.findings and not self.unresolved

    def to_json(self) -> dict:
        return {"run": self.run, "steps": [self.first, self.last], "rotate": self.rotate, "devices": self.devices,
                "microbatches": self.microbatches, "checkpoint": self.checkpoint,
                "trace_replicas": self.trace_replicas, "steps_verified": self.steps_verified,
                "trace_differs": self.trace_differs,
                "clean": self.clean, "findings": [f.to_json() for f in self.findings],
                "unresolved": [{"step": s, "microbatch": i} for s, i in self.unresolved], "notes": self.notes}


def trace_replicas(schema, record, m: int, layers: list[str]) -> np.ndarray | None:
    """uint64[M, G] of the record's "replica/mbNN/LAYER" fingerprints, None when not recorded."""
    names = schema.tensor_names
    if record.fingerprints is None or replica_name(0, layers[0], m) not in names:
        return None
    index = {n: i for i, n in enumerate(names)}
    return np.asarray([[record.fingerprints[index[replica_name(i, g, m)]] for g in layers] for i in range(m)], np.uint64)


def refusal(run) -> str | None:
    """Why `replay verify` cannot check `run`, from its manifest alone (None: it can), so the
    command refuses before anything compiles or prints. Verify re-computes each microbatch's
    gradients on other devices through the trainer's mesh-invariant step (trainer/sdc.py); a loop
    recorded with replay.init (or the legacy protocol, or replay.torch) has no such step yet."""
    from replay.engine.damage import shown_path
    from replay.engine.contract import config_of
    from replay.engine.protocol import LEGACY_DEFAULT_FACTORY

    manifest, shown = run.manifest, shown_path(run)
    factory = manifest.get("replayable", LEGACY_DEFAULT_FACTORY)
    if factory != LEGACY_DEFAULT_FACTORY or manifest.get("recorded_by") == "replay.torch":
        from replay.record.manifest import FACTORY

        who = ("recorded with replay.init" if factory == FACTORY else "recorded by replay.torch"
               if manifest.get("recorded_by") == "replay.torch" else f"recorded by their own loop ({str(factory)[:80]})")
        return (f"{shown}: replay verify needs the trainer's mesh-invariant mode (each microbatch's gradient "
                f"re-computed on other devices, bit for bit); it is not yet available for runs {who}: "
                "replay the steps with `replay run`, or compare two runs with `replay bisect`")
    mesh = config_of(manifest).get("mesh")
    if not (isinstance(mesh, dict) and mesh.get("mesh_invariant") is True):
        return (f"{shown} is not a mesh-invariant run: only then is one device's work comparable bit for bit "
                "with another's; train with --set mesh.mesh_invariant=true")
    return None


def too_few_devices(devices: int) -> str | None:
    if devices < 3:
        return (f"verify needs at least 3 devices to out-vote a bad one; this process has {devices} "
                "(XLA_FLAGS=--xla_force_host_platform_device_count=8 on a CPU)")
    return None


def recorded_differences(run, replayable, step: int, metrics, hashes) -> list[str]:
    """The fields of the trace's record of `step` that the re-run's (metrics, hashes) differ in,
    in causal order, compared as `replay run` compares (replay/engine/engine.py)."""
    import jax

    from replay.record.recorder import to_record
    from traces import diff_records

    again = to_record(replayable.schema, step, jax.device_get(metrics), hashes)
    return [d.name for d in diff_records(run.schema, run.trace.read(step), replayable.schema, again)]


def verify(run, replayable, first: int, last: int, rotate: int = 1,
           on_step: Callable[[int], None] | None = None, environment: str | None = None) -> VerifyReport:
    """Verify steps first..last of `run`, re-executed through `replayable`'s capabilities
    replica_layout, layer_groups and replica_fingerprints (replay/engine/protocol.py), each step's re-run
    as recorded compared with the trace (its `rerun_step` where it has one). `environment`: the
    contract's line when it does not promise bits here (the trace's differences are then named as
    the environment's), None when it does."""
    from replay.engine.damage import shown_path
    from replay.engine.engine import check_range

    why = refusal(run)
    fingerprints = getattr(replayable, CAPABILITY, None)
    if why is None and fingerprints is None:
        why = (f"{shown_path(run)}: replay verify needs the run's loop to provide {CAPABILITY}(state, step, rotate) "
               "-> uint64[microbatches, layers] (each microbatch's gradient fingerprints with the work rotated by "
               "`rotate` devices), with replica_layout() and layer_groups(); the replayable this run loaded has none")
    layout = replayable.replica_layout() if why is None else None
    if why is None and layout is None:  # the manifest said mesh-invariant, the step as replayed is not
        why = f"{shown_path(run)} is not a mesh-invariant run as replayed; train with --set mesh.mesh_invariant=true"
    if why is None:
        why = too_few_devices(layout[0])
    if why:
        raise VerifyInputError(why)
    n, m = layout
    rotations = sorted({0, rotate % n, (2 * rotate) % n})
    if len(rotations) < 3:
        raise VerifyInputError(f"--rotate {rotate}: rotations 0, {rotate} and {2 * rotate} must put the work on three "
                               f"different devices of {n}; pick a rotation that is not a multiple of {n // 2 or 1}")
    start = check_range(run, first, last, replayable.checkpoint_steps())
    layers = list(replayable.layer_groups())
    report = VerifyReport(shown_path(run), first, last, rotate, n, m, start, False)

    rerun = getattr(replayable, "rerun_step", None)
    events, differing, state = [], {}, replayable.restore(start)
    for step in range(start, last + 1):
        again = None
        if step >= first:
            runs = {k: np.asarray(fingerprints(state, step, k), np.uint64) for k in rotations}
            trace = trace_replicas(run.schema, run.trace.read(step), m, layers)
            report.trace_replicas = report.trace_replicas or trace is not None
            step_ev, unresolved = step_events(step, trace, runs, n)
            events += step_ev
            report.unresolved += [(step, i) for i in unresolved]
            report.steps_verified += 1
            again = rerun(state, step) if rerun is not None else None  # before the step consumes `state`
        state, metrics, hashes = replayable.step(state, step)
        if step >= first:
            fields = recorded_differences(run, replayable, step, *(again or (metrics, hashes)))
            if fields:
                differing[step] = fields
        if on_step is not None and step >= first:
            on_step(step)
    report.trace_differs = sorted(differing)
    report.findings = classify(events, layers)
    report.findings += trace_findings(differing, events, report.findings, report.unresolved, environment)
    report.findings.sort(key=lambda f: (f.step, f.kind))
    if not report.trace_replicas:
        report.notes.append("the trace holds no per-replica fingerprints (train with --set check.replicas=true): a "
                            "transient fault in training is found as a recorded step no re-execution reproduces, "
                            "without the device it hit")
    return report
