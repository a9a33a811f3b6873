"""A loop's own checkpoints given to replay: `replay.Loop(checkpoints=...)`.

A loop that checkpoints through its own manager, in its own layout and numbering (MaxText's orbax
Checkpointer, whose checkpoint s is the state AFTER step s), need not save a second copy of its
state with `run.save`: its Loop hands replay an object with two methods (`LoopCheckpoints`):

    steps()    -> the steps k whose state entering step k it can give, in replay's numbering
    restore(k) -> that state, a tree like the Loop's state (what the step takes)

`replay run`, `bisect` and every command that restores a state ask it for a step replay saved no
checkpoint of (replay's own checkpoint k, when there is one, is used first). Each state it gives is
verified before any step runs on it, against the fingerprint of the state entering step k that the
trace recorded at the layer level (run.step's default level: every state leaf's 64-bit fingerprint,
the rows the engine compares at every replayed step), leaf for leaf; a state that differs in one bit
or one leaf (a wrong label, a damaged chunk, another run's checkpoint) is refused in one line naming
the checkpoint and the first leaf (CheckpointDamagedError, exit 2). Where the trace holds no state
fingerprints (a step-level run, or a step outside the trace) the run's recorded checkpoint
fingerprint of k is used when it has one, else the state is restored unverified and a note says so.
Cost per restore: the loop's own restore, one record read and one fused fingerprint pass over the
state (8 bytes a leaf reach the host).
"""

from __future__ import annotations

from typing import Any, Iterable, Protocol, runtime_checkable

from replay.record import checkpoints as ckpts
from replay.record.fingerprint import leaf_fingerprints, state_fingerprint
from replay.record.orbax_io import CheckpointDamagedError


@runtime_checkable
class LoopCheckpoints(Protocol):
    """What `replay.Loop(checkpoints=...)` takes (any object with these two methods)."""

    def steps(self) -> Iterable[int]:
        """The steps k (replay's numbering: the state ENTERING step k) this object can restore."""

    def restore(self, step: int) -> Any:
        """The state entering `step`, a tree with the Loop's state's structure, shapes and dtypes."""

    # Optional: describe(step) -> str, where that checkpoint is (a folder), for messages; without it
    # they name the restore method.


def verify(state: Any, step: int, run: Any, where: str) -> str | None:
    """Checks the state a loop restored as entering `step` against the run (see the module doc);
    raises CheckpointDamagedError when it differs, returns a note when nothing could check it."""
    schema = run.schema
    state_rows = [i for i, (_, kind) in enumerate(schema.tensors) if kind == "state"]
    record = run.trace.read(step) if step in run.trace else None
    if record is not None and record.fingerprints is not None and state_rows:
        recorded = [int(record.fingerprints[i]) for i in state_rows]
        got = leaf_fingerprints(state)
        if len(got) != len(recorded):
            raise CheckpointDamagedError(f"{where}: the state restored as entering step {step} has {len(got)} leaves, "
                                         f"the run recorded {len(recorded)}: it is not this run's state")
        bad = next((i for i, (a, b) in enumerate(zip(got, recorded)) if a != b), None)
        if bad is not None:
            name = schema.tensors[state_rows[bad]][0]
            raise CheckpointDamagedError(f"{where}: the state restored as entering step {step} differs from the one "
                                         f"the run recorded there, first at {name} (fingerprint {got[bad]:016x}, "
                                         f"recorded {recorded[bad]:016x}): the checkpoint is damaged or not this step's")
        return None
    expected = ckpts.recorded_fingerprint(run.manifest, step)
    if expected is None:
        return f"checkpoint {step} ({where}) has no recorded fingerprint to check, so it was restored unverified"
    got_hash = state_fingerprint(state)
    if got_hash != expected:
        raise CheckpointDamagedError(f"{where}: the state restored as entering step {step} has fingerprint {got_hash}, "
                                     f"the run recorded {expected}: the checkpoint is damaged or not this step's")
    return None
