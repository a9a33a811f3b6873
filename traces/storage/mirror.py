"""Writing a run to object storage: a local staging folder in the local format, mirrored up.

Object stores have no append and no rename, so a run created at a gs:// or s3:// URL is written
as today to a local staging folder (`REPLAY_STAGING`, else the system's temporary folder) by the
unchanged local code, and every piece is uploaded as an immutable object once it is final:

- sealed segments whole (write-if-absent), their indexes when built; then the segment's tail
  objects are deleted. A format-3 run's segment goes up twice: as sealed (the bytes of the seal,
  read through a file opened before the seal thread renames the compacted copy over it), then
  compacted, after its index, which holds the compacted segment's example hashes alone; a resumed
  writer uploads the index (and compacted copy) it writes for a segment the killed one left without;
- the unsealed tail as tail objects (traces/storage/tails.py) of the bytes appended since the
  last upload, after every TAIL_RECORDS records or TAIL_SECONDS seconds (checked at each append)
  and at `flush()`, by an upload thread (traces/storage/uploader.py) with one tail object in
  flight at most: a writer killed or preempted loses only the records after its last uploaded
  tail object, fewer than 2 x TAIL_RECORDS; at close the segment whole with its sidecar (a
  finished run opens by it), its tail objects deleted;
- run.json with write-if-generation (its generation held from creation or resume), so a second
  writer's manifest never silently replaces it; INCOMPLETE at creation and resume, COMPLETE
  (write-if-absent) at finish, then INCOMPLETE deleted;
- every other file (checkpoints, the exported program, the example store; orbax's temporary
  folders excepted) whole, when new or changed, at each manifest update and at close: the
  manifest never names a checkpoint not uploaded (a growing example store is uploaded whole
  each time: fine for small runs, to be split like the trace);
- the writer lock is a lease object (traces/storage/lease.py), renewed as records are appended.

Resuming downloads the run's trace (sealed segments and the joined tail) and its other files to
a fresh staging folder first, but not its checkpoints: the checkpoint folder is staged as a
replay's local copy stages it (traces/storage/ondemand.py: each step folder EMPTY, fetched when
read), so the resumed loop downloads the one checkpoint it restores. Files fetched that way are
not uploaded again (ondemand.fetched_as), and a step folder never fetched is never uploaded. A
step folder orbax prunes under keep_checkpoints (fetched or not) is deleted in the bucket after the
manifest that no longer names it is uploaded (`prune`). The cost of a resume is the trace, the
small files and the example store plus one checkpoint, not every checkpoint.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

from traces.errors import NotARunError
from traces.storage import PreconditionFailed, RemotePath, as_path, ondemand, open_store, tails
from traces.storage.lease import Lease
from traces.segment import COMPACT_VERSION, HEADER_SIZE, header_version
from traces.storage.uploader import Uploader
from traces.writer import TraceWriter

TAIL_RECORDS = int(os.environ.get("REPLAY_TAIL_RECORDS", "256"))
TAIL_SECONDS = float(os.environ.get("REPLAY_TAIL_SECONDS", "10"))
MARKERS = ("INCOMPLETE", "COMPLETE")


class Mirror:
    """Uploads a staging folder's run to `url` as its pieces become final."""

    def __init__(self, url: str, staging: Path, lease: Lease):
        self.store, self.key = open_store(url)
        self.url, self.staging, self.lease = str(as_path(url)), staging, lease
        self.manifest_generation: str | None = None
        self._sent: dict[str, tuple] = {}  # other files uploaded: relative path -> (size, mtime)
        self._steps_seen: set[str] = set()  # checkpoint step folders staged here at some point
        self.tails_found: dict = {}  # from a resume's download: unsealed segment -> (bytes, tail objects)

    def _key(self, rel: str) -> str:
        return f"{self.key}/{rel}" if self.key else rel

    def put(self, rel: str, data: bytes, replace: bool = False) -> str:
        try:
            return self.store.write_if_absent(self._key(rel), data)
        except PreconditionFailed:
            if not replace:
                raise
            found = self.store.stat(self._key(rel))
            return self.store.write_if_generation(self._key(rel), data, found.generation)

    def delete(self, rel: str) -> None:
        try:
            self.store.delete(self._key(rel))
        except FileNotFoundError:
            pass

    def manifest(self) -> None:
        # S3's generation is the ETag, a hash of the content: two writers' equal manifests look the
        # same to it. The lease's body never repeats (its expiry), so renewing it first, by its
        # generation, is what refuses a writer that lost the run.
        self.lease.renew(force=True)
        data = (self.staging / "run.json").read_bytes()
        if self.manifest_generation is None:
            self.manifest_generation = self.store.write_if_absent(self._key("run.json"), data)
        else:  # a writer that lost the run (another took over its lease) is refused here
            self.manifest_generation = self.store.write_if_generation(self._key("run.json"), data,
                                                                      self.manifest_generation)

    def mark(self, complete: bool) -> None:
        self.lease.renew(force=True)
        if complete:
            self.put("COMPLETE", (self.staging / "COMPLETE").read_bytes(), replace=True)
            self.delete("INCOMPLETE")
        else:
            self.put("INCOMPLETE", b"", replace=True)
            self.delete("COMPLETE")

    def files(self) -> None:
        """Everything else the run folder holds (checkpoints, the exported program, the example
        store), each file uploaded whole when new or changed; orbax's temporary folders wait."""
        for p in sorted(self.staging.rglob("*")):
            rel = p.relative_to(self.staging).as_posix()
            if (not p.is_file() or rel.split("/")[0] in ("trace", "run.json", ".lock", *MARKERS)
                    or "tmp" in rel.lower()):
                continue
            st = p.stat()
            if (self._sent.get(rel) or ondemand.fetched_as(p)) != (st.st_size, st.st_mtime_ns):
                self.put(rel, p.read_bytes(), replace=True)
                self._sent[rel] = (st.st_size, st.st_mtime_ns)

    def prune(self) -> None:
        """Deletes from the bucket each checkpoint step folder that was staged here and is gone
        from the staging folder: orbax pruned it under keep_checkpoints. Called after the manifest
        that no longer names it is uploaded. A step folder never staged here (a run several
        processes checkpoint straight to the bucket, where orbax prunes itself) is never touched."""
        manifest = self.staging / "run.json"
        rel = ondemand.checkpoint_folder(manifest.read_bytes()) if manifest.is_file() else None
        if rel is None:
            return
        local = self.staging / rel
        present = {p.name for p in local.iterdir() if p.is_dir() and p.name.isdigit()} if local.is_dir() else set()
        for gone in sorted(self._steps_seen - present, key=int):
            self._delete_tree(f"{rel}/{gone}")
        self._steps_seen = present

    def _delete_tree(self, rel: str) -> None:
        files, dirs = self.store.list(self._key(rel) + "/")
        for d in dirs:
            self._delete_tree(f"{rel}/{d}")
        for name in files:
            self.delete(f"{rel}/{name}")
        for rel_sent in [r for r in self._sent if r.startswith(rel + "/")]:
            del self._sent[rel_sent]

    def release_after_failure(self) -> None:
        try:
            self.lease.release()
        except Exception:  # noqa: BLE001 - the store is failing: the lease expires on its own
            pass

    def close(self, remove_staging: bool = True) -> None:
        try:
            self.files()
            self.prune()
        finally:
            self.lease.release()
            if remove_staging:
                shutil.rmtree(self.staging.parent, ignore_errors=True)
                ondemand.forget(self.staging)


class MirroredTraceWriter(TraceWriter):
    """The local TraceWriter on the staging folder, uploading as it goes (see the module's notes)."""

    def __init__(self, trace_dir, schema, segment_records, first_step, mirror: Mirror, tails_sent: dict,
                 compact: bool = False):
        self.mirror = mirror
        self._tails = dict(tails_sent)  # unsealed segment name -> (bytes uploaded, next tail number)
        self._index_due: list[Path] = []  # sealed segments whose index is still to upload
        self._since, self._sent_at = 0, time.monotonic()
        self._uploads = Uploader("replay-upload")
        super().__init__(trace_dir, schema, segment_records, first_step, compact=compact)
        self._resync_tail()

    @property
    def run_path(self):
        return self.mirror.url  # what the user named, not the staging folder

    def _resume_tail(self) -> None:
        """As the local writer's; a sealed segment it indexes (and compacts) here, one the killed
        writer uploaded without its index or without its compacted copy, is uploaded again after its
        new index at the first append."""
        def indexes() -> dict:
            return {p: p.stat().st_mtime_ns for p in self.dir.glob("*.idx")}

        before = indexes()
        super()._resume_tail()
        self._index_due += sorted(p.with_suffix(".seg") for p, t in indexes().items() if before.get(p) != t)

    def _rel(self, path: Path) -> str:
        return f"trace/{path.name}"

    def _resync_tail(self) -> None:
        """After a resume: the open segment continues from what the bucket holds of it (its own
        object, uploaded whole at the last close, and its tail objects); when the staged segment
        is shorter (a cut torn record, a damaged tail object) it is uploaded whole instead."""
        name = self._path.name if self._path is not None and self._fd is not None else None
        for other in [n for n in self._tails if n != name]:
            self._drop_tails(other)
        if name is None:
            return
        if name not in self._tails:
            found = self.mirror.store.stat(self.mirror._key(self._rel(self._path)))
            self._tails[name] = (found.size if found is not None else 0, 0)
        if self._size < self._tails[name][0]:
            self._upload_whole()

    def _upload_whole(self) -> None:
        """The open segment as one object (and its sidecar), then its tail objects deleted: what
        a finished run's readers open by its sidecar, as a local run's."""
        self._uploads.wait()
        path = self._path
        self.mirror.put(self._rel(path), path.read_bytes(), replace=True)
        side = path.with_suffix(".tix")
        if side.is_file():
            self.mirror.put(self._rel(side), side.read_bytes(), replace=True)
        self._drop_tails(path.name)
        self._uploads.wait()
        self._tails[path.name] = (self._size, 0)
        self._since, self._sent_at = 0, time.monotonic()

    def append(self, rec) -> bool:
        self._uploads.check()  # an upload failed: nothing more is written past the hole
        wrote = super().append(rec)
        self.mirror.lease.renew()
        if wrote and self._fd is not None:  # (a record that sealed its segment went up with it)
            self._since += 1
            if self._since >= TAIL_RECORDS or time.monotonic() - self._sent_at >= TAIL_SECONDS:
                self._upload_tail()
        self._upload_indexes()
        return wrote

    def _seal(self) -> None:
        path = self._path
        # Opened before the seal thread starts: it may compact the segment and rename the compacted
        # copy over this name before the upload thread reads it, and a compacted segment must never
        # reach the bucket before its index (its hashes' only copy). The open file keeps the
        # sealed bytes (the seal is appended to this same file), whatever the name comes to hold.
        sealed = open(path, "rb")
        try:
            super()._seal()  # the seal is written: the file is final (its fsync is the seal thread's)
            if self._uploads.busy():  # a tail object in flight: one object in flight at most, or the loss
                self._uploads.wait()  # could reach that tail, the segment and the records after it
            self._uploads.submit(self._put_file, path, sealed)  # (replacing an unsealed upload of it, if any)
        except BaseException:
            sealed.close()
            raise
        self._drop_tails(path.name)
        self._uploads.submit(self.mirror.delete, self._rel(path.with_suffix(".tix")))
        self._index_due.append(path)
        self._since, self._sent_at = 0, time.monotonic()

    def _drop_tails(self, name: str) -> None:
        sent, number = self._tails.pop(name, (0, 0))
        for k in range(number):
            self._uploads.submit(self.mirror.delete, self._rel(self.dir / tails.tail_name(name, k)))

    def _put_file(self, path: Path, opened=None) -> None:
        """`path` uploaded under its name: what `opened` (a file object, closed here) holds when given,
        else what the name holds now."""
        if opened is None:
            data = path.read_bytes()
        else:
            with opened:
                data = opened.read()
        self.mirror.put(self._rel(path), data, replace=True)

    def _upload_tail(self) -> None:
        if self._path is None or self._fd is None:
            return
        sent, number = self._tails.get(self._path.name, (0, 0))
        if self._size > sent:
            with open(self._path, "rb") as f:
                f.seek(sent)
                payload = f.read(self._size - sent)
            name = tails.tail_name(self._path.name, number)
            if self._uploads.busy():  # one tail object in flight at most: the loss stays bounded
                self._uploads.wait()
            self._uploads.submit(self.mirror.put, self._rel(self.dir / name), tails.encode(number, sent, payload))
            self._tails[self._path.name] = (sent + len(payload), number + 1)
        self._since, self._sent_at = 0, time.monotonic()

    def _upload_indexes(self, wait: bool = False) -> None:
        if not self._index_due or (self._sealing is not None and self._sealing.is_alive() and not wait):
            return
        self._wait_seal()
        for seg in self._index_due:
            idx = seg.with_suffix(".idx")
            if idx.is_file():  # not written (a full disk) is a note: readers index it in memory
                self._uploads.submit(self._put_file, idx)
                if _compacted(seg):  # after its index: the bucket never holds it without its hashes' only copy
                    self._uploads.submit(self._put_file, seg)
        self._index_due = []

    def flush(self) -> None:
        super().flush()
        self._upload_tail()
        self._upload_indexes()
        self._uploads.wait()

    def close(self) -> None:
        path = self._path if self._fd is not None and not self._broken else None
        try:
            super().close()  # the sidecar's last entries written, the segment fsynced
        finally:
            self._upload_indexes(wait=True)
            self._uploads.wait()
        if path is not None:
            self._upload_whole()


def _compacted(segment: Path) -> bool:
    """Whether the staged segment is a compacted one now (its header's format_version)."""
    with open(segment, "rb") as f:
        head = f.read(HEADER_SIZE)
    return len(head) == HEADER_SIZE and header_version(head) >= COMPACT_VERSION


def staging_folder() -> Path:
    return Path(tempfile.mkdtemp(prefix="replay-staging-", dir=os.environ.get("REPLAY_STAGING"))) / "run"


def holds_nothing(url: str) -> bool:
    path = as_path(url)
    files, dirs = path.view.listing(path.key)
    return not files and not dirs


def download(url: str, staging: Path, trace: bool = True) -> dict:
    """The run's trace and other files copied to `staging` (the unsealed tail joined from its tail
    objects), its checkpoint folder staged with EMPTY step folders, each fetched when it is read
    (traces/storage/ondemand.py); returns {unsealed segment: (bytes, tail objects)} for the writer.
    trace=False: the trace left in the bucket (a replay's local copy reads it by ranges)."""
    root = as_path(url)
    if not isinstance(root, RemotePath) or not (root / "run.json").is_file():
        raise NotARunError(f"{root}: no such run (no run.json)")
    checkpoints = ondemand.checkpoint_folder((root / "run.json").read_bytes())
    found: dict = {}
    stack = [root]
    while stack:
        folder = stack.pop()
        rel = folder.key[len(root.key):].strip("/")
        if checkpoints is not None and rel == checkpoints:
            ondemand.stub(folder, staging / checkpoints)
            continue
        if rel == "trace" and not trace:
            continue
        files, dirs = folder.view.listing(folder.key)  # a segment's tail objects listed as the segment, joined
        for name in files:
            if name in (".lock", *MARKERS) or tails.parse_name(name) is not None:
                continue
            target = staging / (folder / name).key[len(root.key):].lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            data = (folder / name).read_bytes()
            target.write_bytes(data)
            objects = folder.view.tail_objects.get((folder / name).key)
            if objects is not None:  # the writer continues after them; damaged ones it rewrites (_resync_tail)
                damaged = (folder / name).key in folder.view.tail_damage
                found[name] = (1 << 62 if damaged else len(data), objects)
        stack += [folder / d for d in dirs]
    for marker in MARKERS:
        if (root / marker).is_file():
            (staging / marker).write_bytes((root / marker).read_bytes())
    return found


def create(cls, url: str, schema, manifest: dict, first_step: int):
    """Run.create at a URL: refused when the URL holds anything; the lease first, then the run."""
    shown = str(as_path(url))
    if not holds_nothing(url):
        raise NotARunError(f"{shown}: already exists and is not empty; choose a new --out or resume it with --resume")
    store, key = open_store(url)
    lease = Lease(store, f"{key}/.lock", shown, about={"tail_records": TAIL_RECORDS, "tail_seconds": TAIL_SECONDS})
    lease.take()
    staging = staging_folder()
    try:
        run = cls.create(staging, schema, manifest, first_step)
        run.mirror = Mirror(url, staging, lease)
        run.mirror.manifest()
        run.mirror.mark(complete=False)
    except BaseException:
        lease.release()
        shutil.rmtree(staging.parent, ignore_errors=True)
        raise
    return run


def resume(cls, url: str, mark: bool):
    """Run.resume at a URL: the lease, then the run downloaded to a staging folder."""
    shown = str(as_path(url))
    store, key = open_store(url)
    lease = Lease(store, f"{key}/.lock", shown, about={"tail_records": TAIL_RECORDS, "tail_seconds": TAIL_SECONDS})
    lease.take()
    staging = staging_folder()
    try:
        found = download(url, staging)
        run = cls.resume(staging, mark=False)
        run.mirror = Mirror(url, staging, lease)
        run.mirror.manifest_generation = store.stat(f"{key}/run.json").generation
        run.mirror.manifest()  # a new generation: a stalled earlier writer's manifest writes are refused from now on
        run.mirror.tails_found = found
        run.mirror.prune()  # notes the staged step folders: one orbax prunes from now on leaves the bucket too
        run.mirror._sent = {p.relative_to(staging).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns)
                            for p in staging.rglob("*") if p.is_file()}
        if mark:
            run.mark_incomplete()
    except BaseException:
        lease.release()
        shutil.rmtree(staging.parent, ignore_errors=True)
        ondemand.forget(staging)
        raise
    return run


def stopped_note(path) -> str:
    """The one line a crashed remote run is opened with: what its writer may have lost (its
    tail settings from its expired lease; this process's when the lease is gone)."""
    import json

    try:
        held = json.loads((path / ".lock").read_bytes())
        records, seconds = int(held["tail_records"]), float(held["tail_seconds"])
    except (OSError, ValueError, KeyError, TypeError):
        records, seconds = TAIL_RECORDS, TAIL_SECONDS
    return (f"{path}: its writer stopped without finishing (killed, preempted or cut off) and holds no lease; the "
            f"records it appended after its last uploaded tail object are not in the bucket: fewer than "
            f"{2 * records} records (a tail object every {records} records or {seconds:g} s, one in flight at most: "
            "REPLAY_TAIL_RECORDS, REPLAY_TAIL_SECONDS); resume it to continue from what is here")
