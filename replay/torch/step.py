"""`with run.step(batch) as rec:`: one recorded torch step, and its record until it is written.

Entering hashes the batch's examples and the RNG state on the host and summarises the state
entering the step; the body runs the user's forward, backward and optimizer step under the
model's hooks (replay/torch/taps.py); `rec.metrics(loss=loss, ...)` names the step's scalars
(and per-example [B] vectors); leaving collects what the hooks computed. The record stays on the
device until the next step has been queued (`Pending.to_record`), so the host never waits for
the device to record. A body that raises records nothing and leaves the step count as it was.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash

from replay.torch.errors import TorchRecordError
from replay.torch.hashing import batch_hash, example_hashes
from traces import Schema, StepRecord

_M32 = 0xFFFFFFFF


def rng_words() -> np.ndarray:
    """uint32[2]: xxh3_64 of torch's generator states (CPU, then each initialised CUDA device), low
    word first. Comparable only between torch runs: it says whether their RNG streams agree."""
    h = xxhash.xxh3_64()
    h.update(torch.get_rng_state().numpy().tobytes())
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for state in torch.cuda.get_rng_state_all():
            h.update(state.numpy().tobytes())
    v = h.intdigest()
    return np.array([v & _M32, v >> 32], np.uint32)


def _as_metric(name: str, value: Any) -> torch.Tensor:
    if isinstance(value, bool) or not isinstance(value, (int, float, torch.Tensor, np.floating, np.integer)):
        raise TorchRecordError(f"rec.metrics({name}=...): a metric is a number or a tensor, not {type(value).__name__}")
    if isinstance(value, torch.Tensor):
        if value.is_complex() or value.dtype == torch.bool:
            raise TorchRecordError(f"rec.metrics({name}=...): the tensor is {value.dtype}; a metric is real")
        return value.detach().to(torch.float32)  # exact for float32 (and bf16/f16); f64 rounds, as the JAX side
    if isinstance(value, np.floating):  # through numpy, not a Python float, so a float32's bits stay
        return torch.from_numpy(np.asarray(value, np.float32).reshape(()).copy())
    return torch.tensor(float(value), dtype=torch.float32)


class StepRecording:
    """The `rec` of `with run.step(batch) as rec:`."""

    def __init__(self, run: Any, batch: Any):
        self._run = run
        self._batch = batch
        self.values: dict[str, torch.Tensor] = {}
        self.hashes: np.ndarray | None = None
        self.rng: np.ndarray | None = None

    def __enter__(self) -> "StepRecording":
        self.hashes = example_hashes(self._batch)  # before the body could change the batch in place
        self.rng = rng_words()
        self._batch = None
        self._run._begin(self)
        return self

    def metrics(self, **values: Any) -> None:
        """The step's metrics: scalars (one named "loss" is required) as their exact float32 bits, and
        per-example float vectors of the batch's size ("example_loss" is recorded as example metric
        "loss"). Tensors stay on their device until the record is written a step later."""
        for name, value in values.items():
            if name in self.values:
                raise TorchRecordError(f"rec.metrics: {name!r} was given twice in one step")
            self.values[name] = _as_metric(name, value)

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None:
            self._run._abort()
            return False
        self._run._end(self)
        return False


class Staged:
    """Groups of same-dtype tensors on their way to the host without the host waiting for them.

    On CUDA each group is stacked on the device and copied into pinned host memory with a
    non-blocking copy, and an event is recorded after the copies: a plain `.cpu()` one step
    later would wait for everything queued since (the next step's work too), the event only
    for these copies, which finished long before. On the CPU the stacks are the host tensors."""

    def __init__(self, groups: dict[str, list[torch.Tensor]], device: torch.device):
        self.host: dict[str, torch.Tensor | None] = {}
        self.event = None
        for key, xs in groups.items():
            if not xs:
                self.host[key] = None
                continue
            stacked = torch.stack([x.to(device) for x in xs])
            if stacked.is_cuda:
                host = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True)
                host.copy_(stacked, non_blocking=True)
                stacked = host
            self.host[key] = stacked
        if device.type == "cuda":
            self.event = torch.cuda.Event()
            self.event.record()

    def wait(self) -> dict[str, np.ndarray | None]:
        if self.event is not None:
            self.event.synchronize()
        # As tensors to numpy, never through Python floats: NaN payloads and -0.0 are what is recorded.
        return {k: None if v is None else v.numpy() for k, v in self.host.items()}


@dataclass
class Pending:
    """A step's record, its tensors staged to the host (Staged) and not yet waited for."""

    step: int
    hashes: np.ndarray
    rng: np.ndarray
    staged: Staged  # "metrics" float32 [M], "examples" float32 [E, B], "lanes" int64 [T, 2], "ss" float64 [T]
    sizes: list[int]
    second_calls: dict  # layer -> every call's summary (checked equal on the host)

    def to_record(self, schema: Schema) -> StepRecord:
        for layer, calls in self.second_calls.items():
            fps = {tuple(int(v) for v in call[0].cpu()) for call in calls}
            if len(fps) > 1:
                raise TorchRecordError(
                    f"step {self.step}: layer {layer} ran {len(calls)} times with different outputs (microbatches, or a "
                    "module used twice); a recorded layer runs once per step: record one forward per step, or name "
                    "the layers to record with replay.torch.init(..., names=...)")
        host = self.staged.wait()
        fingerprints = rms = sketches = norms = None
        if schema.tensors:
            lanes = host["lanes"].astype(np.uint64)
            fingerprints = (lanes[:, 0] << np.uint64(32)) | lanes[:, 1]
            rms = np.sqrt(host["ss"] / np.maximum(np.asarray(self.sizes, np.float64), 1.0)).astype(np.float32)
            if schema.sketch_width:
                sketches = host["sketches"].astype(np.float32)
                norms = np.sqrt(host["sketch_ss"]).astype(np.float32)
        return StepRecord(step=self.step, rng=self.rng, batch_hash=batch_hash(self.hashes),
                          example_hashes=self.hashes, metrics=host["metrics"], fingerprints=fingerprints, rms=rms,
                          example_metrics=host["examples"] if schema.example_metrics else None,
                          sketches=sketches, norms=norms)


def split_metrics(step: int, values: dict[str, torch.Tensor], batch: int) -> tuple[list, list]:
    """([(name, scalar)] with "loss" first, [(example metric name, [B] vector)]) of one step's metrics."""
    if not values:
        raise TorchRecordError(f"step {step} recorded no metrics; call rec.metrics(loss=loss) inside the with block")
    scalars, examples = [], []
    for name, v in values.items():
        if v.dim() == 0:
            scalars.append((name, v))
        elif tuple(v.shape) == (batch,):
            examples.append((name.removeprefix("example_") or name, v))
        else:
            raise TorchRecordError(f"rec.metrics({name}=...): shape {list(v.shape)} is neither a scalar nor one value "
                                   f"per example ({batch}); record a scalar, or a [{batch}] vector")
    names = [n for n, _ in scalars]
    if "loss" not in names:
        raise TorchRecordError(f"step {step}: no scalar metric 'loss' (given: {', '.join(names) or 'none'}); "
                               "record the loss as rec.metrics(loss=loss)")
    i = names.index("loss")
    return [scalars[i]] + scalars[:i] + scalars[i + 1:], examples
