"""The deterministic data source: token sources and batches by step.

The batch at step k is a pure function of (token source, data seed, k, global batch
size). Nothing here holds iterator state or looks at devices, so a resumed run, a
replay on a workstation and a run on a different number of hosts all read the same
examples in the same global order. Each host loads only its contiguous slice of
the global batch; concatenating the hosts' slices in process order gives the batch a
single host would load. (That is the default `global` sampler; `contiguous-per-host`
reproduces a loader bug whose batches depend on the host count: trainer/order.py.)

Layout: a source (trainer/token_source.py) is a flat stream of token ids. Example e is the
window tokens[e*(L+1) : (e+1)*(L+1)] for seq_len L (inputs are the first L tokens,
targets the last L), so examples never overlap and n_examples = n_tokens // (L+1).
Global example slot g = k*B + j lives in epoch g // n_examples at position
g % n_examples, and its id is that epoch's permutation at that position; a batch
that crosses an epoch boundary therefore takes the end of one permutation and the
start of the next. The permutations are lazy (a keyed Feistel network, trainer/order.py):
a batch's ids cost O(B) at any dataset size.

A bug-report bundle (replay/bundle/__init__.py) carries only the rows of the examples its steps
read: `ExampleSource` serves them by example id with the original source's size, so the
permutations, and with them every batch's ids, are the same as with the full source.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import NamedTuple

import numpy as np

from replay.record.hashing import batch_hash  # noqa: F401 (the one definition; trainer.data.batch_hash)
from replay.record.hashing import leaf_hashes, little_endian_rows
from trainer import order
import zipfile
from trainer.errors import DataError  # noqa: F401 - trainer.data.DataError, as its importers know it
from trainer.token_source import (  # noqa: F401 - trainer.data's names, as its importers know them
    DTYPES, EMBEDDED_DEFAULT, EMBEDDED_PREFIX, TokenSource, _embedded_tokens, open_source, write_token_file,
)


# --------------------------------------------------------------------------- bundled examples

EXAMPLES_FORMAT = "replay.examples.v1"


@dataclasses.dataclass(frozen=True, eq=False)
class ExampleSource(TokenSource):
    """Only some examples of a token source, keyed by example id: what a bug-report bundle
    carries (replay/bundle/__init__.py) so that its steps replay without the dataset.

    It keeps the original source's n_tokens, so n_examples and therefore every epoch
    permutation and every batch's example ids are unchanged; it serves the rows of the
    examples it holds and refuses any other id with a DataError. `fingerprint()` is the
    fingerprint of the source the rows were cut from, checked when the bundle was packed
    (the replay checks every row again through the recorded per-example hashes).
    """

    example_ids: np.ndarray | None = None  # int64 (n,), ascending
    rows: np.ndarray | None = None  # (n, seq_len + 1) in the source dtype
    seq_len: int = 0
    total_tokens: int = 0  # n_tokens of the original source
    source_fingerprint: str = ""

    @property
    def n_tokens(self) -> int:
        return self.total_tokens

    @functools.cached_property
    def max_id(self) -> int:
        return int(self.rows.max()) if self.rows.size else 0

    def fingerprint(self) -> str:
        return self.source_fingerprint

    def describe(self) -> dict:
        return {"kind": "examples", "path": self.path, "dtype": self.dtype, "n_tokens": self.n_tokens,
                "fingerprint": self.fingerprint(), "examples": int(self.example_ids.size)}

    def validate(self, vocab_size: int) -> None:
        if self.max_id >= vocab_size:
            bad = np.argwhere(self.rows >= vocab_size)[0]
            raise DataError(f"{self.path}: token id {int(self.rows[tuple(bad)])} of example "
                            f"{int(self.example_ids[bad[0]])} is >= the model's vocab_size {vocab_size}")

    def rows_of(self, ids_B: np.ndarray, seq_len: int) -> np.ndarray:
        """The rows of examples `ids_B` as int32 (B, seq_len + 1)."""
        if seq_len != self.seq_len:
            raise DataError(f"{self.path}: holds examples of seq_len {self.seq_len}, not {seq_len}")
        at_B = np.searchsorted(self.example_ids, ids_B)
        found_B = (at_B < self.example_ids.size) & (self.example_ids[np.minimum(at_B, self.example_ids.size - 1)] == ids_B)
        if not found_B.all():
            missing = ids_B[~found_B]
            raise DataError(f"{self.path}: example {int(missing[0])} is not among the {self.example_ids.size} examples "
                            f"this bundle carries ({missing.size} of the batch are missing); replay only the steps the "
                            "bundle covers, or pass --data PATH to the full token file")
        return np.asarray(self.rows[at_B], dtype=np.int32)


def write_example_file(path, source: TokenSource, ids, seq_len: int) -> dict:
    """Writes the rows of examples `ids` of `source` to `path` (.npz); returns its metadata."""
    ids_N = np.unique(np.asarray(ids, dtype=np.int64).reshape(-1))
    rows = load_batch(source, ids_N, seq_len).astype(DTYPES[source.dtype])
    meta = {"format": EXAMPLES_FORMAT, "source": source.path, "source_kind": source.kind, "dtype": source.dtype,
            "n_tokens": source.n_tokens, "seq_len": int(seq_len), "fingerprint": source.fingerprint(),
            "examples": int(ids_N.size)}
    with open(path, "wb") as f:
        np.savez(f, ids=ids_N, rows=rows, meta=np.frombuffer(json.dumps(meta, sort_keys=True).encode(), np.uint8))
    return meta


def open_example_file(path, vocab_size: int | None = None) -> ExampleSource:
    """The examples `write_example_file` wrote, as a token source; DataError when unreadable."""
    path = os.fspath(path)
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(z["meta"].tobytes().decode())
            ids, rows = z["ids"], z["rows"]
    except FileNotFoundError:
        raise DataError(f"{path}: bundled examples not found; the bundle is incomplete") from None
    except (OSError, KeyError, ValueError, zipfile.BadZipFile, UnicodeDecodeError) as e:
        raise DataError(f"{path}: bundled examples are unreadable ({e.__class__.__name__}); the bundle is damaged") from None
    if not isinstance(meta, dict) or meta.get("format") != EXAMPLES_FORMAT:
        raise DataError(f"{path}: not a {EXAMPLES_FORMAT} example file; upgrade replay or re-pack the bundle")
    try:
        width, n_tokens, fingerprint = int(meta["seq_len"]) + 1, int(meta["n_tokens"]), str(meta["fingerprint"])
    except (KeyError, TypeError, ValueError):
        width = n_tokens = fingerprint = None
    if width is None or ids.ndim != 1 or rows.shape != (ids.size, width) or meta.get("dtype") not in DTYPES or (
            ids.size > 1 and not (np.diff(ids) > 0).all()):
        raise DataError(f"{path}: bundled examples are inconsistent (metadata, shapes or order); the bundle is damaged")
    source = ExampleSource(
        "examples", path, meta["dtype"], np.empty(0, DTYPES[meta["dtype"]]), vocab_size,
        example_ids=ids.astype(np.int64), rows=rows, seq_len=width - 1, total_tokens=n_tokens,
        source_fingerprint=fingerprint,
    )
    if vocab_size is not None:
        source.validate(vocab_size)
    return source


# --------------------------------------------------------------------------- order

# The data order lives in trainer/order.py (a lazy keyed permutation per epoch, and the samplers);
# these names are its public face here.
SAMPLERS = order.SAMPLERS
epoch_permutation = order.epoch_permutation
example_ids = order.example_ids
host_slice = order.host_slice


# --------------------------------------------------------------------------- loading


def load_batch(source: TokenSource, ids, seq_len: int) -> np.ndarray:
    """Examples `ids` as int32 (B, seq_len + 1): each row is one window of the source."""
    ids_B = np.asarray(ids, dtype=np.int64).reshape(-1)
    if isinstance(source, ExampleSource):
        return source.rows_of(ids_B, seq_len)
    width = seq_len + 1
    n_examples = source.n_tokens // width
    if ids_B.size and (ids_B.min() < 0 or ids_B.max() >= n_examples):
        raise DataError(f"example ids must be in [0, {n_examples}) for {source.path}, got {ids_B}")
    offsets_BxL1 = ids_B[:, None] * width + np.arange(width, dtype=np.int64)
    return np.asarray(source.tokens[offsets_BxL1], dtype=np.int32)


def example_hashes(tokens_BxL1: np.ndarray) -> np.ndarray:
    """xxh3_64 of each example's bytes: uint64 (B,).

    xxhash sees bytes only, so the dtype and row shape seed the hash: the same bytes
    as another dtype or length must not collide. The one definition is replay's (a user loop
    feeding the same rows gets the same hashes).
    """
    return leaf_hashes([("batch", little_endian_rows(np.asarray(tokens_BxL1)))])


class Batch(NamedTuple):
    inputs_BxL: np.ndarray  # int32, this host's rows
    targets_BxL: np.ndarray  # int32, inputs shifted by one
    example_hashes: np.ndarray  # uint64 (B_local,), of the (L+1)-token rows
    ids: np.ndarray  # int64 (B_local,), global example ids


@dataclasses.dataclass(frozen=True, eq=False)
class Batcher:
    """Batches by step for one process. Under the default `global` sampler changing
    process_count keeps every batch; `contiguous-per-host` (trainer/order.py) does not."""

    source: TokenSource
    seq_len: int
    global_batch: int
    data_seed: int
    process_index: int = 0
    process_count: int = 1
    sampler: str = "global"  # one of SAMPLERS (config: data.sampler)

    def __post_init__(self):
        if self.seq_len < 1:
            raise DataError(f"seq_len must be at least 1, got {self.seq_len}")
        order.check_seed(self.data_seed)
        if self.global_batch < 1:
            raise DataError(f"global batch must be at least 1, got {self.global_batch}")
        if self.sampler not in SAMPLERS:
            raise DataError(f"unknown sampler {self.sampler!r}; use one of {', '.join(SAMPLERS)}")
        if self.n_examples < self.global_batch:
            raise DataError(
                f"{self.source.path} has {self.source.n_tokens} tokens = {self.n_examples} "
                f"examples of seq_len+1={self.seq_len + 1}, fewer than one global batch of "
                f"{self.global_batch}; use more data or a smaller global batch or seq_len"
            )
        host_slice(self.global_batch, self.process_index, self.process_count)

    @property
    def n_examples(self) -> int:
        return self.source.n_tokens // (self.seq_len + 1)

    @property
    def local_slice(self) -> slice:
        return host_slice(self.global_batch, self.process_index, self.process_count)

    def host_ids(self, step: int, process_index: int) -> np.ndarray:
        """The global example ids that process `process_index` loads at `step`, in batch order."""
        if self.sampler == "global":
            return self.global_ids(step)[host_slice(self.global_batch, process_index, self.process_count)]
        return order.contiguous_per_host_ids(self.n_examples, self.data_seed, step, self.global_batch,
                                             process_index, self.process_count)

    def global_ids(self, step: int) -> np.ndarray:
        """The ids of the whole global batch, every host's slice in process order: int64 (B,)."""
        if self.sampler == "global":
            return example_ids(self.n_examples, self.data_seed, step, self.global_batch)
        return np.concatenate([self.host_ids(step, p) for p in range(self.process_count)])

    def batch_at(self, step: int) -> Batch:
        """This process's slice of the batch at `step`."""
        ids_B = self.host_ids(step, self.process_index)
        tokens_BxL1 = load_batch(self.source, ids_B, self.seq_len)
        return Batch(
            np.ascontiguousarray(tokens_BxL1[:, :-1]),
            np.ascontiguousarray(tokens_BxL1[:, 1:]),
            example_hashes(tokens_BxL1),
            ids_B,
        )

    def global_example_hashes(self, step: int) -> np.ndarray:
        """Per-example hashes of the whole global batch, in global order.

        Reads every host's rows from the source (B/P times this host's I/O), so any
        process can record or check the global hashes without a collective.
        """
        return example_hashes(load_batch(self.source, self.global_ids(step), self.seq_len))
