"""The object-store interface every backend implements, and the request counter.

Keys are object names inside one bucket (a local store's are absolute paths). A "generation"
is the token a conditional write compares: GCS's object generation, S3's ETag, a local file's
(inode, mtime, size). Missing objects raise FileNotFoundError (the readers already handle it);
anything else the service says becomes StorageError, a one-line user error (exit 2), never
damage: a network fault says nothing about the bytes stored.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass

from traces.errors import TraceError


class StorageError(TraceError):
    """The store could not be asked (credentials, network, a missing bucket): nothing is known
    about the run's bytes, so this is never reported as damage."""


class PreconditionFailed(StorageError):
    """A conditional write found the object present (write_if_absent) or at another generation."""


@dataclass(frozen=True)
class ObjectStat:
    size: int
    generation: str


class Store:
    """One bucket (or the local disk). Every request is counted in `counts` by kind, and bytes
    read in counts["bytes"], so a bench can report requests beside seconds."""

    scheme = ""
    bucket = ""

    def __init__(self) -> None:
        self.counts: Counter = Counter()
        self._lock = threading.Lock()

    def _count(self, kind: str, nbytes: int = 0) -> None:
        with self._lock:
            self.counts[kind] += 1
            self.counts["bytes"] += nbytes

    def url(self, key: str) -> str:
        return f"{self.scheme}://{self.bucket}/{key}"

    # reading
    def read(self, key: str) -> bytes:
        raise NotImplementedError

    def read_range(self, key: str, offset: int, size: int) -> bytes:
        """Up to `size` bytes from `offset` (fewer at the end of the object, b"" past it)."""
        raise NotImplementedError

    def list(self, prefix: str) -> tuple[dict[str, int], list[str]]:
        """One level under `prefix` (which ends with "/"): ({object name: size}, [sub-folder names])."""
        raise NotImplementedError

    def stat(self, key: str) -> ObjectStat | None:
        raise NotImplementedError

    # writing (conditional: the next slice's writer lock and COMPLETE/INCOMPLETE markers)
    def write_if_absent(self, key: str, data: bytes) -> str:
        """Writes a new object; PreconditionFailed when one exists. Returns its generation."""
        raise NotImplementedError

    def write_if_generation(self, key: str, data: bytes, generation: str) -> str:
        """Replaces the object only while it is still at `generation`; returns the new one."""
        raise NotImplementedError

    def delete(self, key: str) -> None:
        raise NotImplementedError
