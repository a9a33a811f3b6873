"""run.json: written atomically with a checksum of its content, read only once that checksum holds.

Every verdict a command gives leans on the manifest (config, seeds, learning rate, data
fingerprint, program hash, checkpoint list, where the trace starts), so a manifest is believed
only when its `manifest_sha256` holds. What has no checksum:

- `format_version` 2 and later: every writer of those versions records `manifest_sha256` and
  `trace_first_step`, so a manifest of such a version without either was changed after
  recording: refused (ManifestCorruptError), whatever else it holds;
- `format_version` 1 without a checksum: a run recorded before replay checked manifests, or one
  whose checksum was removed to get an edit accepted; the two cannot be told apart, so it is
  refused (UncheckedManifestError) unless the caller trusts unchecked manifests explicitly
  (`replay --trust-unchecked-manifest`, `trusting_unchecked_manifests()`), and then read with a
  note that says what is not checked. Even then its trace must not be newer than it says: a
  segment of a later format_version gives away a manifest downgraded to pass as old.

The trust is a permission, not an input to any computation: it only decides whether a run is
opened at all, so it is held for the duration of one command (a context), never in a config.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from traces.errors import (
    DISK_FULL_ERRNOS, DiskFullError, ManifestCorruptError, NewerFormatError, NotARunError, RunNotFoundError,
    disk_full_message,
)
from traces.segment import SEGMENT_MAGIC
from traces.storage import as_path
from traces.trace import FORMAT_VERSION

MANIFEST = "run.json"
MANIFEST_CHECKSUM = "manifest_sha256"
TRACE_FIRST_STEP = "trace_first_step"
CHECKED_SINCE_VERSION = 2  # the first format_version all of whose writers record the two keys above
TRUST_FLAG = "--trust-unchecked-manifest"
UNCHECKED = ("config, seeds, learning rate, data fingerprint, program hash, checkpoint list and where the trace "
             "starts are taken as written, not checked")

_trust = [False]  # the innermost trusting_unchecked_manifests() in force


class UncheckedManifestError(ManifestCorruptError):
    """A manifest without a checksum, refused because nobody said to trust it."""


@contextmanager
def trusting_unchecked_manifests(trust: bool = True) -> Iterator[None]:
    """Inside: a format_version 1 manifest without a checksum is read (with a note) instead of refused."""
    _trust.append(bool(trust))
    try:
        yield
    finally:
        _trust.pop()


def write_json_atomic(path: Path, obj: dict, last_step: int | None = None) -> None:
    """Write-then-rename, so a crash leaves the old file or the new one, never half of one."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=2, sort_keys=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if e.errno in DISK_FULL_ERRNOS:
            run = path.parent
            raise DiskFullError(disk_full_message(path, f"replacing {path.name} (the old one is kept)", last_step, run),
                                str(path), last_step) from None
        raise


def manifest_checksum(manifest: dict) -> str:
    """sha256 hex of the manifest's canonical JSON, without the checksum key itself."""
    body = {k: v for k, v in manifest.items() if k != MANIFEST_CHECKSUM}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write_manifest(path: Path, manifest: dict, last_step: int | None = None) -> dict:
    """Writes run.json atomically with its checksum; returns the manifest as a reader will see it.

    The manifest goes through JSON once first, so the checksum is over exactly what a reader
    parses (tuples become lists, keys strings); a stale checksum in `manifest` is replaced.
    """
    body = json.loads(json.dumps({k: v for k, v in manifest.items() if k != MANIFEST_CHECKSUM}))
    write_json_atomic(Path(path), {**body, MANIFEST_CHECKSUM: manifest_checksum(body)}, last_step)
    return body


def read_manifest(path: Path, notes: list[str] | None = None, trust_unchecked: bool | None = None) -> dict:
    """The verified manifest of the run at `path`, without its checksum key.

    Raises one-line errors for every way that can fail (module docstring). `trust_unchecked`
    (None: the innermost `trusting_unchecked_manifests`) reads a format_version 1 manifest
    without a checksum, adding a line to `notes` that says what is then unchecked.
    """
    path = as_path(path)  # a folder, or gs:// / s3:// (traces/storage)
    if not path.exists():
        raise RunNotFoundError(f"{path}: no such run; check the path (a run is the folder `replay train --out` wrote)")
    if not path.is_dir():
        raise NotARunError(f"{path}: is a file, not a run directory; pass the folder that `replay train --out` wrote")
    mpath = path / MANIFEST
    if not mpath.exists():
        raise NotARunError(f"{path}: not a run (no {MANIFEST}); pass the folder that `replay train --out` wrote")

    def corrupt(what: str) -> ManifestCorruptError:
        return ManifestCorruptError(
            f"{mpath}: {what}: run.json was changed or damaged after recording; restore it from a copy of the run",
            str(mpath))

    try:
        manifest = json.loads(mpath.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise corrupt(f"unreadable ({e.__class__.__name__})") from None
    if not isinstance(manifest, dict):
        raise corrupt("not a JSON object")
    version = manifest.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise corrupt(f"format_version {version!r} is not a positive integer")
    # Before the checksum: a newer writer may checksum differently, so a mismatch proves nothing there.
    if version > FORMAT_VERSION:
        ours = manifest.get(MANIFEST_CHECKSUM) == manifest_checksum(manifest)
        raise NewerFormatError(
            f"{path}: written by run format_version {version}, this replay reads up to {FORMAT_VERSION}: upgrade "
            f"replay (pip install -U replay-jax)" + ("" if ours else "; if this replay recorded it, run.json was damaged")
        )
    if MANIFEST_CHECKSUM in manifest:
        if manifest.pop(MANIFEST_CHECKSUM) != manifest_checksum(manifest):
            raise corrupt(f"its content does not match its {MANIFEST_CHECKSUM}")
    elif _damaged_checksum_key(manifest):
        raise corrupt(f"its {MANIFEST_CHECKSUM} is missing or its key damaged")
    elif version >= CHECKED_SINCE_VERSION:
        raise corrupt(f"it has no {MANIFEST_CHECKSUM}, which every format_version {version} run records")
    else:
        _refuse_unless_trusted(path, mpath, version, trust_unchecked)
        if notes is not None:
            notes.append(f"{mpath} has no checksum, read because {TRUST_FLAG} was given: its {UNCHECKED}")
    if version >= CHECKED_SINCE_VERSION and TRACE_FIRST_STEP not in manifest:
        raise corrupt(f"it has no {TRACE_FIRST_STEP}, which every format_version {version} run records")
    if "schema" not in manifest:
        raise corrupt("it has no schema")
    first = manifest.get(TRACE_FIRST_STEP, 0)
    if not isinstance(first, int) or isinstance(first, bool) or first < 0:
        raise corrupt(f"{TRACE_FIRST_STEP} {first!r} is not a step")
    return manifest


def _refuse_unless_trusted(path: Path, mpath: Path, version: int, trust: bool | None) -> None:
    if not (_trust[-1] if trust is None else trust):
        raise UncheckedManifestError(
            f"{mpath}: has no {MANIFEST_CHECKSUM}, so nothing in it can be checked (a run recorded before replay "
            f"checked manifests, or one whose checksum was removed); if you recorded it with an old replay and trust "
            f"the file, pass `replay {TRUST_FLAG} COMMAND ...`", str(mpath))
    newer = _newest_segment_version(path / "trace")
    if newer is not None and newer > version:
        raise ManifestCorruptError(
            f"{mpath}: says format_version {version} and has no {MANIFEST_CHECKSUM}, but its trace was written by "
            f"format_version {newer}, which always records one: run.json was changed after recording; restore it "
            "from a copy of the run", str(mpath))


_SEGMENT_VERSION = struct.Struct("<8sH")  # the first fields of a segment header (traces/segment.py)


def _newest_segment_version(trace_dir: Path) -> int | None:
    """The highest format_version in the trace's segment headers (10 bytes read per file)."""
    newest = None
    try:
        names = sorted(p for p in trace_dir.iterdir() if p.suffix == ".seg")
    except OSError:
        return None
    for seg in names:
        try:
            with seg.open("rb") as f:
                head = f.read(_SEGMENT_VERSION.size)
        except OSError:
            continue
        if len(head) == _SEGMENT_VERSION.size:
            magic, version = _SEGMENT_VERSION.unpack(head)
            if magic == SEGMENT_MAGIC:
                newest = version if newest is None else max(newest, version)
    return newest


def _damaged_checksum_key(manifest: dict) -> bool:
    """Whether a manifest without a checksum lost it to damage rather than being recorded before them.

    Manifests written since checksums also record trace_first_step; and a damaged key name keeps
    most of its letters, or at least its value, the checksum of everything else.
    """
    if TRACE_FIRST_STEP in manifest:
        return True
    for key, value in manifest.items():
        if len(key) == len(MANIFEST_CHECKSUM) and sum(a != b for a, b in zip(key, MANIFEST_CHECKSUM)) <= 3:
            return True
        if isinstance(value, str) and len(value) == 64 and value == manifest_checksum(
                {k: v for k, v in manifest.items() if k != key}):
            return True
    return False
