"""The remote writer's uploads, in order, on one thread, so the recording loop does not wait on
the network for each tail object or sealed segment (at 20 ms a request a tail object every 256
records and a segment every 16,384 paused the loop for a request each; the segment's read and
upload, ~200 MB at scale, far longer).

Jobs run in the order submitted (a segment's upload before its tail objects' deletion, tail K
before K + 1). The writer keeps at most one tail object in flight (it waits for the queue before
handing over the next), so a killed writer loses fewer than two tail objects' worth of records.
The first failure stops every later job (nothing uploaded past a hole) and is raised on the
writer's thread at its next append, flush or close; `wait()` is a durability point.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable


class Uploader:
    def __init__(self, name: str):
        self._jobs: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._name = name

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        self.check()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        self._jobs.put((fn, args))

    def _run(self) -> None:
        while True:
            fn, args = self._jobs.get()
            try:
                if self._error is None:
                    fn(*args)
            except BaseException as e:  # noqa: BLE001 - raised on the writer's thread by check()
                self._error = e
            finally:
                self._jobs.task_done()

    def busy(self) -> bool:
        return self._jobs.unfinished_tasks > 0

    def wait(self) -> None:
        """Until every job submitted is done; raises the first failure."""
        self._jobs.join()
        self.check()

    def check(self) -> None:
        if self._error is not None:
            raise self._error  # kept: every later call raises it too, so nothing is written past it
