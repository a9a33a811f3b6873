"""A data iterator checkpointed with the train state: the second way a loop gives its batches.

The protocol is grain's (`grain.DatasetIterator`, `grain.DataLoader`'s iterator): an iterator
with `get_state()` and `set_state(state)`. `run.save(k, state, data=it)` stores `it.get_state()`
in checkpoint k, in the same orbax step as the train state (an `ocp.args.Composite` of
`state=StandardSave` and `data=JsonSave`, or for a grain iterator grain's own
`CheckpointSave`, so grain and a CheckpointManager registered with its handler read it:
replay/record/checkpoints.py), and records a fingerprint of
it in the manifest ("data_state_fingerprints") that every restore checks, as the state's is.

At replay, `replay.Loop(data=make_iterator)` gives a function returning a fresh iterator;
`IteratorFeed` restores the iterator state saved with the checkpoint the replay starts from and
takes `next(it)` for each step in order. The iterator must be deterministic: its batches a pure
function of (data, seed, position), as grain's are.
"""

from __future__ import annotations

import base64
import hashlib
import json
from typing import Any, Callable

from replay.record.errors import RecordError
from replay.engine.code import UserCodeError, call_user
from replay.errors import ReplayUnavailable

FORMAT = "replay.data-state/1"
DATA_FINGERPRINTS_KEY = "data_state_fingerprints"  # manifest: {"<step>": "<16 hex>"}, as checkpoint_fingerprints


def check_iterator(it: Any, call: str) -> None:
    if not (callable(getattr(it, "get_state", None)) and callable(getattr(it, "set_state", None))):
        raise RecordError(f"{call}: data= is the data iterator, with get_state() and set_state(state) as grain's "
                          f"iterators have; {type(it).__name__} has not both")


def payload(it: Any) -> dict:
    """`it.get_state()` as the JSON stored in the checkpoint: a JSON value as is, bytes (grain's
    DataLoader iterator) in base64, so set_state gets back exactly what get_state gave."""
    state = it.get_state()
    if isinstance(state, (bytes, bytearray)):
        return {"format": FORMAT, "kind": "bytes", "value": base64.b64encode(bytes(state)).decode("ascii")}
    try:
        exact = json.loads(json.dumps(state, allow_nan=False)) == state
    except (TypeError, ValueError):
        exact = False
    if not exact:
        raise RecordError(f"run.save(..., data=): {type(it).__name__}.get_state() returned a {type(state).__name__} "
                          "that JSON does not hold exactly; return bytes or a dict of str, int, float, bool and lists")
    return {"format": FORMAT, "kind": "json", "value": state}


def save_args(it: Any, stored: dict) -> Any:
    """How checkpoint k holds the iterator: a grain iterator through grain's own orbax handler
    (`grain.checkpoint.CheckpointSave`: DATA/process_<i>-of-<n>.json, what grain's restore and a
    user's CheckpointManager registered with grain's handler read), anything else as replay's
    JSON payload. Either way the manifest's fingerprint is of `stored`, the same state."""
    if type(it).__module__.split(".")[0] == "grain":
        try:
            from grain.checkpoint import CheckpointSave
        except ImportError:  # a grain without orbax support: replay's own item
            return stored
        return CheckpointSave(item=it)
    return stored


GRAIN_FILE = "process_{index}-of-{count}.json"  # grain's CheckpointHandler's file (one per process)


def from_grain_text(text: str, fingerprint_recorded: str | None) -> dict:
    """The stored payload of a grain-written iterator state: grain writes a DatasetIterator's JSON
    state, and a DataLoader iterator's bytes decoded; the payload whose fingerprint was recorded
    is the one (without one: JSON when the text parses). None when neither matches."""
    candidates = []
    try:
        candidates.append({"format": FORMAT, "kind": "json", "value": json.loads(text)})
    except ValueError:
        pass
    candidates.append({"format": FORMAT, "kind": "bytes", "value": base64.b64encode(text.encode()).decode("ascii")})
    if fingerprint_recorded is None:
        return candidates[0]
    return next((c for c in candidates if fingerprint(c) == fingerprint_recorded), None)


def state_of(stored: dict) -> Any:
    """What `set_state` takes, from a stored payload (checked by `fingerprint` before this)."""
    return base64.b64decode(stored["value"]) if stored["kind"] == "bytes" else stored["value"]


def fingerprint(stored: Any) -> str:
    """64 bits of the payload's canonical JSON (sorted keys, no spaces) as 16 hex digits."""
    text = json.dumps(stored, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def well_formed(stored: Any) -> bool:
    return (isinstance(stored, dict) and stored.get("format") == FORMAT and stored.get("kind") in ("json", "bytes")
            and "value" in stored)


class IteratorFeed:
    """The batch of step k from a `replay.Loop(data=...)` iterator positioned by checkpoints.

    `restore(c)` sets the iterator to the state saved with checkpoint c (position c, the step its
    next batch feeds); `batch(k)` takes batches in order from there. A step asked for again (the
    refinement of bisect re-runs one step for its taps) is served from the last batch; a step the
    iterator has passed, or one with a checkpoint between the iterator's position and it, restores
    the newest checkpoint at or before it first. So random access to step k costs k - c `next`
    calls, c the newest checkpoint at or before k (at most the checkpoint interval: ~1,000 batches
    for a million-step run checkpointed every 1,000 steps), and one batch of memory.
    """

    def __init__(self, make: Callable[[], Any], checkpoint_steps: Callable[[], list[int]], load: Callable[[int], Any]):
        self._make, self._list_steps, self._load, self._call = make, checkpoint_steps, load, call_user
        self._steps: list[int] | None = None  # listed once: a replay opens the run read-only
        self._it: Any = None
        self.position: int | None = None  # the step the iterator's next batch feeds; None: not positioned
        self._last: tuple[int, Any] | None = None

    def fresh(self) -> Any:
        """A new iterator from the Loop's data function, checked for the protocol."""
        it = self._call(self._make)
        check_iterator(it, "replay.Loop(data=...)()")
        if not callable(getattr(it, "__next__", None)):
            raise RecordError(f"replay.Loop(data=...) returned a {type(it).__name__}, not an iterator (no __next__); "
                              "return iter(dataset)")
        return it

    def restore(self, step: int) -> None:
        """The iterator at checkpoint `step`'s saved state (raises CheckpointDamagedError for a damaged one)."""
        state = self._load(step)
        if self._it is None:
            self._it = self.fresh()
        self._call(self._it.set_state, state)
        self.position, self._last = step, None

    def batch(self, step: int) -> Any:
        if self._last is not None and self._last[0] == step and not _deleted(self._last[1]):
            return self._last[1]
        if self._steps is None:
            self._steps = sorted(self._list_steps())
        newest = max((c for c in self._steps if c <= step), default=None)
        if self.position is None or step < self.position or (newest is not None and newest > self.position):
            if newest is None:
                raise ReplayUnavailable(f"no checkpoint at or before step {step} holds the data iterator's state, so "
                                        "its batch cannot be found")
            self.restore(newest)
        while True:
            batch = next_batch(self._it, f"before the batch of step {self.position}")
            self.position += 1
            if self.position > step:
                self._last = (step, batch)
                return batch


def next_batch(it: Any, where: str = "before its first batch") -> Any:
    """next(it), through replay.engine.code.call_user (an exception there is the user's); an iterator
    that ends is a run the Loop's data cannot replay."""
    try:
        return call_user(it.__next__)
    except UserCodeError as e:
        if not isinstance(e.original, StopIteration):
            raise
        raise ReplayUnavailable(f"the Loop's data iterator ended {where}") from None


def _deleted(batch: Any) -> bool:
    """A batch the step donated cannot be fed again: take it from the iterator anew."""
    import jax

    return any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves(batch))
