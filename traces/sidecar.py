"""The unsealed tail's index: a small sidecar file beside it (FORMAT.md, "Tail sidecar").

Opening a trace used to read the unsealed tail whole (up to a segment: ~200 MB at 1,024
examples a step) to learn where its frames lie and, for a scan, decode their fixed fields.
The writer now appends a fixed-size entry a record to `NNNNNNNNNNNN.tix`, 16 at a time, after
their frames (the frame's end and checksum, the record's fixed fields, its examples key: ~60
bytes a record, ~1 MB a full segment), so opening reads that instead, and only what lies past
its last entry (walked and decoded: at most the 15 records a kill kept out of it).

It is derived data and never trusted alone: every entry carries the crc32 of its bytes and its
own step, entries must end in order inside the segment file, and the last one's frame is read
and checked against it. A torn last entry (a kill mid-write: shorter than an entry) is
dropped; anything else that does not hold makes the reader use the good prefix and walk the
frames after it, or, with no usable prefix, walk the tail as before. Nothing recorded is lost:
the frames are the truth, the sidecar only says where they are. Sealing deletes it (a sealed
segment is opened by its seal and indexed by its `.idx`).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from traces.checksum import crc32
from traces.errors import TraceError
from traces.index import _MIX_SEED, StepColumns, record_prefix, splitmix64
from traces.schema import METRIC_DTYPES, Schema
from traces.segment import HEADER_SIZE

SIDECAR_SUFFIX = ".tix"
SIDECAR_MAGIC = b"RPLYTIX1"
SIDECAR_VERSION = 1
# magic, version, 0, schema digest, first step, entry size; then a crc32 of these 28 bytes
_HEAD = struct.Struct("<8sHHIQI")
SIDECAR_HEADER_SIZE = _HEAD.size + 4


class SidecarUnusable(TraceError):
    """Why a sidecar cannot stand in for its tail's frames (the reader walks them instead; were one
    ever to reach a user, it is damaged input like any trace error)."""


def sidecar_path(segment: Path) -> Path:
    return segment.with_suffix(SIDECAR_SUFFIX)


def entry_dtype(schema: Schema) -> np.dtype:
    bits = METRIC_DTYPES[schema.metric_dtype][1]
    return np.dtype([("step", "<u8"), ("end", "<u8"), ("frame_crc", "<u4"), ("flags", "u1"),
                     ("rng", "<u4", (schema.rng_words,)), ("batch_hash", "<u8"),
                     ("metric_bits", bits, (len(schema.metrics),)), ("examples_key", "<u8"), ("crc", "<u4")])


def header(schema: Schema, first_step: int) -> bytes:
    head = _HEAD.pack(SIDECAR_MAGIC, SIDECAR_VERSION, 0, schema.digest(), first_step, entry_dtype(schema).itemsize)
    return head + struct.pack("<I", crc32(head))


class EntryMaker:
    """Encodes a record's sidecar entry from its raw bytes (what the writer just framed)."""

    def __init__(self, schema: Schema):
        self.dtype, self.prefix = entry_dtype(schema), record_prefix(schema)
        self._mix = splitmix64(np.arange(schema.examples_per_step, dtype=np.uint64) + np.uint64(_MIX_SEED)) | np.uint64(1)
        # Per append on the loop's thread, so plain byte slices, not numpy records (~3 us, not ~11)
        self._fixed = slice(8, self.prefix.fields["example_hashes"][1])  # flags, rng, batch_hash: copied as they are
        self._hashes_at, self._B = self.prefix.fields["example_hashes"][1], schema.examples_per_step
        self._metrics = slice(self.prefix.fields["metrics"][1], self.prefix.itemsize)

    def __call__(self, raw, step: int, end: int, frame_crc: int) -> bytes:
        key = np.frombuffer(raw, "<u8", self._B, self._hashes_at)[None]
        return self.finish([self.head(raw, step, end, frame_crc)], key)

    def head(self, raw, step: int, end: int, frame_crc: int) -> bytes:
        """The entry's bytes before its examples key (what is cheap a record at a time)."""
        return b"".join((struct.pack("<QQI", step, end, frame_crc), bytes(raw[self._fixed]), bytes(raw[self._metrics])))

    def finish(self, heads: list[bytes], hashes_nxB: np.ndarray) -> bytes:
        """Whole entries of `heads`, given their records' example hashes (one numpy pass for all)."""
        keys = (hashes_nxB * self._mix).sum(axis=1, dtype=np.uint64).tolist()
        out = []
        for head, key in zip(heads, keys):
            body = head + struct.pack("<Q", key)
            out.append(body + struct.pack("<I", crc32(body)))
        return b"".join(out)

    def from_columns(self, cols: StepColumns) -> bytes:
        """Every entry of a segment's columns at once (a resumed writer rewrites the sidecar)."""
        n = len(cols)
        e = np.zeros(n, self.dtype)
        e["step"] = np.arange(cols.first_step, cols.first_step + n, dtype=np.uint64)
        e["end"] = cols.offsets[1:]
        for name in ("frame_crc", "flags", "rng", "batch_hash", "metric_bits", "examples_key"):
            e[name] = getattr(cols, name)
        raw = bytearray(e.tobytes())
        size = self.dtype.itemsize
        for k in range(n):
            raw[k * size + size - 4 : (k + 1) * size] = struct.pack("<I", crc32(raw[k * size : (k + 1) * size - 4]))
        return bytes(raw)


@dataclass
class Sidecar:
    """The trusted prefix of a sidecar: `count` records, their columns (offsets[-1] = `end`, where
    the frames it vouches for end), and `problem`: why entries past the prefix were not trusted
    (None when all were, or only a torn last entry was dropped)."""

    columns: StepColumns
    problem: str | None
    entries: bytes = b""  # the trusted entries' bytes

    def extended(self, schema: Schema, more: bytes) -> "Sidecar":
        """With `more` entries (EntryMaker's, for the frames walked past the last entry)."""
        return Sidecar(_columns(schema, self.columns.first_step, self.entries + more), self.problem, self.entries + more)

    @property
    def count(self) -> int:
        return len(self.columns)

    @property
    def end(self) -> int:
        return int(self.columns.offsets[-1])


def parse(data: bytes, schema: Schema, first_step: int, segment_size: int) -> Sidecar:
    """The sidecar's trusted prefix; raises SidecarUnusable when its header does not hold."""
    if len(data) < SIDECAR_HEADER_SIZE or data[:8] != SIDECAR_MAGIC:
        raise SidecarUnusable("not a tail sidecar (bad magic or too short)")
    if struct.unpack_from("<I", data, _HEAD.size)[0] != crc32(data[: _HEAD.size]):
        raise SidecarUnusable("its header checksum does not match")
    _, version, _, digest, first, size = _HEAD.unpack_from(data)
    dtype = entry_dtype(schema)
    if version != SIDECAR_VERSION:
        raise SidecarUnusable(f"sidecar version {version} (this replay reads {SIDECAR_VERSION})")
    if (digest, first, size) != (schema.digest(), first_step, dtype.itemsize):
        raise SidecarUnusable("it describes another segment (schema, first step or entry size differ)")
    body = memoryview(data)[SIDECAR_HEADER_SIZE:]
    n, torn = divmod(len(body), dtype.itemsize)
    entries = np.frombuffer(body, dtype, n)
    problem = None
    good = n
    crcs = [crc32(body[k * size : (k + 1) * size - 4]) for k in range(n)]
    bad = np.flatnonzero((np.array(crcs, np.uint32) != entries["crc"])
                         | (entries["step"] != np.arange(first_step, first_step + n, dtype=np.uint64)))
    if bad.size:
        good, problem = int(bad[0]), f"entry {int(bad[0])} fails its checksum or names another step"
    ends = np.r_[np.uint64(HEADER_SIZE), entries["end"][:good]].astype(np.uint64)
    wrong = np.flatnonzero((ends[1:] <= ends[:-1]) | (ends[1:] > np.uint64(segment_size)))
    if wrong.size:
        good, problem = int(wrong[0]), problem or f"entry {int(wrong[0])} ends outside its segment's frames"
    kept = bytes(body[: good * size])
    return Sidecar(_columns(schema, first_step, kept), problem, kept)


def _columns(schema: Schema, first_step: int, entries: bytes) -> StepColumns:
    e = np.frombuffer(entries, entry_dtype(schema))
    ends = np.r_[np.uint64(HEADER_SIZE), e["end"]].astype(np.uint64)
    return StepColumns(first_step, ends, e["frame_crc"].copy(), e["flags"].copy(), e["rng"].copy(),
                       e["batch_hash"].copy(), e["metric_bits"].copy(), e["examples_key"].copy())


def read(segment: Path, schema: Schema, first_step: int, segment_size: int) -> Sidecar | None:
    """The segment's sidecar, None when it has none (a run recorded before them, or a writer
    killed before it wrote one, or before its header: an empty file); raises SidecarUnusable when its header does not hold."""
    try:
        data = sidecar_path(segment).read_bytes()  # a Path or a RemotePath (traces/storage)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise SidecarUnusable(f"cannot be read ({e.strerror or e})") from None
    if not data:
        # A writer killed between creating the file and its header's one write() (measured once in a
        # random-kill test): it vouches for nothing yet, as if it were not there; nothing is damaged.
        return None
    return parse(data, schema, first_step, segment_size)


def rewrite(segment: Path, schema: Schema, cols: StepColumns) -> None:
    """Writes the sidecar of a tail whose records are `cols` (atomically: tmp, rename)."""
    path = sidecar_path(segment)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(header(schema, cols.first_step) + EntryMaker(schema).from_columns(cols))
    os.replace(tmp, path)
