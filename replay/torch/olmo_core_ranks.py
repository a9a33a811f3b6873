"""ReplayCallback's data-parallel side (replay/torch/olmo_core.py): which process group the global
batch is gathered over, the gather itself, and the metrics reduced over the ranks.

OLMo-core's numpy loaders give rank r of W the columns [:, r::W] of each global batch, so rank
r's row i is the global batch's row i * W + r: gathering every rank's example hashes and
instance indices to rank 0 and interleaving them gives back the global batch's, in its order,
whatever W. Cost per step: one gather of 16 bytes an example, and one all-reduce of a scalar for
each recorded metric the ranks do not share.

Imports olmo_core (through olmo_core.py only); never imported by `import replay.torch`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from replay.torch.errors import TorchRecordError
from replay.torch.run import TorchRun
from replay.torch.step import StepRecording, rng_words


class GlobalStep(StepRecording):
    """A step whose example hashes are given: the global batch's, gathered from every rank."""

    def __init__(self, run: TorchRun, hashes: np.ndarray):
        super().__init__(run, None)
        self._hashes = hashes

    def __enter__(self) -> "GlobalStep":
        self.hashes, self.rng = self._hashes, rng_words()
        self._run._begin(self)
        return self


def data_parallel_group(trainer: Any):
    """The process group to gather the global batch over (None: the loader feeds it whole), or a
    one-line refusal when the processes are not all data-parallel ranks of the loader."""
    world = int(trainer.data_loader.dp_world_size)
    ready = dist.is_available() and dist.is_initialized()
    if world == 1 and not (ready and dist.get_world_size() > 1):
        return None
    if not ready:
        raise TorchRecordError(f"ReplayCallback: the data loader's world size is {world} and torch.distributed is "
                               "not initialized; start the ranks as OLMo-core does (prepare_training_environment)")
    if world != dist.get_world_size():
        raise TorchRecordError(f"ReplayCallback records data-parallel runs: the data loader's world size is {world}, "
                               f"the process group's {dist.get_world_size()} (tensor, context or pipeline "
                               "parallel); record a run whose ranks are all data-parallel")
    return trainer.dp_process_group or dist.group.WORLD


def _device(trainer: Any) -> torch.device:
    from olmo_core.distributed.utils import backend_supports_cpu

    return torch.device("cpu") if backend_supports_cpu() else trainer.device


def gather_rows(group, trainer: Any, hashes: np.ndarray, index: torch.Tensor | None):
    """(example hashes, instance indices or None) of the global batch on the group's rank 0, in the
    global order; on the other ranks their own (unused)."""
    rows = torch.stack([torch.from_numpy(hashes.view(np.int64)),
                        index if index is not None else torch.full((len(hashes),), -1, dtype=torch.int64)], 1)
    rows = rows.to(_device(trainer))
    first = dist.get_rank(group) == 0
    parts = [torch.empty_like(rows) for _ in range(dist.get_world_size(group))] if first else None
    dist.gather(rows, parts, dst=dist.get_global_rank(group, 0), group=group)
    if parts is None:
        return hashes, index
    rows = torch.stack(parts, 1).reshape(-1, 2).cpu()  # [i, r] -> global row i * W + r
    return rows[:, 0].numpy().view(np.uint64).copy(), None if index is None else rows[:, 1].clone()


def reduce_metrics(group, trainer: Any, values: dict, names) -> dict:
    """The step's metrics, each reduced over the ranks by the reduce type it was recorded with, as
    OLMo-core reduces them for its logs (one rank's CE loss alone is its slice's). names: the
    ((namespace, name), ours) pairs `values` was read by; every rank calls this alike."""
    from olmo_core.train.common import ReduceType

    kinds = trainer._metrics_reduce_type
    world = dist.get_world_size(group)
    out = dict(values)
    for (namespace, name), ours in names:
        kind = kinds.get(f"{namespace}/{name}")
        if ours not in out or kind is None:  # None: the same on every rank (the LR, the clipped grad norm)
            continue
        v = out[ours].detach().to(_device(trainer), torch.float32).clone()
        if kind == ReduceType.l2_norm:
            v = v * v
        dist.all_reduce(v, op=dist.ReduceOp.MAX if kind == ReduceType.max else dist.ReduceOp.SUM, group=group)
        out[ours] = v / world if kind == ReduceType.mean else v.sqrt() if kind == ReduceType.l2_norm else v
    return out
