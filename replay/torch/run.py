"""`replay.torch.init(...)`: a PyTorch training loop recorded into the replay run format.

    run = replay.torch.init("runs/ref", config=cfg, model=model, optimizer=opt)
    for k in range(steps):
        with run.step(rows) as rec:                 # rows: int token rows [B, L+1]
            loss = loss_fn(model(rows[:, :-1]), rows[:, 1:])
            loss.backward()
            opt.step()
            rec.metrics(loss=loss)
        opt.zero_grad()
    run.finish()                                    # COMPLETE; a crash leaves the run INCOMPLETE

The run directory, manifest and trace are traces/'s (FORMAT.md); no JAX is imported. The trace
schema is fixed by the first step (its metrics and, when discovered, its layers), so run.json is
written with a placeholder schema at init and completed then. A torch run is not replayable by
replay's engine (it records no program); it is a reference to compare JAX runs against.

A crashed (or finished) run continues with `resume=True` and `run.restore(model, opt)`: the
newest checkpoint (replay/torch/checkpoint.py, with torch's RNG state) is loaded and the steps
after it are recorded again; the trace keeps a re-recorded step only if it is bit-identical to
the one recorded before (else ResumeDivergedError, exit 1), so every resume is also a
determinism check, as the JAX side's.

Cost at a million steps: one record per step appended (8 bytes per tensor, the metrics and the
example hashes); nothing is kept in memory across steps but the last step's record. A resume
reads the manifest and the trace's tail, not the run.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

import torch

from replay.record import at_exit  # no JAX import either
from replay.record.options import RECORD_LEVELS  # no JAX import: replay.torch never starts JAX
from replay.torch.errors import TorchRecordError
from replay.torch.names import TensorNames, own_names
from replay.torch.step import Pending, Staged, StepRecording, split_metrics
from replay.torch.taps import Taps
from traces import Run, Schema
from traces.sketch import DEFAULT_WIDTH, check_width
from replay.record.manifest import git_commit
from traces.errors import TraceError

RECORDED_BY = "replay.torch"
# The trainer's metrics and their causal kinds (trainer/step.py METRICS), so the two runs' schemas agree.
KNOWN_KINDS = {"loss": "loss", "z_loss": "loss", "grad_norm": "backward", "lr": "update", "param_norm": "update"}
KINDS = ("state", "forward", "loss", "backward", "update")
_PENDING = Schema(examples_per_step=0, rng_words=0, metrics=())


def environment() -> dict:
    """What decides a torch run's bits: versions, device, and the float32 matmul settings."""
    env = {"framework": "torch", "torch": torch.__version__, "python": platform.python_version(),
           "platform": platform.platform(), "numpy": __import__("numpy").__version__,
           "float32_matmul_precision": torch.get_float32_matmul_precision(),
           "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
           "threads": torch.get_num_threads()}
    if "transformers" in sys.modules:
        env["transformers"] = sys.modules["transformers"].__version__
    if torch.cuda.is_available():
        env.update(device=torch.cuda.get_device_name(), cuda=torch.version.cuda,
                   cudnn_allow_tf32=torch.backends.cudnn.allow_tf32,
                   matmul_allow_tf32=torch.backends.cuda.matmul.allow_tf32)
    else:
        env["device"] = "cpu"
    return env


class TorchRun:
    """A torch run open for recording. Use `replay.torch.init` to make one."""

    def __init__(self, path: str | os.PathLike, *, config: Any = None, model: torch.nn.Module | None = None,
                 optimizer: Any = None, names: TensorNames | None = None, level: str = "layer",
                 metric_kinds: dict | None = None, sketch_width: int = DEFAULT_WIDTH, resume: bool = False):
        self.path = Path(path)
        if level not in RECORD_LEVELS:
            raise TorchRecordError(f"replay.torch.init(level={level!r}): must be one of {', '.join(RECORD_LEVELS)}")
        self.metric_kinds = {**KNOWN_KINDS, **dict(metric_kinds or {})}
        bad = {n: k for n, k in self.metric_kinds.items() if k not in KINDS}
        if bad:
            name, kind = next(iter(bad.items()))
            raise TorchRecordError(f"replay.torch.init(metric_kinds={{{name!r}: {kind!r}}}): a kind is one of "
                                   f"{', '.join(KINDS)}")
        if level == "layer" and model is None:
            raise TorchRecordError("replay.torch.init(level='layer') needs model=...: the layer level fingerprints "
                                   "its layers, gradients and parameters (or pass level='step')")
        try:
            config = json.loads(json.dumps(config))
        except (TypeError, ValueError) as e:
            raise TorchRecordError(f"replay.torch.init(config=...): the config must be JSON (dicts, lists, numbers, "
                                   f"strings): {e}") from None
        if not resume and self.path.exists() and (not self.path.is_dir() or any(self.path.iterdir())):
            what = " (it holds a run)" if (self.path / "run.json").exists() else ""
            raise TorchRecordError(f"{self.path}: exists and is not empty{what}; record into a new folder, or continue "
                                   "a crashed run with replay.torch.init(PATH, ..., resume=True)")
        names = None if model is None else (names or own_names(model))
        self.sketch_width = check_width(sketch_width) if sketch_width and level == "layer" else 0
        self.level = level
        self.next_step = 0
        self.finished = False
        self.schema: Schema | None = None
        self._in_step = False
        self._pending: Pending | None = None
        self._writer = None
        self._stepped = False  # a step was recorded by this process (restore must come before)
        self._taps = Taps(model, names, optimizer, self.sketch_width) if level == "layer" else None
        try:
            if resume:
                self._resume(config, names)
            else:
                self._run = Run.create(self.path, _PENDING, self._manifest(config, names))
        except BaseException:
            if self._taps is not None:
                self._taps.remove()
            raise
        at_exit.watch(self._close_at_exit)  # an exit without finish() or close() still writes the last step

    def _manifest(self, config: Any, names: TensorNames | None) -> dict:
        manifest = {"recorded_by": RECORDED_BY, "config": config, "environment": environment(),
                    "argv": list(sys.argv), "record": {"level": self.level, "metric_kinds": self.metric_kinds},
                    "names": None if names is None else names.to_json(), "checkpoints": []}
        code = git_commit(Path.cwd())
        if code is not None:
            manifest["git"] = code
        return manifest

    def _resume(self, config: Any, names: TensorNames | None) -> None:
        """Reopens the run for appending; everything that decides its records must be what it was
        recorded with (the schema itself is checked by the first step, as on any later step)."""
        if not (self.path / "run.json").is_file():
            raise TorchRecordError(f"{self.path}: holds no run to resume; record a new one with replay.torch.init(PATH)")
        try:
            self._run = Run.resume(self.path)
        except TraceError as e:
            raise TorchRecordError(f"replay.torch.init(resume=True): {e}") from None
        m = self._run.manifest
        recorded = {"recorded_by": m.get("recorded_by"), "record": m.get("record"), "names": m.get("names")}
        given = {"recorded_by": RECORDED_BY, "record": {"level": self.level, "metric_kinds": self.metric_kinds},
                 "names": None if names is None else names.to_json()}
        if config is not None:
            recorded["config"], given["config"] = m.get("config"), config
        schema = self._run.schema
        if schema.tensors:
            recorded["sketch_width"], given["sketch_width"] = schema.sketch_width, self.sketch_width
        differ = [k for k in given if given[k] != recorded[k]]
        if differ:
            self._run.close()
            what = {"recorded_by": "recorder (it was not recorded by replay.torch)", "record": "level or metric_kinds",
                    "names": "names= map", "config": "config", "sketch_width": "sketch_width"}[differ[0]]
            raise TorchRecordError(f"{self.path}: the run was recorded with another {what}; resume it with the "
                                   "arguments it was recorded with, or record a new run")
        if schema.examples_per_step:  # a step was recorded: later steps must fit its schema
            self.schema = schema
            self._writer = self._run.writer()
        self.next_step = self._run.trace.end if len(self._run.trace) else 0

    def restore(self, model: torch.nn.Module, optimizer: Any = None, step: int | None = None) -> int:
        """Loads checkpoint `step` (default: the newest) into `model` and `optimizer`, and torch's RNG
        state when the checkpoint holds it, and records from that step on; returns it. Call it
        before the first step of a resumed run: `for k in range(run.restore(model, opt), steps)`."""
        from replay.torch import checkpoint

        if self.finished or self._in_step or self._stepped:
            raise TorchRecordError("run.restore(...): restore a resumed run before its first recorded step")
        if step is None:
            step = checkpoint.latest(self.path)
            if step is None:
                raise TorchRecordError(f"{self.path}: has no checkpoint to resume from; record it again from step 0")
        self._check_start(step)
        checkpoint.load(self.path, step, model, optimizer, restore_rng=True)
        self.next_step = step
        return step

    def resumed_at(self, step: int) -> int:
        """Records from `step` on, the state entering it restored by the loop's own checkpointing
        (replay/torch/olmo_core.py: OLMo-core's), not replay.torch's; steps already in the trace
        from there on are recorded again and kept only if bit-identical. Returns `step`."""
        if self.finished or self._in_step or self._stepped:
            raise TorchRecordError("run.resumed_at(...): call it on a resumed run before its first recorded step")
        self._check_start(step)
        self.next_step = step
        return step

    def _check_start(self, step: int) -> None:
        end = self._run.trace.end if len(self._run.trace) else 0
        if step > end:
            raise TorchRecordError(f"{self.path}: checkpoint {step} is past the trace's end (step {end}); resume "
                                   f"from a checkpoint at or before it")

    # ---------------------------------------------------------------------------- steps

    def step(self, batch: Any) -> StepRecording:
        """`with run.step(batch) as rec:` records the step the body runs. `batch`: the step's
        examples on axis 0 (token rows [B, L+1] hash like the JAX trainer's; FORMAT.md). Pass the
        host copy: a batch on the GPU is copied back to be hashed, which waits for queued work."""
        return StepRecording(self, batch)

    def _begin(self, rec: StepRecording) -> None:
        if self.finished:
            raise TorchRecordError(f"{self.path}: the run is finished; a recorded step cannot run after run.finish()")
        if self._in_step:
            raise TorchRecordError("run.step: a step is already being recorded; steps do not nest")
        self._in_step = True
        if self._taps is not None:
            self._taps.begin()

    def _abort(self) -> None:
        self._in_step = False
        if self._taps is not None:
            self._taps.abort()

    def _end(self, rec: StepRecording) -> None:
        self._in_step = False
        self._stepped = True
        step = self.next_step
        tensors, summaries = [], []
        if self._taps is not None:
            tensors, summaries, _ = self._taps.end(step)
        B = len(rec.hashes)
        scalars, examples = split_metrics(step, rec.values, B)
        if self.schema is None:
            self._fix_schema(B, scalars, examples, tensors)
        else:
            self._check(step, B, scalars, examples, tensors)
        device = self._taps.device if self._taps is not None else torch.device("cpu")
        staged = Staged({"metrics": [v for _, v in scalars], "examples": [v for _, v in examples],
                         "lanes": [s[0] for s in summaries], "ss": [s[1] for s in summaries],
                         "sketches": [s[3] for s in summaries] if self.sketch_width else [],
                         "sketch_ss": [s[4] for s in summaries] if self.sketch_width else []}, device)
        pending = Pending(step=step, hashes=rec.hashes, rng=rec.rng, staged=staged, sizes=[s[2] for s in summaries],
                          second_calls=self._taps.second_calls() if self._taps is not None else {})
        self.flush()  # the previous step's record: its device work is done by now
        self._pending = pending
        self.next_step += 1

    def _fix_schema(self, B: int, scalars: list, examples: list, tensors: list) -> None:
        names = [n for n, _ in scalars]
        kinds = ["loss" if n == "loss" else self.metric_kinds.get(n, "update") for n in names]
        self.schema = Schema(examples_per_step=B, rng_words=2, metrics=tuple(zip(names, kinds)),
                             tensors=tuple(tensors), example_metrics=tuple(n for n, _ in examples),
                             sketch_width=self.sketch_width if tensors else 0)
        self._run.update_manifest(schema=self.schema.to_json())
        self._run.schema = self.schema
        self._writer = self._run.writer()

    def _check(self, step: int, B: int, scalars: list, examples: list, tensors: list) -> None:
        s = self.schema
        if B != s.examples_per_step:
            raise TorchRecordError(f"step {step}: the batch has {B} examples, the first had {s.examples_per_step}; a "
                                   "recorded run feeds the same number every step")
        got, want = [n for n, _ in scalars], list(s.metric_names)
        if got != want or tuple(n for n, _ in examples) != s.example_metrics:
            raise TorchRecordError(f"step {step}: rec.metrics got {', '.join(got)}, the run records {', '.join(want)} "
                                   "(and the same per-example metrics); record the same metrics every step")
        if tuple(tensors) != s.tensors:
            raise TorchRecordError(f"step {step}: the step's tensors differ from the first step's")

    def flush(self) -> None:
        """Writes the pending record (the last step's); called by the next step and by finish()."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._writer.append(pending.to_record(self.schema))

    # ---------------------------------------------------------------------------- the end

    def finish(self) -> None:
        """Writes the last record and marks the run complete (the only way a run becomes complete)."""
        if self.finished:
            return
        if self._in_step:
            raise TorchRecordError("run.finish() inside a recorded step; finish after the with block")
        try:
            self.flush()
        except BaseException:
            self.close()
            raise
        if self.schema is None:
            self._writer = self._run.writer()  # a run of no steps: an empty, complete trace
        self._run.finish()
        self._release()

    def close(self) -> None:
        """Stops recording without marking the run complete (it stays INCOMPLETE, resumable), its last
        finished step's record written first, as replay.init's runs write theirs. Called while an
        error is being handled (an `except` block, a `with` block left by one), a failure to write
        it is not raised: the first error stands."""
        if self.finished:
            return
        try:
            with contextlib.suppress(Exception) if sys.exc_info()[1] is not None else contextlib.nullcontext():
                self.flush()
        finally:
            self._pending = None
            self._run.close()
            self._release()

    def _close_at_exit(self) -> None:
        """At interpreter exit (replay/record/at_exit.py) a run still open is closed (the record of its
        last finished step, held until the next step, written) and stays incomplete; one stderr line
        says so."""
        if self.finished or self._pending is None:
            return
        step = self._pending.step
        self.close()
        sys.stderr.write(f"replay: {self.path} was not finished; at exit wrote the record of its last finished step "
                         f"{step}; it stays incomplete (resume it with replay.torch.init(..., resume=True))\n")

    def _release(self) -> None:
        self.finished = True
        if self._taps is not None:
            self._taps.remove()

    def __enter__(self) -> "TorchRun":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.finish() if exc_type is None else self.close()


def init(path: str | os.PathLike, *, config: Any = None, model: torch.nn.Module | None = None,
         optimizer: Any = None, names: TensorNames | None = None, level: str = "layer",
         metric_kinds: dict | None = None, sketch_width: int = DEFAULT_WIDTH, resume: bool = False) -> TorchRun:
    """Starts recording a torch loop into `path` (a new or empty folder), or continues one (resume).

    model: the module whose layers, gradients and parameters the layer level records (hooks are
      added now and removed by finish/close). optimizer: its state entering each step is recorded
      too. names: a TensorNames map (replay/torch/names.py; trainer/reference.py builds the JAX
      trainer's), so tensors are recorded under the JAX run's names and layouts; default: the
      model's own names. level: "layer" or "step" (metrics, example hashes, RNG only).
      metric_kinds: causal kind of a metric beyond the trainer's (loss, z_loss, grad_norm, lr,
      param_norm); default "update". sketch_width: the width of each tensor's distance sketch at
      the layer level (traces/sketch.py; a power of two, 0 for none): what lets bisect measure
      how far this run is from another without replaying it. resume: reopen the run at `path`
      (recorded with the same arguments; `config` is checked when given) to continue it: then
      `run.restore(model, optimizer)` loads its newest checkpoint and returns the step to go on
      from; the steps re-recorded after it must be bit-identical to those in the trace."""
    return TorchRun(path, config=config, model=model, optimizer=optimizer, names=names, level=level,
                    metric_kinds=metric_kinds, sketch_width=sketch_width, resume=resume)
