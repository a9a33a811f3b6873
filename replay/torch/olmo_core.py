"""Record OLMo-core's own `Trainer` (ai2-olmo-core) into a replay run: one callback.

    from replay.torch.olmo_core import ReplayCallback
    trainer_config = trainer_config.with_callback("replay", ReplayCallback("runs/olmo"))

Per step (the trainer's global step g is replay step g - 1) it records what replay.torch
records: the per-example hashes of `batch["input_ids"]` (equal to replay.torch's, and the JAX
side's, for equal rows), the CE loss as exact float32 bits (and the LR, grad norm and Z loss
when the trainer records them), the RNG hash, and per-module fingerprints of the train
module's model and optimizer (replay/torch/taps.py: parameters and optimizer state entering the
step, each leaf module's output, each gradient, each parameter after the update). The batch's
instance indices (`batch["index"]`, OLMo-core's numpy loaders) go to `RUN/olmo_core/instances.bin`
(int64 [steps, B], little-endian; `instances(RUN)` reads them): outside the trace, so two runs
that feed the same rows from different positions of a dataset (duplicate documents) do not
differ in their traces.

The manifest's "olmo_core" section holds, for every fit that recorded into the run (a
"segment": the first, and one per resume), the data loader's world size and rank, seed,
dataset fingerprint, global batch size and `batches_processed` when it started and ended,
and the checkpoint it resumed from: OLMo-core's saved state has a dataset fingerprint but no
world size, so only this says which world size fed which steps. `dataset_size` (the loader's
instances per epoch) is declared for `replay audit`.

Checkpoints are OLMo-core's own: no second copy of the state is written. A fit that loaded a
checkpoint (OLMo-core does that itself from `save_folder`) continues the replay run at the
checkpoint's step (`TorchRun.resumed_at`); steps the trace already holds from there on (a crash
after the checkpoint) are recorded again and kept only if bit-identical. With ai2-olmo-core 3.0.0
they never are: a resumed fit's torch RNG is one draw ahead of the uninterrupted run's (the
epoch's DataLoader iterator draws its seed after the restore), so the RNG hash differs, and the
recording stops there with one logged error, the trace up to the crash intact; the training
goes on (a recorder never ends a training). A fit that stopped at a checkpoint continues the
run. The checkpoints saved are listed in the manifest ("olmo_core"."checkpoints": step and path;
an async save's when the next step starts). The callback runs before OLMo-core's checkpointer
(priority 2): the checkpointer's save in post_train_batch logs and clears the step's metrics,
the loss among them, and the step's record must reach the trace before the save. replay.torch's
own checkpoints (replay/torch/checkpoint.py) are not written: a torch run is never replayed by
replay's engine (it records no program), so its checkpoints serve only a resume, which
OLMo-core's do, and `replay compare --eval`, which this run does not support.

Data parallel (OLMo-core's DDP or FSDP over torch.distributed, the data loader's world size
the process group's): every rank adds the callback with the same folder; rank 0 alone writes
the run. Each rank's loader feeds the columns [:, rank::world] of the global batch, so each
step every rank's example hashes and instance indices are gathered to rank 0 and put back in
the global order: the recorded examples are the global batch's, equal to a one-rank run's,
whatever the world size, and a resume on another world size continues the same run (the
manifest's segments say which world size fed which steps). The recorded metrics are reduced
over the ranks as OLMo-core reduces them for its logs (the CE loss averaged); the layers' and
gradients' fingerprints are rank 0's (its slice's activations), so a run on two ranks differs
from one on one rank in numbers, never in data. Tensor, context or pipeline parallel (a process
group larger than the data-parallel world) is refused in one line. Rank 0 failing to open the run
ends every rank with its reason (before the first step); an error in rank 0's recording of a step
stops the recording, logged, rather than end rank 0 alone while the others wait for it in a
collective. The gather and the reduction are in replay/torch/olmo_core_ranks.py.

Never imported by `import replay` or `import replay.torch`: it imports olmo_core.
"""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Optional

import numpy as np
import torch
import torch.distributed as dist
from olmo_core.train.callbacks import Callback

from replay.torch.errors import TorchRecordError
from replay.torch.hashing import example_hashes
from replay.torch.olmo_core_ranks import GlobalStep, data_parallel_group, gather_rows, reduce_metrics
from replay.torch.run import TorchRun
from traces.errors import ResumeDivergedError
from traces.sketch import DEFAULT_WIDTH
from importlib.metadata import PackageNotFoundError, version
from traces.run import read_manifest

log = logging.getLogger(__name__)

SECTION = "olmo_core"
INSTANCES = "olmo_core/instances.bin"
# OLMo-core metric (namespace, name) -> the trace's metric (replay.torch.run.KNOWN_KINDS gives its kind)
METRICS = ((("train", "CE loss"), "loss"), (("optim", "LR (group 0)"), "lr"),
           (("optim", "total grad norm"), "grad_norm"), (("train", "Z loss"), "z_loss"))


def instances(run_path: str | Path) -> np.ndarray | None:
    """int64 [steps, B]: the instance index of every recorded example, or None when the batches
    carried none. A crash can leave one step more than the trace holds (the trace writes a step's
    record when the next step ends)."""
    info = (read_manifest(Path(run_path)).get(SECTION) or {}).get("instances")
    f = Path(run_path) / INSTANCES
    if not info or not f.is_file():
        return None
    B = int(info["per_step"])
    data = np.fromfile(f, dtype="<i8")
    return data[: len(data) // B * B].reshape(-1, B)


def _loader_state(trainer: Any) -> dict:
    dl = trainer.data_loader
    dataset = getattr(dl, "dataset", None)
    return {"loader": type(dl).__name__, "world_size": int(dl.dp_world_size), "rank": int(dl.dp_rank),
            "seed": getattr(dl, "seed", None), "global_batch_size": int(dl.global_batch_size),
            "sequence_length": getattr(dataset, "sequence_length", None),
            "dataset_fingerprint": getattr(dataset, "fingerprint", None),
            "dataset_fingerprint_version": getattr(dataset, "fingerprint_version", None),
            "epoch": getattr(dl, "_epoch", None), "batches_processed": int(dl.batches_processed)}


@dataclass
class ReplayCallback(Callback):
    """Add to a `TrainerConfig`'s callbacks: `config.with_callback("replay", ReplayCallback(PATH))`
    (on every rank of a data-parallel fit, with the same PATH: rank 0 writes the run).

    path: the replay run's folder (new, or the run this training resumes). config: a JSON dict
      stored as the run's config (checked equal on a resume). level, sketch_width: replay.torch.init's."""

    path: str = ""
    config: Optional[dict] = None
    level: str = "layer"
    sketch_width: int = DEFAULT_WIDTH
    # Before the checkpointer (1): its save in post_train_batch logs the step's metrics, which
    # clears them, so the loss is read first, and the step's record reaches the checkpoint.
    priority: ClassVar[int] = 2

    def __post_init__(self):
        self._run: TorchRun | None = None
        self._rec = None
        self._index: torch.Tensor | None = None
        self._saved: list[dict] = []  # checkpoints saved since the manifest was last written (any thread)
        self._lock = threading.Lock()
        self._completed = False
        self._group = None  # the data-parallel process group when the loader's world size is above 1
        self._recording = False  # every rank alike: the collectives of a step run on all ranks or none
        self._failed = False  # rank 0's recording raised in a data-parallel fit: never touched again

    @property
    def _writer_rank(self) -> bool:
        return self._group is None or dist.get_rank(self._group) == 0

    # ------------------------------------------------------------------------------ the fit

    def pre_train(self):
        if not self.path:
            raise TorchRecordError("ReplayCallback(path): name the folder to record the run into")
        tr = self.trainer
        self._group, self._recording, self._failed = data_parallel_group(tr), False, False
        if self._group is not None and not self._writer_rank:
            self._open_elsewhere()
            return
        try:
            self._start()
        except BaseException as e:
            self._open_elsewhere(e)
            raise
        self._open_elsewhere(None)

    def _open_elsewhere(self, failed: BaseException | None = None) -> None:
        """Rank 0 opens the run; the other ranks learn whether it did, so none waits in a step's
        gather for a rank 0 that raised."""
        if self._group is None:
            self._recording = failed is None
            return
        box = [None if failed is None else f"{type(failed).__name__}: {failed}"]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self._group, 0), group=self._group)
        if box[0] is not None and not self._writer_rank:
            raise TorchRecordError(f"ReplayCallback: rank 0 could not open {self.path} ({box[0]})")
        self._recording = box[0] is None

    def _start(self) -> None:
        tr = self.trainer
        module, self._completed = tr.train_module, False
        resume = bool(tr.checkpoint_loaded) and (Path(self.path) / "run.json").is_file()
        self._run = TorchRun(self.path, config=self.config, model=module.model, optimizer=module.optim,
                             level=self.level, sketch_width=self.sketch_width, resume=resume)
        if resume:
            self._run.resumed_at(tr.global_step)
        elif tr.global_step != 0:
            self._run.close()
            raise TorchRecordError(f"{self.path}: the trainer starts at step {tr.global_step} (a checkpoint it "
                                   "loaded) and this folder holds no run to continue; record from step 0, or pass "
                                   "the folder the run before the checkpoint was recorded into")
        section = dict(self._run._run.manifest.get(SECTION) or {})
        section.update(olmo_core=_version(), checkpoints=section.get("checkpoints", []))
        segment = {"start_step": tr.global_step, **_loader_state(tr),
                   "resumed_from": tr.global_step if resume else None}
        section["segments"] = [s for s in section.get("segments", []) if s["start_step"] < tr.global_step] + [segment]
        fields = {SECTION: section}
        if hasattr(tr.data_loader, "total_size"):  # instances per epoch: audit's epochs
            fields["dataset_size"] = int(tr.data_loader.total_size)
        self._run._run.update_manifest(**fields)
        self._write_checkpoints()  # any saved before (a checkpointer of a higher priority saving at pre_train)

    def pre_step(self, batch: dict):
        if not self._recording:
            return
        hashes, index = self._global_rows(batch)  # on every rank, also after rank 0 stopped: a collective
        if self._open():
            self._alone(self._enter, hashes, index)

    def _enter(self, hashes: np.ndarray, index: torch.Tensor | None) -> None:
        run = self._run
        self._write_checkpoints()  # async saves finished since (their callback runs on another thread)
        if run.next_step != self.trainer.global_step - 1:
            raise TorchRecordError(f"trainer step {self.trainer.global_step} does not follow the recorded step "
                                   f"{run.next_step - 1}; every step of a recorded fit is recorded")
        self._index = index
        self._rec = GlobalStep(run, hashes)
        self._rec.__enter__()

    def _global_rows(self, batch: dict) -> tuple[np.ndarray, torch.Tensor | None]:
        hashes = example_hashes(batch["input_ids"])
        index = batch.get("index")
        index = None if index is None else torch.as_tensor(index).detach().to("cpu", torch.int64).reshape(-1)
        if self._group is None:
            return hashes, index
        return gather_rows(self._group, self.trainer, hashes, index)

    def post_train_batch(self):
        if not self._recording:
            return
        values = self._metrics()  # on every rank: reduced over the ranks
        rec, self._rec = self._rec, None
        if rec is not None:
            self._alone(self._leave, rec, values)

    def _alone(self, work, *args) -> None:
        """Rank 0's own part of a step. In a data-parallel fit its error stops the recording (logged,
        the run left incomplete) rather than end rank 0 alone: the other ranks, and rank 0's own
        error handling, would wait for it in a collective for ever."""
        if self._group is None:
            return work(*args)
        try:
            work(*args)
        except Exception as e:
            self._rec, was_open, self._failed = None, self._open(), True
            if was_open:
                try:
                    self._stop(f"{type(e).__name__}: {e}; the other ranks train on")
                except Exception as closing:  # the same full disk, say: said once, and the training goes on
                    log.error("replay: closing %s failed too: %s", self.path, closing)

    def _leave(self, rec: GlobalStep, values: dict) -> None:
        if "loss" not in values:  # a step in the trainer's steps_to_skip trains nothing
            rec.__exit__(RuntimeError, None, None)
            self._stop(f"step {self.trainer.global_step - 1} trained no batch (steps_to_skip?)")
            return
        rec.metrics(**values)
        try:
            rec.__exit__(None, None, None)  # writes the step before (a resume compares it with the trace)
        except ResumeDivergedError as e:
            self._stop(f"{e}. A resume by OLMo-core alone changes the RNG hash (its torch RNG is one draw ahead: "
                       "the epoch's DataLoader iterator draws its seed after the restore), so a fit resumed from a "
                       "checkpoint before the trace's end is recorded into a new folder")
            return
        self._write_instances()

    def _metrics(self) -> dict:
        """The step's metrics, each reduced over the data-parallel ranks by the reduce type it was
        recorded with (what OLMo-core logs); one rank's alone would be its slice's loss."""
        values = {}
        for (namespace, name), ours in METRICS:
            v = self.trainer.get_metric(name, namespace=namespace)
            if v is not None:
                values[ours] = v
        return values if self._group is None else reduce_metrics(self._group, self.trainer, values, METRICS)

    def post_checkpoint_saved(self, path):
        m = re.fullmatch(r"step(\d+)", Path(str(path)).name)
        with self._lock:  # an async save calls this from another thread: the main thread writes it down
            self._saved.append({"step": int(m.group(1)) if m else int(self.trainer.global_step), "path": str(path)})
        if self._open() and threading.current_thread() is threading.main_thread():
            self._run.flush()  # the trace reaches the checkpoint's step: a resume from it needs that
            self._write_checkpoints()

    def post_train(self):
        if self._open():
            self._run.flush()
            self._completed = True  # finished in close(), after the checkpointer's final save
            self._end_state = _loader_state(self.trainer)

    def on_error(self, exc: BaseException):
        if not self._open():
            return
        if self._rec is not None:
            rec, self._rec = self._rec, None
            rec.__exit__(type(exc), exc, None)
        try:
            self._run.flush()  # the last completed step's record: a checkpoint saved after it needs it to resume
            self._write_checkpoints()
        finally:
            self._run.close()

    def close(self):
        if not self._open():
            return
        try:
            self._write_checkpoints(end=self._end_state if self._completed else None)
        finally:
            self._run.finish() if self._completed else self._run.close()

    def _open(self) -> bool:
        return self._run is not None and not self._run.finished and not self._failed

    def _stop(self, why: str) -> None:
        """Stops recording (the run stays INCOMPLETE, its trace up to here intact); training goes on."""
        log.error("replay: %s; the recording into %s stops here, incomplete", why, self.path)
        self._run.close()

    # ------------------------------------------------------------------------------ the manifest and files

    def _write_checkpoints(self, end: dict | None = None) -> None:
        with self._lock:
            saved, self._saved = self._saved, []
        if not saved and end is None:
            return
        run = self._run._run
        section = dict(run.manifest.get(SECTION) or {})
        known = {c["step"] for c in section.get("checkpoints", [])}
        section["checkpoints"] = section.get("checkpoints", []) + [c for c in saved if c["step"] not in known]
        if end is not None and section.get("segments"):
            section["segments"][-1].update(end_step=self.trainer.global_step, epoch_end=end["epoch"],
                                           batches_processed_end=end["batches_processed"])
        run.update_manifest(**{SECTION: section})

    def _write_instances(self) -> None:
        """Step k's row at k * B * 8: the steps a resume records again are written over their rows."""
        index = self._index
        if index is None:
            return
        run = self._run._run
        section = run.manifest.get(SECTION) or {}
        if "instances" not in section:
            run.update_manifest(**{SECTION: {**section, "instances": {"per_step": int(index.numel()), "dtype": "<i8",
                                                                      "file": INSTANCES}}})
        f = Path(self.path) / INSTANCES
        f.parent.mkdir(exist_ok=True)
        with open(f, "r+b" if f.exists() else "wb") as fh:
            fh.seek((self._run.next_step - 1) * index.numel() * 8)
            fh.write(index.numpy().astype("<i8").tobytes())


def _version() -> str:
    try:
        return version("ai2-olmo-core")
    except PackageNotFoundError:
        return "unknown"
