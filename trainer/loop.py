"""The training loop: build everything from the config, train, record, checkpoint.

Everything that can be wrong with the input is checked before the run directory is touched,
so bad input never changes a run. A resumed run restarts from its newest checkpoint and
re-records the steps after it; the trace writer accepts them only if they are bit-identical
to what was recorded before the interruption, so every resume is also a determinism check.
`build` is shared with the replay engine, so a replay runs the very program training ran.

The trainer records as any loop can: `replay.init(..., replayable="trainer.replayable:from_run")`
creates the run (its own keys given as `manifest=`), its step computes its own record in its own
program (trainer/step.py) and hands it to `run.begin`/`run.record`, and `run.save` checkpoints
(replay/record/run_checkpoints.py: every saved state's fingerprint in the manifest). A resume opens
the run through `replay.init(resume=True)`, which holds the lock from before the compile (a second
writer is refused at once) and writes nothing until the first write, and restores the newest
checkpoint the trace reaches verified against its fingerprint, so bad input leaves the run as it was.

Cost at a million steps: O(1) memory; one record and at most one checkpoint save per step.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

import replay
from replay.engine.protocol import LEGACY_DEFAULT_FACTORY as TRAINER_FACTORY  # trainer.replayable:from_run
from replay.record.environment import peak_flops, program_hash
from replay.record.gather import Timeline, gather_blocking, start_gather
from traces import Run, Schema
from traces.errors import DISK_FULL_ERRNOS, DiskFullError, disk_full_message
from traces.run import LOCK, take_lock
from trainer import data, invariant, mesh as meshlib, model, rng, sketches
from trainer.config import Config, ConfigError, MeshConfig, to_dict
from trainer.faults import FaultPlan
from trainer.optim import make_optimizer
from trainer.resume_config import load_resume_config  # noqa: F401 - the train command and demo import it here
from trainer.sdc_watch import RerunWatch
from trainer.step import METRICS, tensor_schema

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
    compiled: Programs | dict  # trace level -> compiled step
    program_hash: str
    compile_seconds: float
    faults: FaultPlan | None = None  # injected faults (trainer/faults.py), applied step by step
    compiled_faulty: Programs | dict = field(default_factory=dict)  # trace level -> step compiled with layer-bf16
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


class Programs(Mapping):
    """Trace level -> compiled step, each compiled on first use (`compile_step` keeps the jitted
    function; this keeps the executable). A run with trace.layer_every > 1 has a step-level and a
    layer-level program, and a replay may need only one: `replay spike` replays its window at the
    layer level (~4 s of CPU for tiny's other program, compiled for nothing before). `seconds`:
    time spent compiling here."""

    def __init__(self, compile_level: Callable[[str], Any], levels: set[str], compiled: dict | None = None):
        self._compile, self._levels, self._done = compile_level, tuple(sorted(levels)), dict(compiled or {})
        self.seconds = 0.0

    def __getitem__(self, level: str) -> Any:
        if level not in self._done:
            if level not in self._levels:
                raise KeyError(level)
            t0 = time.perf_counter()
            self._done[level] = self._compile(level)
            self.seconds += time.perf_counter() - t0
        return self._done[level]

    def __contains__(self, level: object) -> bool:  # Mapping's would compile it
        return level in self._levels

    def __iter__(self):
        return iter(self._levels)

    def __len__(self) -> int:
        return len(self._levels)

    def warm(self) -> None:
        """Compiles every level now (training uses them all: its step times stay compile-free)."""
        for level in self._levels:
            self[level]


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
    meshlib.abstract_state(cfg)  # reads an init_from checkpoint's config.json: refused before "compiling"
    sketches.check(cfg)
    schema = make_schema(cfg.data.global_batch_size, cfg.trace.level, tensor_schema(cfg), sketches.width(cfg))
    levels = {cfg.trace.level} | ({"step"} if cfg.trace.level == "layer" and cfg.trace.layer_every > 1 else set())
    if on_compile is not None:
        on_compile()
    t0 = time.perf_counter()

    def compiler(step_cfg: Config) -> Callable[[str], Any]:
        return lambda lvl: meshlib.lower_step(cfg, lvl, mesh, step_cfg)[0].compile()

    # The recorded level's program now (its hash goes in the manifest); the others on first use.
    lowered, shardings, batch_sharding, abstract_sharded = meshlib.lower_step(cfg, cfg.trace.level, mesh)
    compiled = Programs(compiler(cfg), levels, {cfg.trace.level: lowered.compile()})
    phash = program_hash(lowered)
    faulty_cfg = faults.model_cfg(10**12) if faults else None  # the faulty program, if a fault needs one
    compiled_faulty = Programs(compiler(faulty_cfg), levels) if faulty_cfg is not None else {}
    return Built(cfg, source, mesh, batcher, batch_sharding, abstract_sharded, schema, compiled, phash,
                 time.perf_counter() - t0, faults, compiled_faulty)


def _warm(built: Built) -> None:
    for programs in (built.compiled, built.compiled_faulty):
        if isinstance(programs, Programs):
            programs.warm()
            built.compile_seconds += programs.seconds
            programs.seconds = 0.0


@dataclass
class Prepared:
    """A validated, compiled training job whose run directory has not been written yet."""

    out: Path
    resume: bool
    built: Built
    manifest: dict  # the trainer's own run.json keys (replay.init writes its own beside them)
    run: replay.RecordingRun | None = None  # resume: the run, its lock held from before the compile, not yet written
    start: int = 0  # resume: the checkpoint it restarts from
    state: Any = None  # resume: the verified state of that checkpoint (None: from the initial state)
    recorded_end: int = 0  # resume: the step after the last one the trace held
    was_complete: bool = False  # resume: whether the run was complete


def prepare(cfg: Config, out: str | Path, *, resume: bool = False, preset: str | None = None,
            on_compile: Callable[[], None] | None = None, faults: FaultPlan | None = None) -> Prepared:
    """Validates everything and compiles the step; raises a one-line error on bad input."""
    out = Path(out)
    if cfg.steps < 1:
        raise ConfigError(f"steps={cfg.steps}: a run takes at least 1 step; give --steps 1 or more")
    if not resume and out.exists() and (not out.is_dir() or any(out.iterdir())):
        if (out / LOCK).exists():
            take_lock(out, create=False)  # a live writer: say so rather than "already exists" (raises)
        raise ConfigError(f"{out} already exists; choose a new --out, or continue it with --resume {out}")
    if cfg.mesh.mesh_invariant:  # its XLA:CPU settings go in before anything starts JAX's backend
        invariant.prepare_process()
    job = Prepared(out, resume, None, {})  # type: ignore[arg-type]
    try:
        if resume:  # the lock from before the compile; a damaged checkpoint refused before the run is written
            _open_resume(job, cfg)
        job.built = build(cfg, on_compile=on_compile, faults=faults)
        _warm(job.built)  # training uses every level: compiled before the run is written, as before
    except BaseException:
        if job.run is not None:
            job.run.close()
        raise
    built = job.built
    job.manifest = {
        "preset": preset,
        "data": built.source.describe(),
        "mesh": {"shape": dict(built.mesh.shape), "devices": int(built.mesh.devices.size)},
        "model": {"params": model.param_count(cfg.model), "flops_per_token": model.flops_per_token(cfg.model)},
        "faults": faults.to_manifest() if faults else [],
    }
    if cfg.mesh.mesh_invariant:  # read by replay/engine/contract.py: the counts measured to give the same bits
        job.manifest["invariant_device_counts"] = invariant.invariant_counts(cfg, jax.default_backend(),
                                                                             jax.local_device_count())
        job.manifest["invariant"] = {"n_microbatches": cfg.mesh.n_microbatches,
                                     "pool_threads": invariant.pool_threads(),
                                     "settings_problem": invariant.settings_problem()}
    return job


def _open_resume(job: Prepared, cfg: Config) -> None:
    """Opens the run to resume (its lock taken, nothing written) and restores the newest
    checkpoint its trace reaches, verified against its recorded fingerprint."""
    job.run = run = replay.init(job.out, resume=True, **_recording(cfg, job.out))
    job.recorded_end, job.was_complete = run.next_step, Run.open(job.out).status == "complete"
    if run.newest_checkpoint() is not None:
        job.state = run.restore(meshlib.sharded_abstract_state(cfg, meshlib.make_mesh(cfg.mesh)))
        job.start = run.next_step


def _recording(cfg: Config, out: Path) -> dict:
    """What replay.init is told of every trainer run, new or resumed."""
    return dict(replayable=TRAINER_FACTORY, keep_checkpoints=cfg.checkpoint.keep, state_step=state_step,
                resume_command=f"`replay train --resume {out}`")


def train(cfg: Config, out: str | Path, *, resume: bool = False, preset: str | None = None,
          on_step: Callable[[StepInfo], None] | None = None, faults: FaultPlan | None = None) -> TrainResult:
    return run_prepared(prepare(cfg, out, resume=resume, preset=preset, faults=faults), on_step)


def run_prepared(job: Prepared, on_step: Callable[[StepInfo], None] | None = None) -> TrainResult:
    """Records the job through replay.init, run.begin/run.record and run.save (process 0 writes
    the trace and run.json; every process saves its shards of each checkpoint)."""
    cfg, run = job.built.cfg, job.run
    try:
        if run is None:
            run = replay.init(job.out, config=to_dict(cfg), manifest=job.manifest, **_recording(cfg, job.out))
        else:
            try:  # each resume's host and device count: under a host-dependent sampler they decide the data
                resumes = [*run.manifest.get("resumes", []), {
                    "step": job.start, "process_count": jax.process_count(), "device_count": jax.device_count()}]
                run.annotate(faults=job.manifest["faults"], resumes=resumes)
                run.begin(job.built.schema, job.built.program_hash, level=cfg.trace.level,
                          timeline=job.built.timeline)
            except DiskFullError as e:
                raise _full_on_resume(job, e.path or job.out) from None
            except OSError as e:
                if e.errno not in DISK_FULL_ERRNOS:
                    raise
                raise _full_on_resume(job, e.filename or job.out) from None
        return _train_loop(job, run, on_step)
    except BaseException:
        if run is not None:
            run.close()  # the run stays incomplete, resumable; a failed save re-raises here, the first error stands
        raise


def _full_on_resume(job: Prepared, path: str | Path) -> DiskFullError:
    """A full disk before the resume wrote anything: the writers' own message would count the steps
    this process recorded (none yet), so it is said here from the trace as the resume found it."""
    last = job.recorded_end - 1 if job.recorded_end > 0 else None
    doing = "starting the resume: the disk is " + ("full" if job.was_complete else "still full")
    return DiskFullError(disk_full_message(path, doing, last, job.out), str(path), last)


def _train_loop(job: Prepared, run: replay.RecordingRun, on_step: Callable[[StepInfo], None] | None) -> TrainResult:
    built, cfg = job.built, job.built.cfg
    start, state = job.start, job.state
    if job.run is None:
        run.begin(built.schema, built.program_hash, level=cfg.trace.level, timeline=built.timeline)
    if state is None:
        state = meshlib.init_sharded_state(cfg, built.mesh)
        # Checkpoint 0 makes every step replayable, the first ones included.
        if cfg.checkpoint.every_steps and cfg.steps > 0:
            run.save(0, state)
    rerun_watch = RerunWatch.for_run(run.manifest, built.schema, str(job.out))  # SDC re-runs that disagree: warned
    tokens_per_step = cfg.data.global_batch_size * cfg.model.seq_len
    peak = peak_flops(jax.devices()[0].device_kind)
    flops_per_step = model.flops_per_token(cfg.model) * tokens_per_step
    t_start = time.perf_counter()
    for step in range(start, cfg.steps):
        state, metrics, hashes = built.run_step(state, step)
        run.record(step, metrics, hashes)
        rerun_watch.dispatched(step, metrics)
        done = step + 1
        if done == cfg.steps or (cfg.checkpoint.every_steps and done % cfg.checkpoint.every_steps == 0):
            run.save(done, state, wait=done == cfg.steps)  # the last one waits: its failure is reported here
        if on_step is not None:
            elapsed = time.perf_counter() - t_start
            rate = (done - start) * tokens_per_step / elapsed if elapsed > 0 else 0.0
            last = run.last_record
            # MFU = achieved FLOP/s over the devices' peak; FLOPs per token from model.flops_per_token.
            mfu = rate * flops_per_step / tokens_per_step / (peak * built.mesh.devices.size) if peak else None
            on_step(StepInfo(step, cfg.steps, last.metric(built.schema, "loss") if last else None, rate, mfu))
    run.flush()
    rerun_watch.flush()
    seconds = time.perf_counter() - t_start
    run.annotate(config={**run.manifest["config"], "steps": cfg.steps})
    checkpoints = run.checkpoints
    run.finish()
    last = run.last_record
    return TrainResult(job.out, start, cfg.steps, run.rewritten, seconds, built.compile_seconds,
                       last.metric(built.schema, "loss") if last else None, checkpoints, list(run.notes))


def state_step(state: Any) -> int:
    """The step a TrainState is at (checkpoint k holds state.step == k). state.step is replicated;
    in a multi-process run it is not fully addressable, so this reads this process's copy."""
    s = state.step
    if isinstance(s, jax.Array):
        s = s.addressable_shards[0].data
    return int(np.asarray(s))
