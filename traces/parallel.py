"""numpy work on several cores: `ordered_map`, a map over threads that yields in input order.

numpy's sorts, copies, comparisons and reductions of large arrays release the GIL, so a pass
over a run cut into independent pieces (the audit's hash ranges, spike's windows of steps) runs
side by side on the cores a machine has. Results come back in the order of the inputs, so a
caller folds them exactly as a plain `map` would, and at most `workers` of them are computed
ahead of the one the caller is reading: memory is bounded by the pieces in flight, never the run.
"""

from __future__ import annotations

import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Iterator, TypeVar

T = TypeVar("T")
R = TypeVar("R")

WORKERS = max(1, min(4, os.cpu_count() or 1))  # threads a pass uses: the cores, at most 4


def ordered_map(fn: Callable[[T], R], items: Iterable[T], workers: int = WORKERS,
                name: str = "replay-worker") -> Iterator[R]:
    """fn(item) of each item, in item order, `workers` items at a time in threads (one: no
    thread, a plain map). An item's exception is raised where its result would have been
    yielded; items after it may have been computed and are dropped. `items` is consumed only
    as far as results are wanted (plus the `workers` in flight)."""
    if workers <= 1:
        yield from map(fn, items)
        return
    with ThreadPoolExecutor(workers, thread_name_prefix=name) as pool:
        pending: deque = deque()
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) >= workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
