"""Checkpoints of a recorded run: orbax, checkpoint k = the state entering step k.

The one checkpoint module for every loop (`replay.init`'s runs, the trainer's, and replay reading
either): this file holds what reading one orbax step takes, used on any CheckpointManager (a
run's own or the user's); replay/record/checkpointer.py holds `Checkpointer`, the writer and
reader built on it (asynchronous saves that never overlap, keep-N pruning, read-only opening).

The run's own manager saves into RUN/checkpoints (or the user's CheckpointManager, given to
`replay.init(checkpoints=...)`, saves where it saves; the manifest records that folder). Every
save records `state_fingerprint(state)` (replay/record/fingerprint.py: every leaf's path, dtype,
shape and bits) in the manifest ("checkpoint_fingerprints"); every restore at replay or resume
recomputes it on device and refuses a state that differs: orbax stores array chunks with no
checksum (zstd without frame checksums), so a flipped bit in a chunk restores silently, and only
this catches it. Unreadable chunk files (truncated, zeroed, missing) are CheckpointDamagedError
too. Before any array is read, the target's leaves are checked against the checkpoint's metadata
(a small JSON file): a state built from another config is one line naming the first leaf that
differs, not orbax's error. Replay opens the folder read-only: nothing in the run changes.

Restoring onto a layout (device count, mesh) other than the one saved needs a target with
shardings (a tree of jax.ShapeDtypeStruct with `sharding=`); restored bytes are identical to the
saved ones on any layout (tested 8 devices <-> 1).

A checkpoint saved with the data iterator's state (`run.save(k, state, data=it)`,
replay/record/data_iterator.py) is one orbax step of two items, as orbax users write it:
`ocp.args.Composite(state=StandardSave(state), data=JsonSave(it.get_state()))`, i.e. the folders
k/state and k/data; one saved without it is orbax's single item (k/default). `restore` reads the
state of either; `restore_data` the iterator state, checked against its recorded fingerprint.
Orbax reports through absl logging, asyncio and unraisable-exception hooks from its threads;
all of that is kept off the terminal (replay/record/orbax_io.py): failures become one-line errors.
"""

from __future__ import annotations

import bisect
from pathlib import Path
from typing import Any, Callable

from replay.record.orbax_io import (
    _WHAT_TO_DO, CheckpointDamagedError, CheckpointError, _quiet_orbax, _read_failure,
)
from replay.record import data_iterator

FINGERPRINTS_KEY = "checkpoint_fingerprints"  # run manifest: {"<step>": "<16 hex>"}, of every loop's runs
STATE, DATA = "state", "data"  # the items of a checkpoint that holds the data iterator's state


def recorded_fingerprint(manifest: dict, step: int) -> str | None:
    """The state fingerprint recorded when checkpoint `step` was saved; None for runs (or
    checkpoints) from before fingerprints were recorded."""
    value = (manifest.get(FINGERPRINTS_KEY) or {}).get(str(step))
    return value if isinstance(value, str) else None


def open_manager(path: Path, read_only: bool, keep: int = 0) -> Any:
    """An orbax CheckpointManager over `path`. The writer keeps the `keep` newest checkpoints (0:
    all), may save asynchronously (each save says whether it waits), and leaves a crashed save's
    temporary folder for people to inspect. Read-only never writes, creates or deletes anything:
    no root directory, no metadata, no cleanup of temporary or old checkpoints."""
    import orbax.checkpoint as ocp

    if keep < 0:
        raise CheckpointError(f"checkpoint keep={keep} must be >= 0 (0 keeps all)")
    if read_only:
        options = ocp.CheckpointManagerOptions(read_only=True, create=False, save_interval_steps=0,
                                               save_root_metadata=False, cleanup_tmp_directories=False)
    else:
        options = ocp.CheckpointManagerOptions(save_interval_steps=1, max_to_keep=keep or None, create=True,
                                               cleanup_tmp_directories=False, save_root_metadata=True,
                                               enable_async_checkpointing=True,
                                               atomicity_options=_atomicity(path))
    with _quiet_orbax():  # orbax logs that read-only is read-only
        return ocp.CheckpointManager(location(path), options=options)


def _step_folder(manager: Any, step: int, arrays: bool = False) -> Any:
    """Checkpoint `step`'s folder, made readable first: a remote run's local copy fetches it
    (traces/storage/ondemand.py; arrays=False: its metadata only), once per process."""
    where = directory_of(manager) / str(step)
    if isinstance(where, Path):  # (a URL's epath.Path: orbax reads the bucket itself)
        from traces.storage.ondemand import fetch_checkpoint

        fetch_checkpoint(where, arrays)
    return where


def directory_of(manager: Any) -> Any:
    return location(str(manager.directory))


def location(path: Any) -> Any:
    """A checkpoint folder as orbax takes it: a local Path, made absolute, or for a URL (gs://,
    s3://; also "gs:/b/k", as pathlib writes one) an etils epath.Path: orbax writes object storage
    itself (tensorstore for the arrays, epath for its folders and small files), as on a TPU pod."""
    from traces.storage import is_url, url_of

    if is_url(path):
        import fsspec
        from etils import epath

        # gcsfs/s3fs cache folder listings: a process would not see the files another process
        # wrote since it listed (orbax's multi-process save waits on them; seen: saves never ending)
        for scheme in ("gs", "s3"):
            fsspec.config.conf.setdefault(scheme, {}).setdefault("use_listings_cache", False)
        if url_of(path).startswith("s3://"):
            _orbax_writes_s3()
        return epath.Path(url_of(path))
    return Path(path).absolute()


def _atomicity(path: Any) -> Any:
    """How orbax makes a save atomic: its default for gs:// and local folders (gs://: a
    commit_success.txt; local: a renamed temporary folder); for s3:// the commit file too, as on
    GCS: S3 has no rename, and s3fs's recursive move of orbax's temporary folder fails
    (FileNotFoundError copying a folder's key, seen on moto)."""
    import orbax.checkpoint as ocp

    from traces.storage import is_url, url_of

    if is_url(path) and url_of(path).startswith("s3://"):
        return ocp.options.AtomicityOptions(mode=ocp.options.AtomicityMode.COMMIT_FILE)
    return None


def _orbax_writes_s3() -> None:
    """orbax-checkpoint 0.12.8 (the newest) builds a tensorstore kvstore for gs:// only: an s3://
    folder falls to the file driver ("Checkpoint path should be absolute. Got s3:/b/..."). This
    gives s3:// tensorstore's s3 driver where orbax picks the gcs one (its private functions;
    tests/traces/test_remote_processes.py fails if an orbax release renames them), with
    AWS_ENDPOINT_URL as the spec's endpoint: tensorstore's s3 driver does not read that variable
    (an S3-compatible store, or the tests' moto, is otherwise never asked)."""
    import os

    from orbax.checkpoint._src.path import gcs_utils
    from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

    if getattr(ts_utils, "_replay_s3", False):
        return
    normalize, use_gcs, gcs_kvstore = ts_utils._normalize_path, ts_utils._use_gcs_driver, gcs_utils.get_kvstore_for_gcs

    def kvstore(path: str) -> dict:
        if not path.startswith("s3://"):
            return gcs_kvstore(path)
        bucket, _, key = path[len("s3://"):].partition("/")
        spec = {"driver": "s3", "bucket": bucket, "path": key}
        if os.environ.get("AWS_ENDPOINT_URL"):
            spec["endpoint"] = os.environ["AWS_ENDPOINT_URL"]
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        return spec | ({"aws_region": region} if region else {})

    ts_utils._normalize_path = lambda p: "s3://" + normalize(p)[len("s3:/"):] if str(p).startswith("s3:/") else normalize(p)
    ts_utils._use_gcs_driver = lambda d: d.startswith("s3://") or use_gcs(d)
    gcs_utils.get_kvstore_for_gcs = kvstore
    ts_utils._replay_s3 = True


def steps(manager: Any) -> list[int]:
    """Steps with a finished checkpoint, ascending (orbax writes into a temporary folder and
    renames it when complete, so a save in flight or crashed is not listed)."""
    with _quiet_orbax():
        manager.reload()  # another process (the trainer) may have saved since it was opened
        return sorted(int(s) for s in manager.all_steps())


def latest_at_or_before(saved: list[int], step: int) -> int | None:
    """The largest of the ascending `saved` steps <= `step`, or None if there is none."""
    i = bisect.bisect_right(saved, step)
    return saved[i - 1] if i else None


def restore(manager: Any, step: int, abstract_state: Any, fingerprint: str | None,
            step_of: Callable[[Any], int] | None = None) -> Any:
    """Checkpoint `step` restored onto `abstract_state` (any device count or mesh its shardings
    say), verified against `fingerprint` (None: unverified; the caller says so). step_of: reads
    the step a state is at (a TrainState's .step); a checkpoint holding another is damaged.
    All processes of a multi-process run must call it."""
    import orbax.checkpoint as ocp

    from replay.record.fingerprint import state_fingerprint

    where = directory_of(manager) / str(step)
    have = steps(manager)
    if step not in have:
        raise CheckpointError(f"{directory_of(manager)}: no checkpoint at step {step} (saved steps: "
                              f"{_list(have) if have else 'none'}); pick a saved step")
    _step_folder(manager, step, arrays=True)
    check_target(manager, step, abstract_state)  # before orbax starts reading arrays
    try:
        with _quiet_orbax():
            if is_composite(manager, step):
                state = manager.restore(step, args=ocp.args.Composite(
                    **{STATE: ocp.args.StandardRestore(abstract_state)}))[STATE]
            else:
                state = manager.restore(step, args=ocp.args.StandardRestore(abstract_state))
    except Exception as e:  # noqa: BLE001 - the target matched (checked above): the files are bad
        # Orbax raises bare Exceptions wrapping TensorStore's ValueErrors (2 KB of spec).
        raise CheckpointDamagedError(f"{where}: checkpoint {step} is damaged ({_read_failure(e)}); "
                                     f"{_WHAT_TO_DO}") from None
    if step_of is not None and step_of(state) != step:
        raise CheckpointDamagedError(f"{where}: checkpoint {step} is damaged (it holds the state after "
                                     f"step {step_of(state)}); {_WHAT_TO_DO}")
    if fingerprint is not None:
        actual = state_fingerprint(state)
        if actual != fingerprint:
            raise CheckpointDamagedError(f"{where}: checkpoint {step} is damaged (its state's fingerprint {actual} "
                                         f"differs from {fingerprint} recorded when it was saved); {_WHAT_TO_DO}")
    return state


def check_target(manager: Any, step: int, abstract_state: Any) -> None:
    """CheckpointError naming the first leaf whose presence, shape or dtype differs between
    checkpoint `step` and the target. Reads the checkpoint's metadata only (one JSON file)."""
    meta = state_metadata(manager, step)
    if not meta:  # no readable metadata: the restore itself reports what is wrong
        return
    stored, target = _shapes(meta), _shapes(abstract_state)
    problem = None
    for name in list(target) + [n for n in stored if n not in target]:  # in state order
        if name not in stored:
            problem = f"the target has {name} {_fmt(target[name])}, the checkpoint does not"
        elif name not in target:
            problem = f"the checkpoint has {name} {_fmt(stored[name])}, the target does not"
        elif not _same(stored[name], target[name]):
            problem = f"{name} is {_fmt(stored[name])} in the checkpoint, {_fmt(target[name])} in the target"
        if problem:
            raise CheckpointError(f"{directory_of(manager)}: checkpoint {step} does not match the state to "
                                  f"restore: {problem}; restore it onto the state it was saved from (the same "
                                  "config and model)")


def is_composite(manager: Any, step: int) -> bool:
    """Whether checkpoint `step` was saved with a data iterator's state (the Composite layout)."""
    return (_step_folder(manager, step) / STATE).is_dir()


def has_data(manager: Any, step: int) -> bool:
    """Whether checkpoint `step` holds a data iterator's state."""
    return (_step_folder(manager, step) / DATA).is_dir()


def state_metadata(manager: Any, step: int) -> Any:
    """The saved state's tree of orbax ArrayMetadata (shape, dtype) in checkpoint `step`, of
    either layout; None when orbax cannot read it (a restore then says why)."""
    import orbax.checkpoint as ocp

    # arrays=True: orbax reads each array's shape and dtype through tensorstore, from the OCDBT
    # b-tree kept in the array data folders (checked: without d/ this returns None)
    item = _step_folder(manager, step, arrays=True) / (STATE if is_composite(manager, step) else "default")
    try:
        with _quiet_orbax():
            meta = ocp.StandardCheckpointer().metadata(item)
    except Exception:  # noqa: BLE001 - unreadable metadata is the restore's to report
        return None
    return getattr(getattr(meta, "item_metadata", None), "tree", None)


def restore_data(manager: Any, step: int, fingerprint: str | None) -> Any:
    """The data iterator state saved with checkpoint `step` (what its `set_state` takes), verified
    against `fingerprint` (None: unverified)."""
    import orbax.checkpoint as ocp


    where = _step_folder(manager, step, arrays=True) / DATA
    if not has_data(manager, step):
        saved = ("it is missing" if is_composite(manager, step) else
                 "the checkpoint was saved without run.save(..., data=)")
        raise CheckpointDamagedError(f"{where}: checkpoint {step} holds no data iterator state ({saved}); "
                                     f"{_WHAT_TO_DO}")
    grain_file = where / data_iterator.GRAIN_FILE.format(index=0, count=1)
    if grain_file.is_file():  # written by grain's own handler (a grain iterator): read without it
        try:
            text = grain_file.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise CheckpointDamagedError(f"{grain_file}: the data iterator state of checkpoint {step} cannot be read "
                                         f"({e}); {_WHAT_TO_DO}") from None
        stored = data_iterator.from_grain_text(text, fingerprint)
        if stored is None:
            raise CheckpointDamagedError(f"{grain_file}: the data iterator state of checkpoint {step} is damaged (its "
                                         f"fingerprint differs from {fingerprint} recorded when it was saved); "
                                         f"{_WHAT_TO_DO}")
        return data_iterator.state_of(stored)
    try:
        with _quiet_orbax():
            stored = manager.restore(step, args=ocp.args.Composite(**{DATA: ocp.args.JsonRestore()}))[DATA]
    except Exception as e:  # noqa: BLE001 - orbax raises bare Exceptions for unreadable items
        raise CheckpointDamagedError(f"{where}: the data iterator state of checkpoint {step} cannot be read "
                                     f"({_read_failure(e)}); {_WHAT_TO_DO}") from None
    if not data_iterator.well_formed(stored):
        raise CheckpointDamagedError(f"{where}: the data iterator state of checkpoint {step} is not one "
                                     f"run.save(..., data=) wrote; {_WHAT_TO_DO}")
    if fingerprint is not None and data_iterator.fingerprint(stored) != fingerprint:
        raise CheckpointDamagedError(f"{where}: the data iterator state of checkpoint {step} is damaged (its "
                                     f"fingerprint {data_iterator.fingerprint(stored)} differs from {fingerprint} "
                                     f"recorded when it was saved); {_WHAT_TO_DO}")
    return data_iterator.state_of(stored)


def _shapes(tree: Any) -> dict[str, tuple[tuple[int, ...], str | None]]:
    """{"opt_state.1.count": (shape, dtype)} for a state, its abstract target or orbax's
    metadata of it (which stores NamedTuples as dicts of their fields)."""
    import jax
    import numpy as np

    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        parts = [str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k)))) for k in path]
        shape = tuple(int(d) for d in getattr(leaf, "shape", np.shape(leaf)))
        dtype = getattr(leaf, "dtype", None)
        try:
            name = str(np.dtype(dtype)) if dtype is not None else type(leaf).__name__
        except TypeError:  # an extended dtype (a typed PRNG key): orbax stores it in its own form
            name = None
        out[".".join(parts)] = (shape, name)
    return out


def _same(stored: tuple[tuple[int, ...], str | None], target: tuple[tuple[int, ...], str | None]) -> bool:
    if stored[1] is None or target[1] is None:  # an extended dtype: orbax's restore checks it
        return True
    return stored == target


def _fmt(shape_dtype: tuple[tuple[int, ...], str | None]) -> str:
    shape, dtype = shape_dtype
    return f"{dtype}{list(shape)}"


def _list(saved: list[int], most: int = 12) -> str:
    if len(saved) <= most:
        return ", ".join(map(str, saved))
    return ", ".join(map(str, saved[:most // 2])) + ", ..., " + ", ".join(map(str, saved[-most // 2:]))


def run_checkpoint_dir(run: Any) -> Path:
    """Where `run`'s checkpoints are: the manifest's "checkpoint_dir" (relative to the run folder,
    or absolute for a user's own manager elsewhere), RUN/checkpoints when it names none."""
    where = run.manifest.get("checkpoint_dir", "checkpoints")
    return Path(where) if Path(where).is_absolute() else Path(run.path).absolute() / where
