"""The training loop: build everything from the config, train, record, checkpoint.

Everything that can be wrong with the input is checked before the run directory is touched,
so bad input never changes a run. A resumed run restarts from its newest checkpoint and
re-records the steps after it; the trace writer accepts them only if they are bit-identical
to what was recorded before the interruption, so every resume is also a determinism check.
`build` is shared with the replay engine, so a replay runs the very program training ran.

Every saved state's fingerprint is recorded in the manifest, and a resume verifies the checkpoint
it restores against it before the run is touched. A resume holds the run's lock from before the
compile, so a second writer is refused at once.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

from replay.record.checkpointer import Checkpointer
from replay.record.checkpoints import FINGERPRINTS_KEY, recorded_fingerprint
from replay.record.environment import environment, peak_flops, program_hash
from replay.record.orbax_io import CheckpointDiskFullError
from replay.record.gather import Timeline, gather_blocking, start_gather
from replay.record.recorder import Recorder
from traces import Run, Schema, TraceWriter
from traces.errors import DISK_FULL_ERRNOS, DiskFullError, disk_full_message
from traces.run import LOCK, take_lock
from trainer import data, invariant, mesh as meshlib, model, rng, sketches
from trainer.config import Config, ConfigError, MeshConfig, config_diff, from_dict, to_dict
from trainer.faults import FaultPlan
from trainer.optim import make_optimizer
from trainer.sdc_watch import RerunWatch
from trainer.step import METRICS, compile_step, tensor_schema

RNG_WORDS = 2  # a threefry2x32 key


@dataclass
class StepInfo:
    """What the progress display shows after each step."""

    step: int  # the step just dispatched
    total: int  # the run's final step count
    loss: float | None  # newest recorded loss (one step behind), None with recording off
    tokens_per_s: float
    mfu: float | None  # None where the device has no known peak (CPUs)


@dataclass
class TrainResult:
    path: Path
    start_step: int  # the step training (re)started from
    end_step: int  # steps taken in total
    rewritten: int  # steps re-recorded bit-identically after a resume
    seconds: float
    compile_seconds: float
    last_loss: float | None
    checkpoints: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what could not be checked (an unverified checkpoint)


@dataclass
class Built:
    """The compiled step and everything needed to feed it, for one config on this machine."""

    cfg: Config
    source: data.TokenSource
    mesh: Any
    batcher: data.Batcher
    batch_sharding: Any
    abstract_sharded: Any  # the state's ShapeDtypeStructs with shardings: restore target
    schema: Schema
    compiled: dict  # trace level -> compiled step
    program_hash: str
    compile_seconds: float
    faults: FaultPlan | None = None  # injected faults (trainer/faults.py), applied step by step
    compiled_faulty: dict = field(default_factory=dict)  # trace level -> step compiled with layer-bf16
    hash_gather: str = "async"  # several hosts: "async" (replay/record/gather.py) or the old "blocking" (bench)
    timeline: Timeline | None = None  # debug: per-step host times (bench/multihost_dispatch.py)

    def level(self, step: int) -> str:
        """The recording level of `step`: layer fingerprints only every trace.layer_every steps."""
        level = self.cfg.trace.level
        return "step" if level == "layer" and step % self.cfg.trace.layer_every else level

    def device_batch(self, step: int, fed_at: int | None = None) -> tuple[dict, Any]:
        """The global batch of `step` on the mesh, and its per-example hashes in global order (on
        several hosts a gather in flight, read as a numpy array: replay/record/gather.py).
        `fed_at`: the step it is fed at, where a fault may alter it (bad-batch)."""
        batch = self.batcher.batch_at(step)
        if fed_at is not None and self.faults:
            batch = self.faults.alter_batch(batch, fed_at, self.batcher.local_slice)
        arrays = {
            "inputs": meshlib.global_batch(batch.inputs_BxL.astype(np.int32), self.mesh, self.batch_sharding),
            "targets": meshlib.global_batch(batch.targets_BxL.astype(np.int32), self.mesh, self.batch_sharding),
        }
        if self.hash_gather == "blocking":
            hashes = gather_blocking(batch.example_hashes)
            if self.timeline is not None:
                self.timeline.mark("gathered", step if fed_at is None else fed_at)
            return arrays, hashes
        return arrays, start_gather(batch.example_hashes, self.mesh, self.batch_sharding)

    def run_step(self, state: Any, step: int) -> tuple[Any, dict, np.ndarray]:
        plan = self.faults
        if not plan:
            arrays, hashes = self.device_batch(step)
            state, metrics = self.compiled[self.level(step)](state, arrays)
            return state, metrics, hashes
        state = plan.before(state, step, self._init_opt_state)
        arrays, hashes = self.device_batch(plan.batch_step(step), fed_at=step)
        programs = self.compiled_faulty if plan.model_cfg(step) is not None else self.compiled
        state, metrics = programs[self.level(step)](state, arrays)
        return plan.after(state, step), metrics, hashes

    def _init_opt_state(self, params: Any) -> Any:
        shardings = jax.tree.map(lambda a: a.sharding, self.abstract_sharded.opt_state)
        return jax.jit(make_optimizer(self.cfg.optimizer).init, out_shardings=shardings)(params)


def make_schema(global_batch: int, level: str, tensors: tuple[tuple[str, str], ...] = (),
                sketch_width: int = 0) -> Schema:
    """The trace schema of a trainer run: step-level fields always, tensors (and their distance
    sketches with trace.sketches) at the layer level."""
    return Schema(examples_per_step=global_batch, rng_words=RNG_WORDS, metrics=METRICS,
                  tensors=tensors if level == "layer" else (), example_metrics=("loss",),
                  sketch_width=sketch_width if level == "layer" else 0)


def build(cfg: Config, source: data.TokenSource | None = None, mesh_cfg: MeshConfig | None = None,
          on_compile: Callable[[], None] | None = None, faults: FaultPlan | None = None) -> Built:
    """Validates the config against the data and devices, then lowers and compiles the step."""
    if source is None:
        source = data.open_source(cfg.data.source, cfg.data.token_dtype, cfg.model.vocab_size)
    if cfg.mesh.mesh_invariant:  # its XLA:CPU settings (no FMA, pinned pool) go in before anything starts JAX
        invariant.prepare_process()
    mesh = meshlib.make_mesh(mesh_cfg or cfg.mesh)
    meshlib.check_batch(cfg.data.global_batch_size, mesh)
    if cfg.mesh.mesh_invariant:
        invariant.check(cfg, int(mesh.size))
    batcher = data.Batcher(source, cfg.model.seq_len, cfg.data.global_batch_size, rng.data_seed(cfg.seed),
                           jax.process_index(), jax.process_count(), sampler=cfg.data.sampler)
    abstract = meshlib.abstract_state(cfg)
    shardings = meshlib.state_shardings(mesh, abstract)
    batch_sharding = meshlib.batch_sharding(mesh)
    abstract_sharded = meshlib.abstract_with_shardings(abstract, shardings)
    sketches.check(cfg)
    schema = make_schema(cfg.data.global_batch_size, cfg.trace.level, tensor_schema(cfg), sketches.width(cfg))
    levels = {cfg.trace.level} | ({"step"} if cfg.trace.level == "layer" and cfg.trace.layer_every > 1 else set())
    if on_compile is not None:
        on_compile()
    t0 = time.perf_counter()
    example = meshlib.abstract_batch(cfg, mesh)
    compiled, phash = {}, ""
    for lvl in sorted(levels):
        lowered = compile_step(cfg, lvl, shardings, batch_sharding).lower(abstract_sharded, example)
        compiled[lvl] = lowered.compile()
        if lvl == cfg.trace.level:
            phash = program_hash(lowered)
    faulty_cfg = faults.model_cfg(10**12) if faults else None  # the faulty program, if a fault needs one
    compiled_faulty = {lvl: compile_step(faulty_cfg, lvl, shardings, batch_sharding).lower(abstract_sharded, example)
                       .compile() for lvl in sorted(levels)} if faulty_cfg is not None else {}
    return Built(cfg, source, mesh, batcher, batch_sharding, abstract_sharded, schema, compiled, phash,
                 time.perf_counter() - t0, faults, compiled_faulty)


def load_resume_config(path: Path, cfg: Config | None, steps: int | None) -> Config:
    """The config of the run to resume, refusing a different one.

    `steps` is the run's new total length: a resume trains up to it, so it may only grow. Fewer
    steps than the run is configured for would rewrite its config (and drop what it planned to
    record), so that is refused; a shorter run is a new run."""
    run = Run.open(path)
    recorded = from_dict(run.manifest["config"])
    if steps is not None and steps < 1:
        raise ConfigError(f"--steps {steps}: a run takes at least 1 step; give --steps 1 or more")
    if steps is not None and steps < recorded.steps:
        raise ConfigError(f"--steps {steps}: {path} is configured for {recorded.steps} steps and a resume can only "
                          f"extend it; give --steps {recorded.steps} or more, or omit --steps to finish it as configured")
    if cfg is not None:
        diff = [d for d in config_diff(recorded, cfg) if d[0] != "steps"]
        if diff:
            key, a, b = diff[0]
            raise ConfigError(f"{path} was made with {key}={a!r}, not {b!r}: resume with the run's own config "
                              f"(drop --preset/--set) or train a new run")
    total = steps if steps is not None else recorded.steps
    if run.status == "complete" and total <= run.trace.end:
        # Nothing to train: refused before the lock or a compile, so the run stays byte for byte as it was.
        raise ConfigError(f"{path} already has {run.trace.end} steps and is complete, so there is nothing to train; "
                          f"pass a larger --steps (more than {run.trace.end}) to continue it")
    return from_dict({**to_dict(recorded), "steps": total})


@dataclass
class Prepared:
    """A validated, compiled training job whose run directory has not been touched yet."""

    out: Path
    resume: bool
    built: Built
    manifest: dict
    lock_fd: int | None = None  # resume, process 0: the run's lock, held from before the compile
    resumed: _Resumed | None = None  # resume: the verified state it restarts from


def prepare(cfg: Config, out: str | Path, *, resume: bool = False, preset: str | None = None,
            on_compile: Callable[[], None] | None = None, faults: FaultPlan | None = None) -> Prepared:
    """Validates everything and compiles the step; raises a one-line error on bad input."""
    out = Path(out)
    if cfg.steps < 1:
        raise ConfigError(f"steps={cfg.steps}: a run takes at least 1 step; give --steps 1 or more")
    if not resume and out.exists() and (not out.is_dir() or any(out.iterdir())):
        if (out / LOCK).exists():
            _release(take_lock(out, create=False))  # a live writer: say so rather than "already exists"
        raise ConfigError(f"{out} already exists; choose a new --out, or continue it with --resume {out}")
    # From before the compile, writing nothing: bad input must leave the run as it was.
    lock_fd = take_lock(out, create=False) if resume and jax.process_index() == 0 else None
    resumed = None
    try:
        # A damaged checkpoint is refused before the compile, and before the run is touched.
        resumed = _restore_newest(cfg, out) if resume else None
        built = build(cfg, on_compile=on_compile, faults=faults)
    except BaseException:
        _release(lock_fd)
        if resumed is not None:
            resumed.ckpt.close()
        raise
    manifest = {
        "preset": preset,
        "config": to_dict(cfg),
        "environment": environment(),
        "data": built.source.describe(),
        "program_hash": built.program_hash,
        "mesh": {"shape": dict(built.mesh.shape), "devices": int(built.mesh.devices.size)},
        "model": {"params": model.param_count(cfg.model), "flops_per_token": model.flops_per_token(cfg.model)},
        "checkpoints": [],
        "faults": faults.to_manifest() if faults else [],
    }
    if cfg.mesh.mesh_invariant:  # read by replay/engine/contract.py: the counts measured to give the same bits
        manifest["invariant_device_counts"] = invariant.invariant_counts(cfg, jax.default_backend(),
                                                                         jax.local_device_count())
        manifest["invariant"] = {"n_microbatches": cfg.mesh.n_microbatches, "pool_threads": invariant.pool_threads(),
                                 "settings_problem": invariant.settings_problem()}
    return Prepared(out, resume, built, manifest, lock_fd, resumed)


def _release(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)


def train(cfg: Config, out: str | Path, *, resume: bool = False, preset: str | None = None,
          on_step: Callable[[StepInfo], None] | None = None, faults: FaultPlan | None = None) -> TrainResult:
    return run_prepared(prepare(cfg, out, resume=resume, preset=preset, faults=faults), on_step)


def run_prepared(job: Prepared, on_step: Callable[[StepInfo], None] | None = None) -> TrainResult:
    """Opens (or creates) the run and trains. Only process 0 writes the trace and manifest."""
    run, ckpt = None, job.resumed.ckpt if job.resumed else None
    try:
        if jax.process_index() == 0:
            _release(job.lock_fd)  # Run.resume takes the same lock through its own descriptor
            job.lock_fd = None
            if job.resume:
                try:
                    run = Run.resume(job.out)
                    # Each resume's host and device count: under a host-dependent sampler they decide the data.
                    resumes = [*run.manifest.get("resumes", []), {
                        "step": job.resumed.start, "process_count": jax.process_count(),
                        "device_count": jax.device_count()}]
                    run.update_manifest(faults=job.manifest["faults"], resumes=resumes)
                except DiskFullError as e:
                    raise _full_on_resume(job, e.path or job.out) from None
                except OSError as e:
                    if e.errno not in DISK_FULL_ERRNOS:
                        raise
                    raise _full_on_resume(job, e.filename or job.out) from None
            else:
                run = Run.create(job.out, job.built.schema, job.manifest)
        elif not job.resume:
            _wait_for(job.out / "run.json")
        if ckpt is None:
            ckpt = Checkpointer(job.out / "checkpoints", keep=job.built.cfg.checkpoint.keep, step_of=state_step)
        return _train_loop(job, run, ckpt, on_step)
    except BaseException:
        if ckpt is not None:
            with contextlib.suppress(Exception):  # a failed save re-raises here; the first error stands
                ckpt.close()
        raise
    finally:
        _release(job.lock_fd)
        if run is not None:
            run.close()  # a no-op after finish(); otherwise the run stays marked incomplete


def _full_on_resume(job: Prepared, path: str | Path) -> DiskFullError:
    """A full disk before the resume wrote anything: the writers' own message would count the steps
    this process recorded (none yet), so it is said here from the trace as the resume found it."""
    resumed = job.resumed
    last = resumed.recorded_end - 1 if resumed.recorded_end > 0 else None
    doing = "starting the resume: the disk is " + ("full" if resumed.was_complete else "still full")
    return DiskFullError(disk_full_message(path, doing, last, job.out), str(path), last)


@dataclass
class _Resumed:
    ckpt: Checkpointer
    start: int
    state: Any  # None: no checkpoint yet, the run restarts from its initial state
    fingerprints: dict[str, str]  # the manifest's checkpoint fingerprints
    notes: list[str]
    recorded_end: int = 0  # the step after the last one the trace held when the resume began
    was_complete: bool = False


def _restore_newest(cfg: Config, out: Path) -> _Resumed:
    """The newest checkpoint the trace reaches, restored and checked against its recorded fingerprint."""
    if cfg.mesh.mesh_invariant:  # before the restore starts JAX's backend (see build)
        invariant.prepare_process()
    recorded = Run.open(out)
    manifest, recorded_end = recorded.manifest, recorded.trace.end  # every process: the same step
    complete = recorded.status == "complete"
    ckpt = Checkpointer(out / "checkpoints", keep=cfg.checkpoint.keep, step_of=state_step)
    try:
        fingerprints = dict(manifest.get(FINGERPRINTS_KEY) or {})
        # Saves are asynchronous: a crash can land after a checkpoint is complete on disk and before
        # its fingerprint reaches the manifest. In a run that records fingerprints, resume from the
        # newest checkpoint that has one (an unverified state is never preferred to a verified one).
        usable = [k for k in ckpt.steps() if k <= recorded_end]
        verified = [k for k in usable if str(k) in fingerprints]
        latest = (verified or usable or [None])[-1] if fingerprints else (usable or [None])[-1]
        if latest is None:
            return _Resumed(ckpt, 0, None, fingerprints, [], recorded_end, complete)
        expected = recorded_fingerprint(manifest, latest)
        state = ckpt.restore(latest, meshlib.sharded_abstract_state(cfg, meshlib.make_mesh(cfg.mesh)),
                             fingerprint=expected)
    except BaseException:
        ckpt.close()
        raise
    notes = [] if expected else [f"{ckpt.path / str(latest)}: checkpoint {latest} has no recorded fingerprint "
                                 "(saved before replay recorded them); resumed from it unverified"]
    return _Resumed(ckpt, latest, state, fingerprints, notes, recorded_end, complete)


class _Saver:
    """Saves checkpoints and records each one's state fingerprint in the manifest."""

    def __init__(self, job: Prepared, run: Run | None, ckpt: Checkpointer, writer: TraceWriter | None,
                 fingerprints: dict[str, str]):
        self.job, self.run, self.ckpt, self.writer = job, run, ckpt, writer
        self.fingerprints = fingerprints

    def save(self, state: Any, done: int, wait: bool = False) -> None:
        """Starts saving `state` (the write goes on while the next steps run: Checkpointer.save) and
        records the checkpoints complete so far; a checkpoint's fingerprint reaches the manifest only
        once it is complete. A failure of the save in flight surfaces here, at the next save."""
        try:  # every process: the fingerprint is a collective, taken before the next step donates the state
            fingerprint = self.ckpt.save(done, state, wait=wait)
        except CheckpointDiskFullError as e:
            failed = getattr(e, "step", done)  # the save in flight, or this one
            last = self.writer.next_step - 1 if self.writer is not None and self.writer.next_step else done - 1
            raise DiskFullError(disk_full_message(self.ckpt.path / str(failed), f"saving checkpoint {failed}", last,
                                                  self.job.out), str(self.ckpt.path), last) from e
        if fingerprint is not None:  # None: checkpoint `done` was on disk already, and stands
            self.fingerprints[str(done)] = fingerprint
        self.record()

    def record(self, **fields: Any) -> None:
        if self.run is None:
            return
        steps = self.ckpt.steps()
        recorded = {str(k): self.fingerprints[str(k)] for k in steps if str(k) in self.fingerprints}
        self.run.update_manifest(checkpoints=steps, **{FINGERPRINTS_KEY: recorded}, **fields)


def _train_loop(job: Prepared, run: Run | None, ckpt: Checkpointer,
                on_step: Callable[[StepInfo], None] | None) -> TrainResult:
    built, cfg, resumed = job.built, job.built.cfg, job.resumed
    writer: TraceWriter | None = run.writer() if run is not None else None
    start, state = (resumed.start, resumed.state) if resumed else (0, None)
    saver = _Saver(job, run, ckpt, writer, resumed.fingerprints if resumed else {})
    if state is None:
        state = meshlib.init_sharded_state(cfg, built.mesh)
        # Checkpoint 0 makes every step replayable, the first ones included.
        if cfg.checkpoint.every_steps and cfg.steps > 0:
            saver.save(state, 0)
    recorder = Recorder(built.schema, writer, cfg.trace.level, timeline=built.timeline)
    rerun_watch = RerunWatch.for_run(job.manifest, built.schema, str(job.out))  # SDC re-runs that disagree: warned
    tokens_per_step = cfg.data.global_batch_size * cfg.model.seq_len
    peak = peak_flops(jax.devices()[0].device_kind)
    flops_per_step = model.flops_per_token(cfg.model) * tokens_per_step
    t_start = time.perf_counter()
    for step in range(start, cfg.steps):
        state, metrics, hashes = built.run_step(state, step)
        recorder.record(step, metrics, hashes)
        rerun_watch.dispatched(step, metrics)
        done = step + 1
        if done == cfg.steps or (cfg.checkpoint.every_steps and done % cfg.checkpoint.every_steps == 0):
            recorder.flush()  # the trace always reaches at least as far as the newest checkpoint
            saver.save(state, done, wait=done == cfg.steps)  # the last one waits: its failure is reported here
        if on_step is not None:
            elapsed = time.perf_counter() - t_start
            rate = (done - start) * tokens_per_step / elapsed if elapsed > 0 else 0.0
            last = recorder.last
            # MFU = achieved FLOP/s over the devices' peak; FLOPs per token from model.flops_per_token.
            mfu = rate * flops_per_step / tokens_per_step / (peak * built.mesh.devices.size) if peak else None
            on_step(StepInfo(step, cfg.steps, last.metric(built.schema, "loss") if last else None, rate, mfu))
    recorder.flush()
    rerun_watch.flush()
    ckpt.close()
    seconds = time.perf_counter() - t_start
    if run is not None:
        saver.record(config={**run.manifest["config"], "steps": cfg.steps})
        run.finish()
    last = recorder.last
    return TrainResult(job.out, start, cfg.steps, recorder.rewritten, seconds, built.compile_seconds,
                       last.metric(built.schema, "loss") if last else None, ckpt.steps(),
                       resumed.notes if resumed else [])


def state_step(state: Any) -> int:
    """The step a TrainState is at (checkpoint k holds state.step == k). state.step is replicated;
    in a multi-process run it is not fully addressable, so this reads this process's copy."""
    s = state.step
    if isinstance(s, jax.Array):
        s = s.addressable_shards[0].data
    return int(np.asarray(s))


def _wait_for(path: Path, timeout: float = 120.0) -> None:
    # Processes other than 0 start checkpointing into the run only once process 0 created it.
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"process 0 did not create {path} within {timeout:.0f} s")
        time.sleep(0.05)
