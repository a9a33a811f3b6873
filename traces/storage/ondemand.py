"""A remote run's local copy for replaying it: what a replay restores from, fetched as it is needed.

Orbax, the exported program's loader, the example store and torch's checkpoint files read local
folders, so replaying a run on gs:// or s3:// restores from a local copy in a staging folder
(removed at exit), made once per process. A 7B run's checkpoints are ~100 GB each and it may keep
hundreds, so the copy holds only:

- run.json, the markers, the exported program, the example store and any other small file of the
  run (downloaded when the copy is made);
- not the trace: `replay.engine.protocol.local_run` hands the copy the remote run's own reader,
  which reads what the replay compares by ranges (traces/storage/path.py), as `show` does;
- the checkpoint folder with one EMPTY folder per step folder in the bucket (one listing): orbax's
  CheckpointManager lists its steps from those names (a finished step is a folder named by its
  step, checked: an empty one is listed), and `fetch_checkpoint(step_folder)`, called where a
  checkpoint is read (replay/record/checkpoints.py, replay/torch/checkpoint.py), downloads that
  step's files first, once per process: everything when it is restored or its arrays' metadata is
  read (orbax reads shapes through tensorstore, from the OCDBT b-tree inside the array data
  folders `d/`), the rest only (every folder but `d/`) when only its folders are looked at.
  replay.init's replayable reads the saved layout of the NEWEST checkpoint when it is built
  (replay/record/replayable.py `_as_saved`), so its replays fetch that one too: two checkpoints,
  not one, unless the restored one is the newest (reading the layout from orbax's `_sharding`
  file alone would avoid it; not done).

Cost: making the copy is O(1) requests and the bytes of the run's small files plus the example
store (downloaded whole: it grows with the examples recorded; reading only a step's rows would take
ExampleReader's index and frames read by ranges, not built); each restored checkpoint is its own
folder's listings and objects. A replay of a million-step run restoring one checkpoint moves that
checkpoint, not the run.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

from traces.errors import NotARunError
from traces.storage import RemotePath, as_path, tails

ARRAY_DATA = "d"  # orbax's (OCDBT) array chunk folders: what a metadata read does not need

_LOCK = threading.Lock()
_COPIES: dict[str, Path] = {}  # the run's URL -> its local copy
_LAZY: dict[str, tuple[RemotePath, dict[str, int]]] = {}  # local checkpoint folder -> (its URL, {step: fetched})
_FETCHED: dict[str, tuple[int, int]] = {}  # a lazily fetched file -> (size, mtime_ns): a resume's mirror does not re-upload it


def local_copy(url) -> Path:
    """The local copy of the run at `url` (see the module's notes), made once per process."""
    import atexit

    from traces.storage.mirror import staging_folder

    root = as_path(url)
    if not isinstance(root, RemotePath) or not (root / "run.json").is_file():
        raise NotARunError(f"{root}: no such run (no run.json)")
    shown = str(root)
    with _LOCK:
        if shown in _COPIES:
            return _COPIES[shown]
        staging = staging_folder()
        try:
            _copy_run(root, staging)
        except BaseException:
            shutil.rmtree(staging.parent, ignore_errors=True)
            raise
        atexit.register(shutil.rmtree, staging.parent, True)
        _COPIES[shown] = staging
        return staging


def _copy_run(root: RemotePath, staging: Path) -> None:
    from traces.storage.mirror import download  # a resume's walk of the run, less the trace

    download(str(root), staging, trace=False)
    (staging / "trace").mkdir(exist_ok=True)  # read remotely (local_run)


def checkpoint_folder(manifest: bytes) -> str | None:
    """The run's checkpoint folder relative to the run (None: outside it, an absolute path)."""
    where = json.loads(manifest).get("checkpoint_dir", "checkpoints")
    return None if os.path.isabs(where) else Path(where).as_posix().strip("/")


def stub(remote: RemotePath, local: Path) -> None:
    """The checkpoint folder `remote` staged at `local`: its own files, and each step folder
    EMPTY, fetched by `fetch_checkpoint` when it is read (also a resume's staging: mirror.py)."""
    files, dirs = remote.view.listing(remote.key)
    for name in files:
        _fetch(remote / name, local / name)
    for d in dirs:
        (local / d).mkdir(parents=True, exist_ok=True)
    _LAZY[os.path.realpath(local)] = (remote, {})


def _fetch(remote: RemotePath, local: Path) -> None:
    if tails.parse_name(remote.name) is not None:
        return
    local.parent.mkdir(parents=True, exist_ok=True)
    local.write_bytes(remote.read_bytes())
    st = local.stat()
    _FETCHED[os.path.realpath(local)] = (st.st_size, st.st_mtime_ns)


def fetched_as(path) -> tuple[int, int] | None:
    """(size, mtime_ns) of `path` as this process downloaded it; None: not downloaded here."""
    return _FETCHED.get(os.path.realpath(path)) if _FETCHED else None


def forget(local) -> None:
    """A staging folder removed: its lazy checkpoint folders and fetched files no longer tracked."""
    prefix = os.path.realpath(local)
    with _LOCK:
        for table in (_LAZY, _FETCHED):
            for key in [k for k in table if k == prefix or k.startswith(prefix + os.sep)]:
                del table[key]


def fetch_checkpoint(step_folder, arrays: bool = True) -> None:
    """Before a checkpoint step folder of a remote run's local copy is read: its files downloaded
    (arrays=False: its metadata only, not orbax's `d/` array data), once per process. Anything
    else (a local run's checkpoint) is left as it is, at the cost of one dictionary lookup."""
    if not _LAZY:
        return
    step_folder = Path(os.path.realpath(step_folder))
    found = _LAZY.get(str(step_folder.parent))
    if found is None:
        return
    remote, fetched = found
    level = 2 if arrays else 1
    with _LOCK:
        if fetched.get(step_folder.name, 0) >= level:
            return
        stack = [(remote / step_folder.name, step_folder)]
        while stack:
            there, here = stack.pop()
            files, dirs = there.view.listing(there.key)
            for name, size in files.items():
                target = here / name
                if not (target.is_file() and target.stat().st_size == size):
                    _fetch(there / name, target)
            stack += [(there / d, here / d) for d in dirs if arrays or d != ARRAY_DATA]
        fetched[step_folder.name] = level


def in_url_terms(text: str) -> str:
    """`text` (an error) with every local copy's folder named by its run's URL, as the user named it."""
    for url, staging in list(_COPIES.items()):
        text = text.replace(str(staging), url)
    return text


def fetched_checkpoints(url) -> dict[int, str]:
    """{step: "arrays" | "metadata"} of the checkpoints this process fetched from the run at `url`
    (what a replay restored from, and what it read the layout of)."""
    copy = _COPIES.get(str(as_path(url)))
    if copy is None:
        return {}
    out: dict[int, str] = {}
    for local, (_, fetched) in _LAZY.items():
        if Path(local).is_relative_to(os.path.realpath(copy)):
            out.update({int(k): ("arrays" if v == 2 else "metadata") for k, v in fetched.items() if k.isdigit()})
    return out
