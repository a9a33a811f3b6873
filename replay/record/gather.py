"""Multi-host per-example hashes, gathered off the critical path.

Each host hashes only the rows it loads. The global hashes a record needs (in global example
order, which is process order) used to be gathered with a blocking `process_allgather` before
the step was dispatched: the host then waited for the previous step to finish on its devices
(the collective is queued behind it) and for every other host, every step, so no host could
run ahead of its devices (issue 12).

`start_gather` instead puts this host's rows into a global device array laid out like the batch
(the same `make_array_from_process_local_data` call, so hash row r is the example in batch row
r) and dispatches a jitted copy of it onto every device: an asynchronous all-gather, queued on
the devices with the step's own work, that the host does not wait for. The recorder reads
the result when it writes the record (replay/record/recorder.py), at the earliest after the
next step has been dispatched. Every process dispatches the same programs in the same order
(gather k, step k, gather k+1, step k+1, ...), so the collectives always match across hosts.

Cost: 8 bytes an example over the interconnect per step (8 KB at 1,024 examples), one tiny
program per step, and nothing held beyond the recorder's pending records; O(1) in the run's
length (a million steps move 8 GB in all, spread over the run).

`Timeline` is a debug aid (bench/multihost_dispatch.py, tests): host times of when each step
was dispatched, its hashes gathered on the host, its record written, and (optionally) its
outputs became ready. It is not part of the trace.
"""

from __future__ import annotations

import functools
import threading
import time
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec


def gather_blocking(local_hashes: np.ndarray) -> np.ndarray:
    """Every process's per-example hashes, concatenated in process order (= global order), by a
    blocking collective: how the trainer gathered them before session 4 (kept for the bench's
    comparison and as the reference the asynchronous gather is checked against)."""
    if jax.process_count() == 1:
        return np.asarray(local_hashes, np.uint64)
    from jax.experimental import multihost_utils  # multi-process runs only: not loaded by `import jax`

    words = np.asarray(local_hashes, np.uint64).view(np.uint32).reshape(-1, 2)  # no uint64 on device
    gathered = np.asarray(multihost_utils.process_allgather(words, tiled=True), np.uint32)
    return np.ascontiguousarray(gathered).reshape(-1).view(np.uint64)


class GatheredHashes:
    """The global per-example hashes of one step, being gathered on device. Reads as a uint64
    numpy array (`np.asarray`); `is_ready()` says whether reading it would wait."""

    def __init__(self, words_Bx2: jax.Array):
        self._words = words_Bx2  # uint32 [global batch, 2], replicated on every device
        self._host: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self._words.shape[0])

    def is_ready(self) -> bool:
        return self._host is not None or self._words.is_ready()

    def fetch(self) -> np.ndarray:
        if self._host is None:
            # Replicated: this process's own copy holds the whole, nothing crosses hosts here.
            words = np.asarray(self._words.addressable_data(0), np.uint32)
            self._host = np.ascontiguousarray(words).reshape(-1).view(np.uint64)
        return self._host

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        host = self.fetch()
        return host if dtype is None else host.astype(dtype, copy=False)


@functools.lru_cache(maxsize=8)
def _replicate(mesh: Any) -> Any:
    return jax.jit(lambda x: x, out_shardings=NamedSharding(mesh, PartitionSpec()))


def start_gather(local_hashes: np.ndarray, mesh: Any, batch_sharding: Any) -> np.ndarray | GatheredHashes:
    """This host's per-example hashes -> the step's global hashes: as they are with one process;
    with several, a GatheredHashes whose all-gather has been dispatched and not waited for."""
    if jax.process_count() == 1:
        return np.asarray(local_hashes, np.uint64)
    words = np.ascontiguousarray(np.asarray(local_hashes, np.uint64)).view(np.uint32).reshape(-1, 2)
    global_shape = (words.shape[0] * jax.process_count(), 2)
    local = jax.make_array_from_process_local_data(batch_sharding, words, global_shape)
    return GatheredHashes(_replicate(mesh)(local))


def hashes_ready(hashes: Any) -> bool:
    """Whether reading `hashes` would not wait: a gather in flight or a device batch not yet hashed
    (replay/record/deferred_hashes.py) says so itself; host hashes are ready."""
    return bool(hashes.is_ready()) if hasattr(hashes, "is_ready") else True


class Timeline:
    """Host-side event times of a run's steps (debug only): (event, step, seconds since start).

    Events: "dispatched" (the step's program was handed to the devices), "gathered" (its global
    hashes reached the host), "written" (its record was built and appended), "finished" (its
    outputs were ready, seen by a watcher thread: only with watch=True)."""

    def __init__(self, watch: bool = False):
        self.t0 = time.perf_counter()
        self.events: list[tuple[str, int, float]] = []
        self._lock = threading.Lock()
        self._watch: list[tuple[int, Any]] | None = [] if watch else None
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._closed = False

    def mark(self, event: str, step: int) -> None:
        with self._lock:
            self.events.append((event, step, time.perf_counter() - self.t0))

    def watch(self, step: int, outputs: Any) -> None:
        """Marks "finished" for `step` once `outputs` are ready (a background thread, in step order)."""
        if self._watch is None:
            return
        with self._wake:
            self._watch.append((step, outputs))
            self._wake.notify()
        if self._thread is None:
            self._thread = threading.Thread(target=self._watcher, daemon=True)
            self._thread.start()

    def _watcher(self) -> None:
        while True:
            with self._wake:
                while not self._watch and not self._closed:
                    self._wake.wait()
                if not self._watch:
                    return
                step, outputs = self._watch.pop(0)
            jax.block_until_ready(outputs)
            self.mark("finished", step)

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()

    def times(self, event: str) -> dict[int, float]:
        with self._lock:
            return {s: t for e, s, t in self.events if e == event}

    def order(self) -> list[tuple[str, int]]:
        with self._lock:
            return [(e, s) for e, s, _ in self.events if e != "finished"]
