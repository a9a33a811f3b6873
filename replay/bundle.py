"""Bug-report bundles: one file that replays steps A..B of a run anywhere (`replay pack`).

A bundle is a run folder cut down to what replaying steps A..B needs, with a bug report,
in one checksummed, zstd-compressed file. `replay run/show/bisect` accept it wherever they
accept a run (`open_run`), and `replay unpack FILE DIR` writes the folder out.

File layout, bundle format_version 1 (integers little-endian):

    offset size
     0      8   magic b"RPLYPACK"
     8      2   u16 bundle format_version
    10      2   u16 header size in bytes (64 in version 1)
    12      4   u32 crc32 of bytes 0..11
                (these 16 bytes keep their layout in every version, so any reader can tell
                a bundle, a damaged one and one from a newer version apart)
    16      8   u64 payload size in bytes
    24     32   sha256 of the payload: the checksum of the bundle's whole content
    56      4   u32 flags: bit 0 = lite (no checkpoint and no batch data)
    60      4   u32 crc32 of bytes 0..59
    64      -   payload: one zstd frame (with its content checksum) holding a POSIX tar archive
                of a run folder, members in this order:

    run.json           the run's manifest; "checkpoints" lists only the bundled checkpoint, and
                       "bundle" describes the bundle (below)
    COMPLETE           {"end": B + 1}: the bundle is a complete run of steps C..B
    REPORT.md          the bug report, for people: the run, its environment, the steps, their
                       metrics, the finding of --from-bisect/--spike, and the replay command
    trace/*.seg        the trace records of steps C..B (A..B with --lite), re-written as a trace
                       that starts at C (traces/FORMAT.md); every record is bit-identical
    data/examples.npz  the token rows of every example the replay from C to B feeds, keyed by
                       example id, with the source's size, so the permutation (and every
                       batch's example ids) are unchanged: trainer.data.ExampleSource.
                       Not with --lite.
    checkpoints/C/...  the orbax checkpoint C, the newest at or before A. Not with --lite.

manifest["bundle"] = {"format_version", "lite", "steps": [A, B], "checkpoint": C or null,
"trace": [first, last], "examples": "data/examples.npz" or null, "example_count",
"packed_from", "source_steps": [first, last] of the packed run, "finding": null or a summary}.
The manifest's "config", "environment", "data" (with the original fingerprint) and
"program_hash" are the run's own, so a bundle compares with the run like the run itself.

Tar members carry zeroed times and owners and are written in a fixed order. Reading checks,
in order: the magic ("not a bundle"), the prefix crc (a damaged header), the version (newer:
upgrade), the version-1 header crc, the file size against the payload size (truncated, or
trailing bytes), the payload's sha256 (any changed byte); then, unpacking, the zstd frame
checksum and that every member is a plain file or folder inside the bundle. The unpacked
folder is opened with traces.Run, so the trace's checksums and the replay's verification are
those of any run. Pack itself checks that the bundled rows rebuild every recorded batch of
steps C..B (through the run's fault plan, as the replay feeds them) before writing anything.
"""

from __future__ import annotations

import atexit
import hashlib
import io
import math
import os
import shutil
import struct
import tarfile
import tempfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Iterable

import numpy as np
import zstandard

import traces
from traces import NewerFormatError, NotARunError, Run, RunNotFoundError, TraceCorruptError
from traces.run import COMPLETE, MANIFEST, TRACE_DIR, write_json_atomic

FORMAT_VERSION = 1
MAGIC = b"RPLYPACK"
_PREFIX = struct.Struct("<8sHH")  # magic, format_version, header size; then u32 crc32 of these 12 bytes
_V1 = struct.Struct("<Q32sI")  # payload size, sha256, flags; then u32 crc32 of bytes 0..59
PREFIX_SIZE = _PREFIX.size + 4
HEADER_SIZE = PREFIX_SIZE + _V1.size + 4
FLAG_LITE = 1
SUFFIX = ".rpk"
REPORT = "REPORT.md"
EXAMPLES = "data/examples.npz"
ZSTD_LEVEL = 9
FINDING_ROWS = 12  # fields of the divergent step listed in REPORT.md
MAX_TABLE_ROWS = 60  # REPORT.md metric rows; longer ranges are sampled evenly (A and B always shown)
_CHUNK = 1 << 20


class NotABundleError(NotARunError):
    """The path is a file, but not a bundle."""


class BundleCorruptError(TraceCorruptError):
    """The bundle's bytes fail their checksum or structure."""


class NewerBundleError(NewerFormatError):
    """Written by a newer bundle format_version."""


class PackError(traces.TraceError):
    """What was asked cannot be packed (a range, a missing checkpoint or data, an existing file)."""


class PackNotBuilt(PackError):
    """--spike before `replay spike` exists."""


# ------------------------------------------------------------------------------ reading


@dataclass(frozen=True)
class Header:
    format_version: int
    payload_size: int
    sha256: bytes
    lite: bool


def _encode_header(payload_size: int, digest: bytes, lite: bool) -> bytes:
    head = _PREFIX.pack(MAGIC, FORMAT_VERSION, HEADER_SIZE)
    head += struct.pack("<I", zlib.crc32(head))
    head += _V1.pack(payload_size, digest, FLAG_LITE if lite else 0)
    return head + struct.pack("<I", zlib.crc32(head))


def is_bundle(path: str | os.PathLike) -> bool:
    """A file that starts with the bundle magic (damaged or not)."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            return p.is_file() and f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


def read_header(path: str | os.PathLike) -> Header:
    """The verified header; raises a one-line error for every way a file fails to be a bundle."""
    p = Path(path)
    if not p.exists():
        raise RunNotFoundError(f"{p}: no such file or run; check the path")
    if p.is_dir():
        raise NotABundleError(f"{p}: is a folder, not a bundle; a bundle is the file `replay pack` writes")
    size = p.stat().st_size
    with open(p, "rb") as f:
        data = f.read(HEADER_SIZE)
    if not data or (len(data) < len(MAGIC) and not MAGIC.startswith(data)) or (len(data) >= len(MAGIC) and data[:8] != MAGIC):
        raise NotABundleError(f"{p}: not a replay bundle (it does not start with {MAGIC.decode()}) and not a run folder; "
                              "pass a file written by `replay pack`, or a run directory")
    if len(data) < PREFIX_SIZE:
        raise BundleCorruptError(f"{p}: truncated bundle: {size} bytes, shorter than its header; get a complete copy", str(p))
    magic, version, header_size = _PREFIX.unpack_from(data)
    if struct.unpack_from("<I", data, _PREFIX.size)[0] != zlib.crc32(data[: _PREFIX.size]):
        raise BundleCorruptError(f"{p}: damaged bundle: its header checksum does not match; get a fresh copy", str(p))
    if version > FORMAT_VERSION:
        raise NewerBundleError(f"{p}: written by bundle format_version {version}, this replay reads up to "
                               f"{FORMAT_VERSION}: upgrade replay (pip install -U replay-jax)")
    if version < 1 or header_size != HEADER_SIZE:
        raise BundleCorruptError(f"{p}: damaged bundle: header says version {version}, size {header_size}", str(p))
    if len(data) < HEADER_SIZE:
        raise BundleCorruptError(f"{p}: truncated bundle: {size} bytes, shorter than its header; get a complete copy", str(p))
    if struct.unpack_from("<I", data, HEADER_SIZE - 4)[0] != zlib.crc32(data[: HEADER_SIZE - 4]):
        raise BundleCorruptError(f"{p}: damaged bundle: its header checksum does not match; get a fresh copy", str(p))
    payload_size, digest, flags = _V1.unpack_from(data, PREFIX_SIZE)
    if flags & ~FLAG_LITE:
        raise BundleCorruptError(f"{p}: damaged bundle: unknown header flags {flags:#x}", str(p))
    want = HEADER_SIZE + payload_size
    if size < want:
        raise BundleCorruptError(f"{p}: truncated bundle: {size} of {want} bytes ({want - size} missing); the copy is "
                                 "incomplete, get the whole file again", str(p))
    if size > want:
        raise BundleCorruptError(f"{p}: damaged bundle: {size - want} bytes after its end ({want} bytes); "
                                 "get a fresh copy", str(p))
    return Header(version, payload_size, digest, bool(flags & FLAG_LITE))


def verify(path: str | os.PathLike) -> Header:
    """The header, after checking the sha256 of the whole payload."""
    header = read_header(path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(HEADER_SIZE)
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    if h.digest() != header.sha256:
        raise BundleCorruptError(f"{path}: damaged bundle: content checksum mismatch (sha256 {h.hexdigest()[:12]} != "
                                 f"{header.sha256.hex()[:12]}): bytes changed since it was packed; get a fresh copy",
                                 str(path))
    return header


class _Bounded(io.RawIOBase):
    """The payload of an open bundle file, as a readable stream."""

    def __init__(self, f, size: int):
        self._f, self._left = f, size

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = self._f.readinto(memoryview(b)[: min(len(b), self._left)]) if self._left else 0
        self._left -= n
        return n


def _member_path(dest: Path, name: str, src: Path) -> Path:
    parts = PurePosixPath(name).parts
    if not parts or PurePosixPath(name).is_absolute() or any(p in ("..", "") for p in parts):
        raise BundleCorruptError(f"{src}: damaged bundle: member {name!r} points outside the bundle", str(src))
    return dest.joinpath(*parts)


def unpack(path: str | os.PathLike, dest: str | os.PathLike) -> Header:
    """Verifies the bundle and writes its run folder to `dest` (which must not exist or be empty)."""
    path, dest = Path(path), Path(dest)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise PackError(f"{dest}: already exists and is not empty; unpack into a new folder")
    header = verify(path)
    created = not dest.exists()
    dest.mkdir(parents=True, exist_ok=True)
    try:
        with open(path, "rb") as f:
            f.seek(HEADER_SIZE)
            stream = zstandard.ZstdDecompressor().stream_reader(_Bounded(f, header.payload_size))
            with tarfile.open(fileobj=stream, mode="r|") as tar:
                for member in tar:
                    target = _member_path(dest, member.name, path)
                    if member.isdir():
                        target.mkdir(parents=True, exist_ok=True)
                    elif member.isfile():
                        target.parent.mkdir(parents=True, exist_ok=True)
                        with tar.extractfile(member) as src, open(target, "xb") as out:
                            shutil.copyfileobj(src, out, _CHUNK)
                    else:
                        raise BundleCorruptError(f"{path}: damaged bundle: member {member.name!r} is not a file", str(path))
        if not (dest / MANIFEST).is_file():
            raise BundleCorruptError(f"{path}: damaged bundle: it holds no {MANIFEST}", str(path))
    except (zstandard.ZstdError, tarfile.TarError, EOFError, FileExistsError) as e:
        _remove(dest, created)
        raise BundleCorruptError(f"{path}: damaged bundle: its content does not unpack ({e.__class__.__name__}: {e}); "
                                 "get a fresh copy", str(path)) from None
    except BaseException:
        _remove(dest, created)
        raise
    return header


def _remove(dest: Path, created: bool) -> None:
    if created:
        shutil.rmtree(dest, ignore_errors=True)
    else:
        for child in dest.iterdir():
            shutil.rmtree(child, ignore_errors=True) if child.is_dir() else child.unlink(missing_ok=True)


_TEMP_DIRS: list[str] = []


def _cleanup() -> None:
    for d in _TEMP_DIRS:
        shutil.rmtree(d, ignore_errors=True)


atexit.register(_cleanup)


def open_run(path: str | os.PathLike, for_replay: bool = False) -> Run:
    """The run at `path`: a run folder, or a bundle, verified and unpacked to a temporary folder
    (removed when the process exits). `run.bundle` is the bundle's path (None for a folder).
    `for_replay`: refuse a --lite bundle, which holds nothing to replay from."""
    p = Path(path)
    if p.is_dir() or not p.exists():
        run = Run.open(p)
        run.bundle = None
    else:
        tmp = tempfile.mkdtemp(prefix="replay-bundle-")
        _TEMP_DIRS.append(tmp)
        dest = Path(tmp) / p.name  # shown where a report names the run
        unpack(p, dest)
        run = Run.open(dest)
        run.bundle = p
    info = run.manifest.get("bundle")
    if for_replay and isinstance(info, dict) and info.get("lite"):
        raise PackError(f"{p}: is a --lite bundle (trace and report only): it can be shown and compared "
                        "(`replay show`, `replay bisect`) but not replayed; ask for a bundle packed without --lite")
    return run


def default_steps(run: Run) -> tuple[int, int] | None:
    """A bundle's own step range (what `replay run FILE` replays without --steps)."""
    info = run.manifest.get("bundle")
    if isinstance(info, dict) and isinstance(info.get("steps"), list):
        a, b = info["steps"]
        return int(a), int(b)
    return None


# ------------------------------------------------------------------------------ packing


@dataclass
class Part:
    name: str  # "checkpoint", "trace", "batch data", "manifest and report"
    detail: str
    raw_bytes: int
    packed_bytes: int  # compressed bytes in the bundle (zstd flushed at each part's end)


@dataclass
class PackResult:
    path: Path
    size: int
    sha256: str
    lite: bool
    steps: tuple[int, int]
    checkpoint: int | None
    trace: tuple[int, int]
    examples: int
    parts: list[Part] = field(default_factory=list)
    finding: dict | None = None
    report: str = ""
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "path": str(self.path), "size": self.size, "sha256": self.sha256, "format_version": FORMAT_VERSION,
            "lite": self.lite, "steps": list(self.steps), "checkpoint": self.checkpoint, "trace": list(self.trace),
            "examples": self.examples, "finding": self.finding, "notes": self.notes,
            "parts": [{"name": p.name, "detail": p.detail, "raw_bytes": p.raw_bytes, "packed_bytes": p.packed_bytes}
                      for p in self.parts],
        }


def pack(run_path: str | os.PathLike, out: str | os.PathLike, steps: tuple[int, int] | None = None, *,
         lite: bool = False, force: bool = False, data: str | None = None, from_bisect: str | os.PathLike | None = None,
         spike: int | None = None, on_status=None) -> PackResult:
    """Writes the bundle of steps A..B of the run (or bundle) at `run_path` to `out`."""
    status = on_status or (lambda msg: None)
    out = Path(out)
    if out.is_dir():
        raise PackError(f"-o {out}: is a folder; name the bundle file to write (e.g. {out / ('bug' + SUFFIX)})")
    if out.exists() and not force:
        raise PackError(f"{out}: already exists; pass --force to overwrite it, or choose another -o")
    if not out.parent.is_dir():
        raise PackError(f"-o {out}: the folder {out.parent} does not exist")
    run = open_run(run_path)
    trace = run.trace
    if len(trace) == 0:
        raise PackError(f"{run_path}: the trace holds no steps; nothing to pack")
    finding = None
    if from_bisect is not None:
        finding = _bisect_finding(run, run_path, from_bisect)
        if not finding["identical"] or steps is not None:
            status(f"bisect {run_path} vs {from_bisect}: {finding['headline']}")
    if spike is not None:
        finding = _spike_finding(run, run_path, spike, data, status)
    if steps is None:
        steps = _steps_around(run, finding, run_path)
    first, last = steps
    if first < trace.start or last >= trace.end:
        raise PackError(f"--steps {first}:{last} is outside the recorded steps {trace.start}..{trace.end - 1} of {run_path}")
    if finding and finding.get("step") is not None and not first <= finding["step"] <= last:
        status(f"note: the finding's step {finding['step']} is outside --steps {first}:{last}")
    checkpoint = None if lite else _checkpoint_for(run, run_path, first)
    trace_first = first if lite else checkpoint
    if trace_first < trace.start:
        raise PackError(f"{run_path}: the trace starts at step {trace.start}, after checkpoint {checkpoint}; "
                        "the warm-up steps from the checkpoint cannot be verified")
    with tempfile.TemporaryDirectory(prefix="replay-pack-") as tmp:
        stage = Path(tmp)
        writer = traces.TraceWriter(stage / TRACE_DIR, run.schema)
        for s in range(trace_first, last + 1):  # streamed: a long --lite range never sits in memory
            writer.append(trace.read(s))
        writer.close()
        staged = traces.TraceReader(stage / TRACE_DIR, run.schema)  # re-read: what the bundle holds
        if (staged.start, staged.end, staged.damage) != (trace_first, last + 1, []):
            raise PackError(f"{out}: the re-written trace does not read back as steps {trace_first}..{last}")
        examples_meta = None
        if not lite:
            status(f"collecting the batches of steps {checkpoint}..{last}")
            examples_meta = _write_examples(run, run_path, stage / EXAMPLES, checkpoint, last, staged, data)
        info = {
            "format_version": FORMAT_VERSION, "lite": lite, "steps": [first, last], "checkpoint": checkpoint,
            "trace": [trace_first, last], "examples": None if lite else EXAMPLES,
            "example_count": examples_meta["examples"] if examples_meta else 0,
            "packed_from": str(Path(getattr(run, "bundle", None) or run.path).absolute()), "source_status": run.status,
            "source_steps": [trace.start, trace.end - 1], "finding": _json_safe(finding),
        }
        manifest = {**run.manifest, "checkpoints": [] if lite else [checkpoint], "bundle": info}
        write_json_atomic(stage / MANIFEST, manifest)
        write_json_atomic(stage / COMPLETE, {"end": last + 1})
        report = render_report(manifest, run.schema, staged, out.name, finding=finding)
        (stage / REPORT).write_text(report)
        groups = [
            ("manifest and report", f"run.json, {REPORT}", [stage / MANIFEST, stage / COMPLETE, stage / REPORT], stage),
            ("trace", f"steps {trace_first}..{last}, {last - trace_first + 1} records", sorted((stage / TRACE_DIR).iterdir()),
             stage),
        ]
        if not lite:
            groups.append(("batch data", f"{examples_meta['examples']} examples of {examples_meta['seq_len'] + 1} tokens",
                           [stage / EXAMPLES], stage))
            ckpt_dir = run.checkpoint_dir / str(checkpoint)
            if not ckpt_dir.is_dir():
                raise PackError(f"{run_path}: checkpoint {checkpoint} is not the folder {ckpt_dir}; "
                                "pack with --lite, or copy the run with its checkpoints")
            groups.append(("checkpoint", f"step {checkpoint}", _files_under(ckpt_dir), run.path))
        status(f"writing {out}")
        result = _write_bundle(out, groups, lite)
    result.steps, result.checkpoint, result.trace = (first, last), checkpoint, (trace_first, last)
    result.examples = info["example_count"]
    result.finding, result.report = finding, report
    return result


def _files_under(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() or p.is_dir())


def _checkpoint_for(run: Run, run_path, first: int) -> int:
    if "replayable" in run.manifest:
        raise PackError(f"{run_path} was recorded by its own training loop ({run.manifest['replayable']}): a full "
                        "bundle needs trainer/ batches; pack it with --lite (trace and report)")
    from trainer.checkpoint import Checkpointer

    have = Checkpointer(run.checkpoint_dir, create=False).steps() if run.checkpoint_dir.is_dir() else []
    before = [c for c in have if c <= first]
    if not before:
        listed = ", ".join(map(str, have)) or "none"
        raise PackError(f"{run_path} has no checkpoint at or before step {first} (checkpoints: {listed}); pack a range "
                        "that starts at or after a checkpoint, or use --lite (no replay)")
    return max(before)


def _open_data(run: Run, run_path, data: str | None):
    """The token source the run was trained on (or the rows a bundle carries), fingerprint checked."""
    from trainer import data as datalib
    from trainer.config import from_dict

    cfg = from_dict(run.manifest["config"])
    bundled = run.manifest.get("bundle", {}).get("examples") if not data else None
    spec = data or cfg.data.source
    try:
        source = (datalib.open_example_file(run.path / bundled, cfg.model.vocab_size) if bundled
                  else datalib.open_source(spec, cfg.data.token_dtype, cfg.model.vocab_size))
    except datalib.DataError as e:
        raise PackError(f"the data source of {run_path} cannot be read ({e}); pass --data PATH to point at it, "
                        "or pack with --lite") from None
    recorded = run.manifest.get("data", {}).get("fingerprint")
    if recorded and source.fingerprint() != recorded:
        raise PackError(f"data source {spec} has changed since {run_path} was recorded (fingerprint "
                        f"{source.fingerprint()[:12]} != {recorded[:12]}); pass --data PATH to the original data")
    return cfg, source


def _write_examples(run: Run, run_path, path: Path, start: int, last: int, staged, data: str | None) -> dict:
    """Writes the rows of every example that steps start..last feed, and checks that they rebuild
    every recorded batch through the run's fault plan, as the replay will feed them."""
    from trainer import data as datalib, rng
    from trainer.faults import FaultPlan

    cfg, source = _open_data(run, run_path, data)
    plan = FaultPlan.from_manifest(run.manifest.get("faults"), cfg)
    full = datalib.Batcher(source, cfg.model.seq_len, cfg.data.global_batch_size, rng.data_seed(cfg.seed))
    fed_from = {s: plan.batch_step(s) for s in range(start, last + 1)}
    ids = np.concatenate([full.global_ids(s) for s in sorted(set(fed_from.values()))])
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = datalib.write_example_file(path, source, ids, cfg.model.seq_len)
    carried = datalib.Batcher(datalib.open_example_file(path, cfg.model.vocab_size), cfg.model.seq_len,
                              cfg.data.global_batch_size, rng.data_seed(cfg.seed))
    for rec in staged.records(start, last + 1):
        batch = carried.batch_at(fed_from[rec.step])
        if hasattr(plan, "alter_batch"):
            batch = plan.alter_batch(batch, rec.step, carried.local_slice)
        if not np.array_equal(np.asarray(batch.example_hashes, np.uint64), rec.example_hashes):
            bad = int(np.flatnonzero(np.asarray(batch.example_hashes, np.uint64) != rec.example_hashes)[0])
            raise PackError(f"{run_path}: the data source does not rebuild the batch recorded at step {rec.step} "
                            f"(example {bad} differs); the run's data or its trace does not match: check the run "
                            "with `replay run` before packing it")
    return meta


class _Sink:
    """The bundle file behind the compressor: hashes and counts what is written."""

    def __init__(self, f):
        self.f, self.size, self.sha = f, 0, hashlib.sha256()

    def write(self, b) -> int:
        self.sha.update(b)
        self.size += len(b)
        return self.f.write(b)

    def flush(self) -> None:
        self.f.flush()


class _Counter:
    """The tar stream in front of the compressor: tarfile needs tell()."""

    def __init__(self, w):
        self.w, self.pos = w, 0

    def write(self, b) -> int:
        self.w.write(b)
        self.pos += len(b)
        return len(b)

    def tell(self) -> int:
        return self.pos


def _tarinfo(name: str, size: int, is_dir: bool = False) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.uid, info.gid, info.uname, info.gname = size, 0, 0, 0, "", ""
    if is_dir:
        info.type, info.mode, info.size = tarfile.DIRTYPE, 0o755, 0
    else:
        info.mode = 0o644
    return info


def _write_bundle(out: Path, groups, lite: bool) -> PackResult:
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    parts: list[Part] = []
    try:
        with open(tmp, "wb") as f:
            f.write(b"\0" * HEADER_SIZE)
            sink = _Sink(f)
            cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=True)
            with cctx.stream_writer(sink, closefd=False) as zw:
                counter = _Counter(zw)
                tar = tarfile.open(fileobj=counter, mode="w", format=tarfile.PAX_FORMAT)
                for name, detail, files, root in groups:
                    before, raw = sink.size, 0
                    for p in files:
                        arc = p.relative_to(root).as_posix()
                        if p.is_dir():
                            tar.addfile(_tarinfo(arc, 0, True))
                            continue
                        size = p.stat().st_size
                        with open(p, "rb") as src:
                            tar.addfile(_tarinfo(arc, size), src)
                        raw += size
                    zw.flush(zstandard.FLUSH_BLOCK)
                    parts.append(Part(name, detail, raw, sink.size - before))
                before = sink.size
                tar.close()
            parts[0].packed_bytes += sink.size - before + HEADER_SIZE  # the header, the tar and zstd trailers
            f.seek(0)
            f.write(_encode_header(sink.size, sink.sha.digest(), lite))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    size = out.stat().st_size
    return PackResult(out, size, sink.sha.hexdigest(), lite, (0, 0), None, (0, 0), 0,
                      sorted(parts, key=lambda p: -p.packed_bytes))


def _steps_around(run: Run, finding: dict | None, run_path) -> tuple[int, int]:
    trace = run.trace
    if not finding or finding.get("step") is None:
        if finding and finding.get("kind") == "bisect":
            raise PackError(f"{run_path} and {finding['run_b']} do not differ in the steps both hold; "
                            "pass --steps A:B to pack a range anyway")
        raise PackError("--steps A:B is required (the steps to pack, B inclusive)")
    s = finding["step"]
    before = finding.get("window", 5)  # a spike's baseline window, so `replay spike` works on the bundle too
    return max(trace.start, s - before), min(trace.end - 1, s + 2)


def _bisect_finding(run: Run, run_path, other) -> dict:
    from replay.bisect import bisect

    report = bisect(run, open_run(other))
    c = report.comparison
    out: dict[str, Any] = {"kind": "bisect", "run_a": str(run_path), "run_b": str(other), "identical": report.identical,
                           "step": c.first_step, "cause": report.cause, "layer": report.layer,
                           "compared": list(c.compared), "manifest_diff": [[m.key, m.a, m.b] for m in report.manifest[:20]],
                           "fields": [{"kind": d.kind, "name": d.name, "a": d.a, "b": d.b, "distance": d.distance,
                                       "positions": d.positions} for d in c.diffs[:20]],
                           "more_fields": max(0, len(c.diffs) - 20),
                           "repeated_in_b": [{"position": e.position, "hash": e.example_hash, "seen": e.seen[:3]}
                                             for e in report.repeated("B")],
                           "repeated_in_a": [{"position": e.position, "hash": e.example_hash, "seen": e.seen[:3]}
                                             for e in report.repeated("A")],
                           "refinement": report.refinement, "notes": list(report.notes)}
    if report.identical:
        out["headline"] = f"identical over steps {c.compared[0]}..{c.compared[1] - 1}"
    else:
        where = f" in {report.layer}" if report.layer else ""
        out["headline"] = f"first divergence at step {c.first_step}: {report.cause}{where}"
        if out["repeated_in_b"]:
            out["headline"] += f"; {len(out['repeated_in_b'])} example(s) of B's batch were already seen by B"
    return out


def _spike_finding(run: Run, run_path, step: int, data: str | None, status) -> dict:
    """`replay spike RUN --step S` on the run being packed: detection from the trace, then the
    analysis, which replays the window from a checkpoint (verifying every step)."""
    try:
        import replay.spike as spikelib  # replay/spike.py (the loss-spike issue)
    except ImportError:
        raise PackNotBuilt("--spike needs `replay spike` (replay/spike.py), which is not built yet; pack the window "
                           f"with --steps A:B and describe the spike at step {step} yourself") from None
    trace = run.trace
    if not trace.start <= step < trace.end:
        raise PackError(f"--spike {step} is outside the recorded steps {trace.start}..{trace.end - 1} of {run_path}")
    window = min(spikelib.DEFAULT_WINDOW, step - trace.start)
    if window < spikelib.MIN_WINDOW:
        raise PackError(f"--spike {step}: only {step - trace.start} recorded steps before it; a spike's baseline needs "
                        f"at least {spikelib.MIN_WINDOW}")
    out: dict[str, Any] = {"kind": "spike", "step": step, "window": window, "run": str(run_path), "notes": []}
    try:
        found = spikelib.scan(run, window)
        out["threshold"] = found.threshold
        out["detected"] = any(sp.step == step for sp in found.spikes)
        out["spikes"] = [sp.step for sp in found.spikes][:20]
    except spikelib.SpikeInputError as e:
        out["notes"].append(f"detection did not run: {e}")
    from replay import contract as contractlib
    from trainer import replayable as replayables

    status(f"replaying the window of step {step} to analyse it (replay spike {run_path} --step {step} --window {window})")
    rep = replayables.load(run, data=data)
    env = run.manifest.get("environment", {})
    contract = contractlib.evaluate(env, rep.environment(), run.manifest.get("program_hash"), rep.program_hash(),
                                    bool(run.manifest.get("config", {}).get("mesh", {}).get("mesh_invariant")),
                                    tuple(run.manifest.get("invariant_device_counts", ())))
    report = spikelib.analyze(run, rep, step, contract, window)
    j = report.to_json()
    replayed = j["replay"] or {}
    out.update({"loss": j["loss"], "grad_norm": j["grad_norm"], "typical_example_loss": j["typical_example_loss"],
                "examples": j["examples"], "first_jump": j["first_jump"], "layer_source": j["layer_source"],
                "injected_positions": j["injected_positions"],
                "replay": {k: replayed.get(k) for k in ("checkpoint", "replayed", "bit_exact", "warmup_replayed",
                                                         "warmup_bit_exact", "all_bit_exact")}
                          | {"contract": contract.line}})
    out["notes"] += j["notes"]
    loss = j["loss"] or {}
    verdict = "a spike" if out.get("detected") else "not flagged as a spike"
    out["headline"] = (f"loss {_value(loss.get('loss'))} at step {step} against a baseline of "
                       f"{_short(loss.get('baseline'))} (score {_short(loss.get('score'))}, {verdict} at threshold "
                       f"{out.get('threshold', '?')})")
    if j["first_jump"]:
        out["headline"] += f"; first layer to jump: {j['first_jump']['name']}"
    return out


def _short(x: Any) -> str:
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def _json_safe(obj: Any) -> Any:
    """NaN and infinities as strings, numpy scalars as Python values: strict JSON."""
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    return obj


# ------------------------------------------------------------------------------ REPORT.md


def _num(v) -> str:
    """A recorded float as its shortest exact repr in its stored dtype ('nan', '-0.0', '2.3025851')."""
    return str(np.asarray(v)[()]) if isinstance(v, np.generic) or isinstance(v, np.ndarray) else repr(v)


def _rows(pairs: Iterable[tuple[str, Any]]) -> list[str]:
    lines = ["| | |", "| --- | --- |"]
    lines += [f"| {k} | {_cell(v)} |" for k, v in pairs]
    return lines


def _cell(v: Any) -> str:
    return str(v).replace("|", "\\|").replace("\n", " ")


def fmt_bytes(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def sample_steps(first: int, last: int, keep: Iterable[int] = (), most: int = MAX_TABLE_ROWS) -> list[int]:
    """All steps first..last, or `most` of them evenly spaced with first, last and `keep` included."""
    n = last - first + 1
    if n <= most:
        return list(range(first, last + 1))
    picked = {int(round(first + i * (n - 1) / (most - 1))) for i in range(most)}
    picked |= {s for s in keep if first <= s <= last}
    return sorted(picked)


def render_report(manifest: dict, schema: traces.Schema, trace: traces.TraceReader, bundle_name: str, *,
                  finding: dict | None = None) -> str:
    """The bundle's REPORT.md: a bug report people can read, whose numbers come from `trace` (the
    bundle's own)."""
    info = manifest["bundle"]
    cfg = manifest.get("config") or {}
    env = manifest.get("environment") or {}
    data = manifest.get("data") or {}
    first, last = info["steps"]
    ckpt, lite = info["checkpoint"], info["lite"]
    keep = [finding["step"]] if finding and finding.get("step") is not None else []
    shown = sample_steps(first, last, keep)
    by_step = {s: trace.read(s) for s in {first, last, *shown}}
    name = Path(info["packed_from"]).name
    model, dcfg, opt, tcfg = (cfg.get(k, {}) for k in ("model", "data", "optimizer", "trace"))
    L: list[str] = [f"# Bug report: steps {first}..{last} of `{name}`", ""]
    L.append(f"A `replay pack` bundle (bundle format_version {FORMAT_VERSION}), "
             + ("**lite**: the trace and this report only, to compare, not to replay."
                if lite else "with everything needed to replay these steps bit for bit on another machine, "
                             "without the dataset or the run folder."))
    L.append("")
    L.append("## Summary")
    L.append("")
    src = info["source_steps"]
    params = (manifest.get("model") or {}).get("params")
    L.append(f"- Run: `{info['packed_from']}`, preset `{manifest.get('preset') or 'custom'}`"
             + (f", {params:,} parameters" if isinstance(params, int) else "")
             + f"; {cfg.get('steps', '?')} steps configured, steps {src[0]}..{src[1]} recorded ({info['source_status']}).")
    L.append(f"- Steps covered: {first}..{last} ({last - first + 1} steps)"
             + ("." if lite else f", replayed from the checkpoint at step {ckpt}."))
    if "loss" in schema.metric_names:
        i = schema.metric_index("loss")
        vals = np.array([r.metrics[i] for r in trace.records(first, last + 1)])
        finite = vals[np.isfinite(vals)]
        span = f" (min {_num(finite.min())}, max {_num(finite.max())})" if finite.size else ""
        L.append(f"- Loss: {_num(vals[0])} at step {first}, {_num(vals[-1])} at step {last}{span}.")
    if finding:
        L.append(f"- Finding: {finding['headline']}.")
    L.append("")
    L.append("## The run")
    L.append("")
    rows: list[tuple[str, Any]] = [("preset", manifest.get("preset") or "custom"), ("seed", cfg.get("seed"))]
    if model:
        rows.append(("model", f"{model.get('n_layers')} layers, d_model {model.get('d_model')}, {model.get('n_heads')} heads "
                              f"({model.get('n_kv_heads')} kv), d_ff {model.get('d_ff')}, vocab {model.get('vocab_size')}, "
                              f"seq_len {model.get('seq_len')}, {model.get('dtype')} (params {model.get('param_dtype')}), "
                              f"dropout {model.get('dropout')}"))
    if params is not None:
        rows.append(("parameters", f"{params:,}" if isinstance(params, int) else params))
    if dcfg:
        rows.append(("batch", f"{dcfg.get('global_batch_size')} examples x {model.get('seq_len')} tokens"))
    if opt:
        rows.append(("optimizer", f"AdamW lr {opt.get('lr')}, warmup {opt.get('warmup_steps')}, decay {opt.get('decay_steps')}, "
                                  f"weight decay {opt.get('weight_decay')}, clip {opt.get('grad_clip')}, z_loss {opt.get('z_loss')}"))
    if data:
        rows.append(("data", f"{data.get('path')} ({data.get('kind')}, {data.get('dtype')}, {data.get('n_tokens')} tokens, "
                             f"fingerprint {str(data.get('fingerprint'))[:16]})"))
    if tcfg:
        every = tcfg.get("layer_every")
        rows.append(("trace level", f"{tcfg.get('level')}" + ("" if tcfg.get("level") != "layer" else
                                                              " (layer fingerprints every step)" if every == 1 else
                                                              f" (layer fingerprints every {every} steps)")))
    mesh = cfg.get("mesh") or {}
    if mesh:
        rows.append(("mesh", f"data {mesh.get('data')}, fsdp {mesh.get('fsdp')}, mesh_invariant {mesh.get('mesh_invariant')}"))
    rows.append(("faults injected", ", ".join(manifest.get("faults") or []) or "none"))
    rows.append(("steps recorded", f"{src[0]}..{src[1]} ({info['source_status']})"))
    if manifest.get("program_hash"):
        rows.append(("program hash", manifest["program_hash"][:16]))
    L += _rows(rows)
    L.append("")
    L.append("## Environment")
    L.append("")
    versions = env.get("versions") or {}
    erows: list[tuple[str, Any]] = [("backend", env.get("backend"))]
    if env.get("device_kind") is not None:
        procs = env.get("process_count")
        erows.append(("devices", f"{env.get('device_count')} x {env.get('device_kind')}, "
                                 f"{procs} process{'' if procs == 1 else 'es'}"))
    if manifest.get("mesh"):
        erows.append(("mesh shape", ", ".join(f"{k} {v}" for k, v in manifest["mesh"].get("shape", {}).items())))
    erows += [(k, v) for k, v in versions.items()]
    erows += [("cpus", env.get("cpu_count")), ("platform", env.get("platform")), ("XLA_FLAGS", env.get("xla_flags") or "(none)")]
    L += _rows([(k, v) for k, v in erows if v is not None])
    L.append("")
    L.append("## Steps covered")
    L.append("")
    L.append(f"- Range: steps {first}..{last} ({last - first + 1} steps).")
    if lite:
        L.append(f"- The bundle holds the trace records of steps {first}..{last}: every recorded field, bit for bit "
                 "(RNG key words, batch and per-example hashes, metrics"
                 + (", layer fingerprints" if schema.tensors else "") + "). No checkpoint and no batch data.")
    else:
        L.append(f"- Checkpoint: step {ckpt}, the newest at or before step {first}."
                 + (f" The replay re-runs steps {ckpt}..{first - 1} first and verifies them too." if ckpt < first else ""))
        L.append(f"- The bundle holds the trace records of steps {ckpt}..{last}, checkpoint {ckpt}, and the token rows of "
                 f"the {info['example_count']} examples that the batches of steps {ckpt}..{last} are made of.")
    L.append("")
    L.append("## Metrics")
    L.append("")
    names = list(schema.metric_names)
    if len(shown) < last - first + 1:
        L.append(f"{len(shown)} of the {last - first + 1} steps, evenly spaced; every step is in the trace "
                 f"(`replay show {bundle_name} --json`, or unpack it).")
        L.append("")
    L.append("| step | " + " | ".join(names) + " | batch hash |")
    L.append("| ---: | " + " | ".join("---:" for _ in names) + " | --- |")
    for s in shown:
        r = by_step[s]
        L.append(f"| {s} | " + " | ".join(_num(v) for v in r.metrics) + f" | {r.batch_hash:016x} |")
    L.append("")
    L.append(f"Values are the exact recorded {schema.metric_dtype} values (shortest round-trip form).")
    L.append("")
    if finding:
        L += _render_finding(finding)
    L.append("## How to replay")
    L.append("")
    if lite:
        L.append("This bundle holds no checkpoint or data, so it does not replay. Look at it or compare it with a run:")
        L.append("")
        L.append("```bash")
        L.append(f"replay show {bundle_name}")
        L.append(f"replay bisect {bundle_name} YOUR_RUN    # where your run first differs from these steps, and why")
        L.append("```")
    else:
        L.append("```bash")
        L.append("pip install replay-jax    # the replay that packed it, or newer")
        L.append(f"replay run {bundle_name} --steps {first}:{last}")
        L.append("```")
        L.append("")
        warm = f" (and the {first - ckpt} warm-up steps {ckpt}..{first - 1} bit-identical)" if first > ckpt else ""
        L.append(f"Expected: `{last - first + 1} of {last - first + 1}` steps bit-exact{warm} on a machine that matches the environment above "
                 "(backend, device kind and count, software versions). Anywhere else `replay run` says which line "
                 "of the determinism contract applies and reports distances instead of promising bits.")
        L.append("")
        L.append("```bash")
        L.append(f"replay show {bundle_name}                 # the run and its recorded steps")
        L.append(f"replay bisect {bundle_name} YOUR_RUN      # compare with your own run of the same config")
        L.append("```")
    L.append("")
    L.append(f"`replay unpack {bundle_name} DIR` writes the files out: DIR is a run folder (run.json, trace/"
             + ("" if lite else ", checkpoints/, data/") + ") holding this report.")
    L.append("")
    return "\n".join(L)


def _value(v: Any) -> str:
    """A compared value: floats (float32 metrics and RMS) in their shortest float32 form."""
    if v is None:
        return ""
    if isinstance(v, float):
        return str(np.float32(v)) if np.float32(v) == v or not math.isfinite(v) else repr(v)
    return _cell(v)


def _render_finding(f: dict) -> list[str]:
    L = ["## Finding", ""]
    if f["kind"] == "bisect":
        L.append(f"From `replay bisect {f['run_a']} {f['run_b']}` (A is this run): {f['headline']}.")
        L.append("")
        if f["manifest_diff"]:
            L.append("What differs before any step ran:")
            L.append("")
            L.append("| | A | B |")
            L.append("| --- | --- | --- |")
            L += [f"| {_cell(k)} | {_cell(a)} | {_cell(b)} |" for k, a, b in f["manifest_diff"]]
            L.append("")
        if not f["identical"]:
            rows = [("first divergent step", f["step"]), ("cause (first field in causal order)", f["cause"])]
            if f["layer"]:
                rows.append(("layer", f["layer"]))
            first = f["fields"][0] if f["fields"] else None
            if f["cause"] == "data" and first and first.get("positions"):
                pos = first["positions"]
                rows.append(("examples that differ", f"{len(pos)} of the batch, at positions {', '.join(map(str, pos[:24]))}"))
            for run in ("b", "a"):
                rep = f[f"repeated_in_{run}"]
                if rep:
                    steps = sorted({s["step"] for e in rep for s in e["seen"] if s["run"] == run.upper()})
                    rows.append((f"already seen by {run.upper()}", f"{len(rep)} of them, first fed at steps "
                                                                   f"{', '.join(map(str, steps[:12]))}: repeated data"))
            L += _rows(rows)
            L.append("")
            L.append(f"Fields that differ at step {f['step']}, in causal order (the first is the likely cause, the "
                     "rest its consequences; for tensors the values are RMS, the trace holds their fingerprints):")
            L.append("")
            L.append("| kind | field | A | B | distance |")
            L.append("| --- | --- | --- | --- | --- |")
            shown = f["fields"][:FINDING_ROWS]
            for d in shown:
                dist = d.get("distance") or {}
                ds = "" if not dist or dist.get("nan") else f"abs {dist.get('abs'):.3g}, ulp {dist.get('ulp')}"
                L.append(f"| {d['kind']} | {_cell(d['name'])} | {_value(d['a'])} | {_value(d['b'])} | {ds} |")
            more = len(f["fields"]) - len(shown) + f["more_fields"]
            if more:
                L.append(f"| ... | {more} more fields | | | |")
            L.append("")
        if f.get("refinement"):
            L.append("Inside the layer: " + ", ".join(f"{k} {v}" for k, v in f["refinement"].items()
                                                   if not isinstance(v, (list, dict))) + ".")
            L.append("")
        L.append(f"To compare again elsewhere, pack {f['run_b']} the same way and run `replay bisect A.rpk B.rpk`.")
        L.append("")
    else:
        L += _render_spike(f)
    return L


def _render_spike(f: dict) -> list[str]:
    L = [f"From `replay spike {f['run']} --step {f['step']} --window {f['window']}`: {f['headline']}.", ""]
    loss, grad, rep = f.get("loss") or {}, f.get("grad_norm"), f.get("replay") or {}
    rows: list[tuple[str, Any]] = [
        ("step", f["step"]),
        ("loss", f"{_value(loss.get('loss'))} (baseline {_short(loss.get('baseline'))}, spread {_short(loss.get('spread'))}, "
                 f"score {_short(loss.get('score'))}, rise {_short(loss.get('rise'))})"),
        ("detected", "yes" if f.get("detected") else f"no (spikes found: {', '.join(map(str, f.get('spikes', []))) or 'none'})"),
    ]
    if grad:
        rows.append(("grad norm", f"{_value(grad.get('loss'))} (baseline {_short(grad.get('baseline'))}, "
                                  f"score {_short(grad.get('score'))})"))
    jump = f.get("first_jump")
    rows.append(("first layer to jump", f"{jump['name']} ({jump['kind']}): RMS x{_short(jump['ratio'])}, score "
                                        f"{_short(jump['score'])}" if jump else "none above the threshold"))
    if f.get("injected_positions"):
        rows.append(("injected bad examples", ", ".join(map(str, f["injected_positions"]))))
    if rep:
        rows.append(("replay on the packing machine", f"{rep.get('bit_exact')} of {rep.get('replayed')} bit-identical "
                                                      f"from checkpoint {rep.get('checkpoint')} ({rep.get('warmup_bit_exact')} "
                                                      f"of {rep.get('warmup_replayed')} warm-up); {rep.get('contract')}"))
    L += _rows(rows)
    L.append("")
    if f.get("examples"):
        L.append(f"Examples with the largest loss at step {f['step']} (typical example loss "
                 f"{_short(f.get('typical_example_loss'))}):")
        L.append("")
        L.append("| position | loss | score | share of the rise | hash | seen before at step | first tokens |")
        L.append("| ---: | ---: | ---: | ---: | --- | ---: | --- |")
        for e in f["examples"]:
            text = e.get("text")
            L.append(f"| {e['position']} | {_short(e['loss'])} | {_short(e['score'])} | {_short(e['share_of_rise'])} | "
                     f"{e['hash']} | {'' if e['seen_before'] is None else e['seen_before']} | "
                     f"{'' if text is None else _cell(repr(text[:40]))} |")
        L.append("")
    for note in f.get("notes", []):
        L.append(f"- {note}")
    if f.get("notes"):
        L.append("")
    return L
