"""Where a run's bytes live: the local disk, Google Cloud Storage (gs://) or S3 (s3://).

`as_path(x)` is what every reader calls on a run's location: a local path stays a pathlib.Path
(today's code, unchanged), a URL becomes a RemotePath answered by the bucket's Store. The
backends (local.py, gcs.py, s3.py) implement one small interface (base.Store): read, read a
range, list a folder, stat, write-if-absent, write-if-generation, delete; each counts its
requests. Only the backend a URL names is imported, so reading a local run never loads a cloud
client, and traces/ needs nothing beyond numpy and zstandard unless a URL is opened.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from pathlib import Path

from traces.storage.base import ObjectStat, PreconditionFailed, StorageError, Store  # noqa: F401 - the interface
from traces.storage.path import RemotePath, View

# "gs:/b/k" too: typer and pathlib turn the "//" of a URL given as a Path argument into "/".
_URL = re.compile(r"^(gs|s3):/{1,2}([^/]+)/?(.*)$")
_STORES: dict[tuple[str, str], Store] = {}


def is_url(location) -> bool:
    return isinstance(location, RemotePath) or bool(_URL.match(str(location)))


def is_remote(path) -> bool:
    return isinstance(path, RemotePath)


def open_store(url: str) -> tuple[Store, str]:
    """(the Store holding `url`, the key inside it); one Store per bucket per process, so its
    request counts add up over a command."""
    m = _URL.match(str(url))
    if m is None:
        from traces.storage.local import LocalStore
        store = _STORES.setdefault(("file", ""), LocalStore())
        return store, os.path.abspath(str(url))
    scheme, bucket, key = m.groups()
    if (scheme, bucket) not in _STORES:
        if scheme == "gs":
            from traces.storage.gcs import GCSStore as make
        else:
            from traces.storage.s3 import S3Store as make
        _STORES[(scheme, bucket)] = make(bucket)
    return _STORES[(scheme, bucket)], key.strip("/")


def url_of(location) -> str:
    """The URL `location` names, with its "//" back ("gs:/b/k" -> "gs://b/k"), without a request:
    what orbax, tensorstore and etils.epath are handed for a run's checkpoints on object storage."""
    if isinstance(location, RemotePath):
        return str(location)
    scheme, bucket, key = _URL.match(str(location)).groups()
    return f"{scheme}://{bucket}/{key.strip('/')}".rstrip("/")


def shown(location) -> str:
    """How to name `location` to the user: a URL with its "//" back, a local path as given."""
    return str(as_path(location)) if is_url(location) else str(location)


def as_path(location: str | os.PathLike | RemotePath) -> Path | RemotePath:
    """A Path for a local location, a RemotePath (with a fresh listing snapshot) for a URL."""
    if isinstance(location, RemotePath):
        return location
    if not _URL.match(str(location)):
        return Path(location)
    store, key = open_store(str(location))
    return RemotePath(View(store), key)


def request_counts() -> dict[str, int]:
    """Requests (and bytes) made to object stores by this process so far, by kind."""
    total: Counter = Counter()
    for (scheme, _), store in _STORES.items():
        if scheme != "file":
            total.update(store.counts)
    return dict(total)


def reset_counts() -> None:
    for store in _STORES.values():
        store.counts.clear()
