"""`replay verify`: re-run recorded steps with the work on other devices and name a bad chip.

Two methods, chosen by what the run's loop provides (replay/engine/protocol.py):

    shards    any loop (`rotated_step`: replay.Loop runs, the trainer's runs that are not
              mesh-invariant): each step re-run three times with every array moved 0, K and 2K
              devices further, the program unchanged, and compared shard by shard
              (replay/verify/rotation.py, which says what it can and cannot see)
    replicas  the trainer's mesh-invariant mode (`replica_fingerprints`), stronger: below

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

Cost: per verified step three forward+backward passes (shards: three whole steps, their output
shards hashed on the host) besides the replayed step; the re-run as
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

from replay.engine.engine import ReplayInputError, check_range
from replay.verify.classify import Finding, classify, step_events, trace_findings
from replay.verify.names import replica_name
from replay.engine.damage import shown_path
from traces import diff_records

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
    mode: str = "replicas"  # "replicas": microbatch gradients re-computed apart; "shards": rotated re-runs
    shards: int = 0  # shards mode: output shards compared a step ("LEAF[index]", shard_names)
    shard_names: list[str] = field(default_factory=list)
    devices_used: int = 0  # shards mode: distinct devices that computed some shard

    @property
    def clean(self) -> bool:
        return not self.findings and not self.unresolved

    def to_json(self) -> dict:
        unit = "microbatch" if self.mode == "replicas" else "shard"
        return {"run": self.run, "mode": self.mode, "steps": [self.first, self.last], "rotate": self.rotate,
                "devices": self.devices, "microbatches": self.microbatches, "shards": self.shards,
                "devices_used": self.devices_used, "checkpoint": self.checkpoint,
                "trace_replicas": self.trace_replicas, "steps_verified": self.steps_verified,
                "trace_differs": self.trace_differs,
                "clean": self.clean, "findings": [f.to_json() for f in self.findings],
                "unresolved": [{"step": s, unit: i if self.mode == "replicas" else self.shard_names[i]}
                               for s, i in self.unresolved], "notes": self.notes}


def trace_replicas(schema, record, m: int, layers: list[str]) -> np.ndarray | None:
    """uint64[M, G] of the record's "replica/mbNN/LAYER" fingerprints, None when not recorded."""
    names = schema.tensor_names
    if record.fingerprints is None or replica_name(0, layers[0], m) not in names:
        return None
    index = {n: i for i, n in enumerate(names)}
    return np.asarray([[record.fingerprints[index[replica_name(i, g, m)]] for g in layers] for i in range(m)], np.uint64)


def refusal(run) -> str | None:
    """Why `replay verify` cannot check `run`, from its manifest alone (None: it can), so the
    command refuses before anything compiles or prints. A run of a PyTorch loop (replay.torch) has
    no JAX program to re-run; every other run is re-run through its replayable, whose capabilities
    decide the method (`verify`)."""
    if run.manifest.get("recorded_by") == "replay.torch":
        return (f"{shown_path(run)}: recorded by a PyTorch loop (replay.torch), which has no JAX program to re-run "
                "on other devices; compare it with `replay bisect`")
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

    again = to_record(replayable.schema, step, jax.device_get(metrics), hashes)
    return [d.name for d in diff_records(run.schema, run.trace.read(step), replayable.schema, again)]


def verify(run, replayable, first: int, last: int, rotate: int = 1,
           on_step: Callable[[int], None] | None = None, environment: str | None = None) -> VerifyReport:
    """Verify steps first..last of `run` through `replayable` (replay/engine/protocol.py): by its
    replicas where it computes them apart (replica_layout, layer_groups, replica_fingerprints: the
    trainer's mesh-invariant mode), else by re-running each step on rotated devices and comparing
    shard by shard (rotated_step: replay/verify/rotation.py); each step's re-run as recorded is
    compared with the trace (its `rerun_step` where it has one). `environment`: the contract's line
    when it does not promise bits here (the trace's differences are then named as the
    environment's), None when it does."""
    import jax

    from replay.verify import rotation

    why = refusal(run)
    layout = replayable.replica_layout() if why is None and getattr(replayable, "replica_layout", None) else None
    fingerprints = getattr(replayable, CAPABILITY, None) if layout is not None else None
    rotated_step = getattr(replayable, rotation.CAPABILITY, None)
    if why is None and layout is not None and fingerprints is None:
        why = (f"{shown_path(run)}: the run's loop computes replicas apart (replica_layout) but provides no "
               f"{CAPABILITY}(state, step, rotate) -> uint64[microbatches, layers] to re-compute them")
    if why is None and layout is None and rotated_step is None:
        why = (f"{shown_path(run)}: replay verify re-runs steps on other devices through the run's loop, and the loop "
               f"this run loaded provides no {rotation.CAPABILITY}(state, step, rotate) (a replay.Loop run replayed "
               "from its exported program has none: install the loop's module, or pass --allow-code as for replay run)")
    n = layout[0] if layout is not None else jax.local_device_count()
    if why is None:
        why = too_few_devices(n)
    if why:
        raise VerifyInputError(why)
    m = layout[1] if layout is not None else 0
    rotations = sorted({0, rotate % n, (2 * rotate) % n})
    if len(rotations) < 3:
        raise VerifyInputError(f"--rotate {rotate}: rotations 0, {rotate} and {2 * rotate} must put the work on three "
                               f"different devices of {n}; pick a rotation that is not a multiple of {n // 2 or 1}")
    start = check_range(run, first, last, replayable.checkpoint_steps())
    layers = list(replayable.layer_groups()) if layout is not None else []
    report = VerifyReport(shown_path(run), first, last, rotate, n, m, start, False,
                          mode="replicas" if layout is not None else "shards")

    rerun = getattr(replayable, "rerun_step", None)
    events, differing, state = [], {}, replayable.restore(start)
    for step in range(start, last + 1):
        again = None
        if step >= first:
            if layout is not None:
                runs = {k: np.asarray(fingerprints(state, step, k), np.uint64) for k in rotations}
                trace = trace_replicas(run.schema, run.trace.read(step), m, layers)
                report.trace_replicas = report.trace_replicas or trace is not None
                step_ev, unresolved = step_events(step, trace, runs, n)
            else:
                runs = {k: rotation.shard_fingerprints(rotated_step(state, step, k)) for k in rotations}
                step_ev, unresolved, layers = rotation.step_events(step, runs)
                report.shards = len(layers)
                report.devices_used = max(report.devices_used, rotation.devices_used(runs))
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
    if layout is None:
        report.shard_names = layers
        report.notes.append("re-run on rotated devices and compared shard by shard: a chip is named when its damage "
                            "shows in its own shards; damage a reduction spread to every device leaves shards "
                            "unresolved (the trainer's mesh-invariant mode, check.replicas=true, names those chips)")
    elif not report.trace_replicas:
        report.notes.append("the trace holds no per-replica fingerprints (train with --set check.replicas=true): a "
                            "transient fault in training is found as a recorded step no re-execution reproduces, "
                            "without the device it hit")
    return report
