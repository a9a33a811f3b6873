"""The training loop: build everything from the config, train, record, checkpoint.

Everything that can be wrong with the input is checked before the run directory is touched,
so bad input never changes a run. A resumed run restarts from its newest checkpoint and
re-records the steps after it; the trace writer accepts them only if they are bit-identical
to what was recorded before the interruption, so every resume is also a determinism check.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

from traces import Run, TraceWriter
from trainer import data, mesh as meshlib, model, rng
from trainer.checkpoint import Checkpointer
from trainer.config import Config, ConfigError, config_diff, from_dict, to_dict
from trainer.environment import environment, peak_flops, program_hash
from trainer.recorder import Recorder, gather_example_hashes, make_schema
from trainer.step import compile_step, tensor_schema


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


def load_resume_config(path: Path, cfg: Config | None, steps: int | None) -> Config:
    """The config of the run to resume, refusing a different one (steps may grow)."""
    run = Run.open(path)
    recorded = from_dict(run.manifest["config"])
    if cfg is not None:
        diff = [d for d in config_diff(recorded, cfg) if d[0] != "steps"]
        if diff:
            key, a, b = diff[0]
            raise ConfigError(f"{path} was made with {key}={a!r}, not {b!r}: resume with the run's own config "
                              f"(drop --preset/--set) or train a new run")
    total = steps if steps is not None else recorded.steps
    return from_dict({**to_dict(recorded), "steps": total})


def _level_fn(cfg: Config, step: int) -> str:
    level = cfg.trace.level
    if level == "layer" and step % cfg.trace.layer_every:
        return "step"
    return level


@dataclass
class Prepared:
    """A validated, compiled training job whose run directory has not been touched yet."""

    cfg: Config
    out: Path
    resume: bool
    preset: str | None
    mesh: Any
    batcher: data.Batcher
    batch_sharding: Any
    abstract_sharded: Any
    schema: Any
    compiled: dict
    manifest: dict
    compile_seconds: float


def prepare(cfg: Config, out: str | Path, *, resume: bool = False, preset: str | None = None,
            on_compile: Callable[[], None] | None = None) -> Prepared:
    """Validates everything and compiles the step; raises a one-line error on bad input."""
    out = Path(out)
    if not resume and out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} already exists; choose a new --out, or continue it with --resume {out}")
    source = data.open_source(cfg.data.source, cfg.data.token_dtype, cfg.model.vocab_size)
    mesh = meshlib.make_mesh(cfg.mesh)
    meshlib.check_batch(cfg.data.global_batch_size, mesh)
    batcher = data.Batcher(source, cfg.model.seq_len, cfg.data.global_batch_size, rng.data_seed(cfg.seed),
                           jax.process_index(), jax.process_count())
    abstract = meshlib.abstract_state(cfg)
    shardings = meshlib.state_shardings(mesh, abstract)
    batch_sharding = meshlib.batch_sharding(mesh)
    levels = {cfg.trace.level} | ({"step"} if cfg.trace.level == "layer" and cfg.trace.layer_every > 1 else set())
    schema = make_schema(cfg.data.global_batch_size, cfg.trace.level, tensor_schema(cfg))

    if on_compile is not None:
        on_compile()
    t0 = time.perf_counter()
    example = _global_batch(batcher.batch_at(0), mesh, batch_sharding)
    abstract_sharded = meshlib.abstract_with_shardings(abstract, shardings)
    compiled = {}
    for lvl in levels:
        lowered = compile_step(cfg, lvl, shardings, batch_sharding).lower(abstract_sharded, example)
        compiled[lvl] = lowered.compile()
        if lvl == cfg.trace.level:
            phash = program_hash(lowered)
    manifest = {
        "preset": preset,
        "config": to_dict(cfg),
        "environment": environment(),
        "data": source.describe(),
        "program_hash": phash,
        "mesh": {"shape": dict(mesh.shape), "devices": int(mesh.devices.size)},
        "model": {"params": model.param_count(cfg.model), "flops_per_token": model.flops_per_token(cfg.model)},
        "checkpoints": [],
    }
    return Prepared(cfg, out, resume, preset, mesh, batcher, batch_sharding, abstract_sharded, schema, compiled,
                    manifest, time.perf_counter() - t0)


def train(cfg: Config, out: str | Path, *, resume: bool = False, preset: str | None = None,
          on_step: Callable[[StepInfo], None] | None = None) -> TrainResult:
    return run_prepared(prepare(cfg, out, resume=resume, preset=preset), on_step)


def run_prepared(job: Prepared, on_step: Callable[[StepInfo], None] | None = None) -> TrainResult:
    """Opens (or creates) the run and trains. Only process 0 writes the trace and manifest."""
    run = None
    if jax.process_index() == 0:
        run = Run.resume(job.out) if job.resume else Run.create(job.out, job.schema, job.manifest)
    elif not job.resume:
        _wait_for(job.out / "run.json")
    try:
        return _train_loop(job.cfg, job.out, run, job.resume, job.compiled, job.batcher, job.mesh, job.batch_sharding,
                           job.abstract_sharded, job.schema, job.compile_seconds, on_step)
    finally:
        if run is not None:
            run.close()  # a no-op after finish(); otherwise the run stays marked incomplete


def _train_loop(cfg, out, run, resume, compiled, batcher, mesh, batch_sharding, abstract_sharded, schema,
                compile_seconds, on_step) -> TrainResult:
    ckpt = Checkpointer(out / "checkpoints", keep=cfg.checkpoint.keep, create=True)
    writer: TraceWriter | None = run.writer() if run is not None else None
    start = 0
    if resume:
        recorded_end = writer.next_step if writer is not None and writer.next_step is not None else 0
        latest = ckpt.latest_at_or_before(recorded_end) if ckpt.steps() else None
        state = ckpt.restore(latest, abstract_sharded) if latest is not None else None
        start = latest or 0
    else:
        state = None
    if state is None:
        state = meshlib.init_sharded_state(cfg, mesh)
    recorder = Recorder(schema, writer, cfg.trace.level)
    tokens_per_step = cfg.data.global_batch_size * cfg.model.seq_len
    peak = peak_flops(jax.devices()[0].device_kind)
    flops_per_step = model.flops_per_token(cfg.model) * tokens_per_step
    t_start = time.perf_counter()
    for step in range(start, cfg.steps):
        batch = batcher.batch_at(step)
        hashes = gather_example_hashes(batch.example_hashes)
        state, metrics = compiled[_level_fn(cfg, step)](state, _global_batch(batch, mesh, batch_sharding))
        recorder.record(step, metrics, hashes)
        done = step + 1
        if done == cfg.steps or (cfg.checkpoint.every_steps and done % cfg.checkpoint.every_steps == 0):
            recorder.flush()
            ckpt.save(state)
            if run is not None:
                run.update_manifest(checkpoints=ckpt.steps())
        if on_step is not None:
            elapsed = time.perf_counter() - t_start
            rate = (done - start) * tokens_per_step / elapsed if elapsed > 0 else 0.0
            last = recorder.last
            on_step(StepInfo(step, cfg.steps, last.metric(schema, "loss") if last else None, rate,
                             rate / tokens_per_step * flops_per_step / (peak * mesh.devices.size) if peak else None))
    recorder.flush()
    ckpt.close()
    seconds = time.perf_counter() - t_start
    if run is not None:
        run.update_manifest(checkpoints=ckpt.steps(), config={**run.manifest["config"], "steps": cfg.steps})
        run.finish()
    last = recorder.last
    return TrainResult(out, start, cfg.steps, recorder.rewritten, seconds, compile_seconds,
                       last.metric(schema, "loss") if last else None, ckpt.steps())


def _global_batch(batch: data.Batch, mesh, sharding) -> dict:
    return {
        "inputs": meshlib.global_batch(batch.inputs_BxL.astype(np.int32), mesh, sharding),
        "targets": meshlib.global_batch(batch.targets_BxL.astype(np.int32), mesh, sharding),
    }


def _wait_for(path: Path, timeout: float = 120.0) -> None:
    # Processes other than 0 start checkpointing into the run only once process 0 created it.
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"process 0 did not create {path} within {timeout:.0f} s")
        time.sleep(0.05)
