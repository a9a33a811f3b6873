"""The recorded names of the SDC check tensors (traces/FORMAT.md "SDC checks"), written and read.

A run that records per-replica fingerprints names one trace tensor per microbatch and layer,
"replica/mbNN/LAYER" (NN zero-padded to the width of the last microbatch's index, at least two
digits), microbatch by microbatch, each microbatch's layers in execution order; the in-training
re-run check records "check/rerun" words whose bits are microbatch indices. The loop that records
them (trainer/sdc.py) and replay, which reads them back, share these helpers, so a trace is decoded
from its names alone: no model, config or loop code is needed to read one.
"""

from __future__ import annotations

REPLICA_PREFIX = "replica/"


def replica_name(mb: int, layer: str, n_microbatches: int) -> str:
    """The trace tensor holding microbatch `mb`'s gradient fingerprint of `layer`."""
    return f"{REPLICA_PREFIX}mb{mb:0{max(2, len(str(n_microbatches - 1)))}d}/{layer}"


def replica_layers(tensor_names: list[str] | tuple[str, ...], n_microbatches: int) -> list[str]:
    """The layers the trace's replica fingerprints cover, in recorded (execution) order: those of
    microbatch 0. [] when the trace records none (or none for `n_microbatches` microbatches)."""
    if n_microbatches < 1:
        return []
    prefix = replica_name(0, "", n_microbatches)
    return [name[len(prefix):] for name in tensor_names if name.startswith(prefix) and len(name) > len(prefix)]


def mask_microbatches(fingerprints: list[int]) -> list[int]:
    """The microbatches set in "check/rerun" values (one 64-bit int per word, bit b of word w is
    microbatch 64 * w + b)."""
    return [64 * w + b for w, value in enumerate(fingerprints) for b in range(64) if int(value) >> b & 1]
