"""The writer lock of a run on object storage: a lease object, since there is no flock.

`RUN/.lock` is created with write-if-absent and holds {owner, host, pid, expires}; the writer
renews it (write-if-generation, its own generation) whenever a third of the lease has passed,
and deletes it when it closes. A second writer finds the object: while its lease is live it is
refused (RunLockedError, one line); once expired (the writer was killed or lost its network)
it takes the lease over, again by generation, so of two writers racing for a stale lease one
wins. A writer that finds its lease taken by another stops (PreconditionFailed on renewal).

gcp-storage-emulator does not enforce generation preconditions (traces/storage/DESIGN.md), so
on it two racing writers are not refused; GCS itself and S3 (moto too) refuse them.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid

from traces.errors import RunLockedError
from traces.storage.base import PreconditionFailed, Store

LEASE_S = float(os.environ.get("REPLAY_LEASE_SECONDS", "60"))  # how long a killed writer keeps its run


class Lease:
    def __init__(self, store: Store, key: str, url: str, seconds: float | None = None, about: dict | None = None):
        self.store, self.key, self.url = store, key, url
        self.about = dict(about or {})  # what a reader of a crashed run may want to know of its writer
        self.seconds = LEASE_S if seconds is None else seconds
        self.owner = uuid.uuid4().hex
        self.generation: str | None = None
        self._renewed = 0.0

    def _body(self) -> bytes:
        self._renewed = time.time()
        return json.dumps({"owner": self.owner, "host": socket.gethostname(), "pid": os.getpid(),
                           "expires": self._renewed + self.seconds, **self.about}).encode()

    def take(self) -> None:
        """Holds the lease, or raises RunLockedError naming the live holder."""
        try:
            self.generation = self.store.write_if_absent(self.key, self._body())
            return
        except PreconditionFailed:
            pass
        found = self.store.stat(self.key)
        try:
            held = json.loads(self.store.read(self.key))
            expires = float(held["expires"])
        except FileNotFoundError:  # released meanwhile
            return self.take()
        except (ValueError, KeyError, TypeError):
            held, expires = {}, 0.0  # unreadable: nobody can renew it, so it is stale
        left = expires - time.time()
        if left > 0:
            who = f"{held.get('host', '?')} pid {held.get('pid', '?')}"
            raise RunLockedError(f"{self.url}: is being written by {who} (its lease ends in {left:.0f} s); wait for it to "
                                 f"finish, or if that process is gone, resume after the lease ends")
        try:
            self.generation = self.store.write_if_generation(self.key, self._body(), found.generation)
        except PreconditionFailed:
            raise RunLockedError(f"{self.url}: another writer took over its expired lease first; "
                                 "only one process may write a run") from None

    def renew(self, force: bool = False) -> None:
        """Renews after a third of the lease (cheap to call every step); PreconditionFailed when
        another writer holds it now."""
        if self.generation is not None and (force or time.time() - self._renewed > self.seconds / 3):
            self.generation = self.store.write_if_generation(self.key, self._body(), self.generation)

    def release(self) -> None:
        if self.generation is not None:
            try:
                self.store.delete(self.key)
            finally:
                self.generation = None


def live(store: Store, key: str) -> bool:
    """Whether a writer holds the run's lease now (for a remote run's status)."""
    try:
        return float(json.loads(store.read(key))["expires"]) > time.time()
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return False
