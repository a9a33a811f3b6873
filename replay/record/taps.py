"""`replay.tap(tree, name)`: fingerprint a tree the step computes (gradients, activations).

A tap returns its tree unchanged. While the recording wrapper traces the step (at record time
and again at replay, through the run's `replay.Loop`), it also collects the tree, and the
wrapper fingerprints every leaf into the record, named `NAME/<leaf path>`. Outside that trace
(the step called unwrapped) a tap does nothing, so a step keeps working without replay.

The kind (where the tree sits in causal order) comes from the name unless given: names starting
with "grad" are `backward`, "rng" means the leaves are RNG key words (typed keys or uint32) that
join the record's RNG words, anything else is `forward`.

Limitation: call it at the top level of the step function, on values the step itself holds, not
inside a function that JAX transforms separately (`jax.grad`'s loss function, `scan`, `vmap`, an
inner `jit`): a value from inside one of those cannot leave it. Return activations from the loss
function as aux (`has_aux=True`) and tap them after `value_and_grad`.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

from replay.record.errors import RecordError

KINDS = ("forward", "backward", "rng")
_active = threading.local()


def kind_of(name: str, kind: str | None) -> str:
    if kind is None:
        return "backward" if name.startswith("grad") else "rng" if name.startswith("rng") else "forward"
    if kind not in KINDS:
        raise RecordError(f"replay.tap({name!r}, kind={kind!r}): kind must be one of {', '.join(KINDS)}")
    return kind


def tap(tree: Any, name: str, kind: str | None = None) -> Any:
    """Returns `tree`; while a recorded step is traced, also records its leaves' fingerprints."""
    taps = getattr(_active, "taps", None)
    if not isinstance(name, str) or not name or "/" in name:
        raise RecordError(f"replay.tap: the name {name!r} must be a non-empty string without '/'")
    kind = kind_of(name, kind)
    if taps is not None:
        if any(n == name for n, _, _ in taps):
            raise RecordError(f"replay.tap: the step taps {name!r} twice; give each tap its own name")
        taps.append((name, kind, tree))
    return tree


@contextlib.contextmanager
def collecting():
    """Collects the taps made while the body runs (the wrapper's trace of the step)."""
    outer = getattr(_active, "taps", None)
    _active.taps = taps = []
    try:
        yield taps
    finally:
        _active.taps = outer
