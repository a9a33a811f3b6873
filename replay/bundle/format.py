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

    run.json           the run's manifest, with its own checksum (traces.run.write_manifest);
                       "checkpoints" lists only the bundled checkpoint, "trace_first_step" is
                       the bundle's first step, and "bundle" describes the bundle (below)
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
checksum and that every member is a plain file or folder inside the bundle; then what the
bytes hold, which a checksum cannot vouch for (replay/bundle/trust.py: the layout above and no
code, a manifest that names no code, unpack's mark on the folder it fills). The unpacked
folder is opened with traces.Run, so the manifest's checksum, the trace's checksums and the
replay's verification are those of any run; a trace that is damaged inside a bundle whose
sha256 holds is refused by `unpack` (commands that open bundles judge it with their own
--allow-damaged). `unpack` writes to a hidden sibling of DIR and renames it into place only
once all of that passed, so a bundle that fails leaves nothing behind. Messages name the
bundle's files as BUNDLE:member, never the temporary folder a command unpacked it to. Pack itself checks that the bundled rows rebuild every recorded batch of
steps C..B (through the run's fault plan, as the replay feeds them) before writing anything.
"""

from __future__ import annotations

import atexit
import hashlib
import io
import os
import shutil
import struct
import tarfile
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import zstandard

import traces
from traces import NewerFormatError, NotARunError, Run, RunNotFoundError, TraceCorruptError
from traces.run import MANIFEST
from replay.bundle import trust
from replay.engine.damage import describe_damage, in_terms, rename_in, run_damage
from replay.engine.code import is_bundle_run
from replay.record import export as exportlib
from replay.record.exported_entry import entry_damage

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
_CHUNK = 1 << 20


class NotABundleError(NotARunError):
    """The path is a file, but not a bundle."""


class BundleCorruptError(TraceCorruptError):
    """The bundle's bytes fail their checksum or structure."""


class NewerBundleError(NewerFormatError):
    """Written by a newer bundle format_version."""


class PackError(traces.TraceError):
    """What was asked cannot be packed (a range, a missing checkpoint or data, an existing file)."""


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
    problem = trust.member_problem(name)
    if problem:
        raise BundleCorruptError(f"{src}: refused: {problem}", str(src))
    return dest.joinpath(*parts)


def unpack(path: str | os.PathLike, dest: str | os.PathLike, allow_damaged: bool = False) -> Header:
    """Verifies the bundle and writes its run folder to `dest` (which must not exist or be empty).

    The files are written to a hidden sibling and renamed to `dest` only once the run they form
    opens (its manifest checks) and, unless `allow_damaged`, its trace is undamaged: a bundle
    that fails after extracting leaves nothing behind."""
    path, dest = Path(path), Path(dest)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise PackError(f"{dest}: already exists and is not empty; unpack into a new folder")
    if not dest.parent.is_dir():
        raise PackError(f"{dest}: the folder {dest.parent} does not exist")
    header = verify(path)
    stage = Path(tempfile.mkdtemp(prefix=f".{dest.name}.unpack-", dir=dest.parent))
    try:
        trust.mark(stage, path, header.sha256)  # first: the folder is a bundle's from its first byte on
        _extract(path, header, stage)
        run = Run.open(stage)
        run.bundle = path
        refused = trust.manifest_problem(run.manifest) or trust.layout_problem(stage, run.manifest)
        if refused is not None:
            raise BundleCorruptError(f"{path}: refused: {refused}", str(path))
        damage = run_damage(run)
        if damage and not allow_damaged:
            raise BundleCorruptError(f"{path}: damaged bundle: its checksum matches, but the trace it holds is "
                                     f"damaged ({describe_damage(run, damage)}); it was packed from a damaged run, or "
                                     "written by something other than `replay pack`", str(path))
        os.replace(stage, dest)  # onto a missing or empty folder: atomic
    except (zstandard.ZstdError, tarfile.TarError, EOFError, FileExistsError, NotADirectoryError,
            IsADirectoryError) as e:
        why = f"{e.strerror}: {in_terms(str(e.filename), stage, path)}" if isinstance(e, OSError) else str(e)
        raise BundleCorruptError(f"{path}: damaged bundle: its content does not unpack ({e.__class__.__name__}: "
                                 f"{why}); get a fresh copy", str(path)) from None
    except Exception as e:
        rename_in(e, stage, path)
        raise
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return header


def _extract(path: Path, header: Header, dest: Path) -> None:
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


def _refuse_damaged_entries(run: Run, shown: Path) -> None:
    """A re-checksummed run.json whose "exported" or "example_store" entry is not as replay wrote it is
    refused by every command that opens the run, not only by those that replay from it: a bisect whose
    traces agree would otherwise call the runs identical over a manifest no replay could use."""
    damage = entry_damage(run.manifest) if exportlib.KEY in run.manifest else None
    if damage:
        raise traces.ManifestCorruptError(
            f"{shown}{':' if getattr(run, 'bundle', None) else '/'}{MANIFEST}: its \"{damage[0]}\" entry is damaged "
            f"({damage[1]}): run.json was changed after recording; restore it from a copy of the run", str(shown))


_TEMP_DIRS: list[str] = []


def _cleanup() -> None:
    for d in _TEMP_DIRS:
        shutil.rmtree(d, ignore_errors=True)


atexit.register(_cleanup)


def _refuse_a_bundle_url(path) -> None:
    """A bundle file on object storage is not opened (bundles are unpacked from local disk): one
    line saying to copy it here, rather than "no such run"."""
    from traces.storage import as_path, is_url

    if is_url(path) and as_path(path).is_file():
        raise NotARunError(f"{as_path(path)}: is a file, not a run folder: a bundle is read from local disk; copy "
                           "it here first (gcloud storage cp / aws s3 cp) and give its local path")


def open_run(path: str | os.PathLike, for_replay: bool = False) -> Run:
    """The run at `path`: a run folder, or a bundle, verified and unpacked to a temporary folder
    (removed when the process exits). `run.bundle` is the bundle's path (None for a folder).
    `for_replay`: refuse a --lite bundle, which holds nothing to replay from."""
    p = Path(path)
    if p.is_dir() or not p.exists():
        try:
            run = Run.open(p)
        except (NotARunError, RunNotFoundError):
            _refuse_a_bundle_url(path)
            raise
        run.bundle = None

        refused = trust.manifest_problem(run.manifest) if is_bundle_run(run) else None  # a folder unpack wrote
        if refused is not None:
            raise BundleCorruptError(f"{p}: refused: {refused}", str(p))
    else:
        tmp = tempfile.mkdtemp(prefix="replay-bundle-")
        _TEMP_DIRS.append(tmp)
        dest = Path(tmp) / p.name  # shown where a report names the run
        try:
            unpack(p, dest, allow_damaged=True)  # the command judges the damage, with its own flags
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # a refused bundle leaves nothing behind
            raise
        run = Run.open(dest)
        run.bundle = p
    _refuse_damaged_entries(run, p)
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
