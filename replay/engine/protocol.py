"""The loop protocol: what replay's commands need from a training loop, and how a run's is found.

A loop is replayable when it can (1) restore its state as it was before step k from a
checkpoint, and (2) run step k again, returning the same metrics dict it recorded and the
global per-example hashes of the batch it fed. The engine compares the result with the trace.

A run's manifest names the factory that builds its replayable ("replayable": "module:function",
marked @replay.entrypoint; the legacy "replayable_path" names a folder to import it from, used
only with --allow-code, never inside the run or a bundle: see replay/engine/code.py); `load` calls
`function(run, data=..., allow_data_change=..., allow_code=...)` (allow_code only if the factory
takes it) and uses what it returns, every call into it made through replay.engine.code.call_user. A
bundle never chooses its factory: it replays with the trainer's or replay.init's, and one whose
manifest names any other code is refused (replay/bundle/trust.py). Runs recorded by replay.init
name replay.record.replayable:from_run; runs of the embedded trainer recorded so far name none
and get LEGACY_DEFAULT_FACTORY, a string resolved like any other (nothing here imports trainer/).

Beyond the required methods (`Replayable`), a command may ask a run's replayable for optional
*capabilities* (CAPABILITIES): looked up with `getattr(rep, NAME, None)`; present, used; absent,
the command refuses in one line (exit 2) naming NAME and what a loop must give for it, never an
AttributeError and never a fallback to another loop's code. Each capability's contract is the
docstring of its entry in `Replayable` below.
"""

from __future__ import annotations

import copy
import inspect
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from replay.engine.code import OWN_FACTORIES, call_user
from traces import Run, Schema
from replay.errors import ReplayUnavailable

# The factory of a run whose manifest names none: every run of trainer/ recorded before runs
# named their factory. A string the manifest protocol resolves (replay.engine.code.OWN_FACTORIES), not
# an import: replay reaches the trainer only as it reaches any loop, through its entry point.
LEGACY_DEFAULT_FACTORY = OWN_FACTORIES[0]  # "trainer.replayable:from_run"

REQUIRED = ("environment", "program_hash", "checkpoint_steps", "restore", "step")

# Optional capabilities, by the command that asks for them (add yours, with its contract below):
CAPABILITIES = (
    "initial_state",  # replay bisect: the state entering step 0 when the run saved no checkpoint 0
    "rotated_step",  # replay verify, any loop: a step re-run on rotated devices (replay/verify/rotation.py)
    "replica_layout", "layer_groups", "replica_fingerprints", "rerun_step",  # replay verify (silent data corruption)
    "fed_rows", "example_hashes", "decode_tokens", "injected_positions",  # replay spike (tokens, faults)
    "recompute_step",  # bisect's refine and the cross-framework distance (replay/engine/recompute.py)
    "evaluate", "eval_batches",  # replay compare --eval (replay/compare/sides.py, replay/compare/jaxloop.py)
)
# Commands that must not compile (audit, pack, compare's held-out rows) reach a run's data through
# its factory's data-only entry instead: replay/rundata.py.

# Optional attributes, read with getattr(rep, NAME, default) for the report's notes:
#   mesh_note: str | None        the recorded mesh did not fit here and how the replay was laid out
#   data_changed: bool           the data source changed since recording (--allow-data-change)
#   restore_notes: list[str]     checkpoints restored without a recorded fingerprint to verify
#   replayed_from: str           "exported" (the recorded program) or "code" (the user's code)


class Replayable(Protocol):
    schema: Schema  # the run's trace schema (records it produces must fit it)

    def environment(self) -> dict:
        """This machine, in the manifest's "environment" format."""

    def program_hash(self) -> str | None:
        """The hash of the step program as lowered here (None: not known)."""

    def checkpoint_steps(self) -> list[int]:
        """The steps k with a saved state entering step k."""

    def restore(self, step: int) -> Any:
        """The state entering `step` (a checkpointed step), verified against its recorded fingerprint."""

    def step(self, state: Any, step: int) -> tuple[Any, dict, np.ndarray]:
        """(state after the step, metrics as recorded, uint64[examples] per-example hashes)."""

    # ------------------------------------------------------------------ optional capabilities

    def initial_state(self) -> Any:
        """The state entering step 0, rebuilt exactly as training built it (for runs that saved no
        checkpoint 0). Absent: a replay or bisect can start only from a saved checkpoint."""

    def rotated_step(self, state: Any, step: int, rotate: int) -> Any:
        """(new state, metrics) of `step` from `state` (not consumed), with every array of the state
        and the batch on the device `rotate` places further (replay.engine.placement.rotated: mesh
        shape and partition specs kept), the arrays returned where they were computed. The same
        program for every rotation. Absent (and no replicas): `replay verify` refuses in one line."""

    def replica_layout(self) -> tuple[int, int] | None:
        """(devices, microbatches) the step's microbatch gradients are spread over, each computed by
        one device with bits that do not depend on which (mesh-invariant); None when the step as
        replayed here does not compute them apart."""

    def layer_groups(self) -> list[str]:
        """The layers one replica fingerprint covers, in execution order: the LAYER of the trace's
        "replica/mbNN/LAYER" tensors (traces/FORMAT.md "SDC checks")."""

    def replica_fingerprints(self, state: Any, step: int, rotate: int) -> np.ndarray:
        """uint64[microbatches, layers]: each microbatch's per-layer gradient fingerprint at `step`
        from `state` (the state entering it), with the work of device d done by device
        (d - rotate) % devices; no reduction, no update. Faults the run simulates that a re-execution
        meets again (a bad chip) act, a transient does not."""

    def rerun_step(self, state: Any, step: int) -> tuple[dict, np.ndarray] | None:
        """(metrics, per-example hashes) of `step` from `state` as a re-execution meets it, without
        consuming `state`, or None when that is `step`'s own result: for a loop that simulates a
        fault which would not recur (a transient SDC), the step without it. Absent: `step`'s own."""

    def fed_rows(self, step: int) -> np.ndarray:
        """int32 [B, L+1]: the global token rows `step` was fed (inputs [:, :-1], targets [:, 1:]),
        any recorded fault applied; no step is run. Absent: spike shows no tokens (a note says so)
        and refuses --save-batch."""

    def example_hashes(self, rows: np.ndarray) -> np.ndarray:
        """uint64 [n]: the per-example hashes the trace records for token rows [n, L+1]. Absent:
        replay's hash of a one-array batch (replay.record.hashing), the trainer's bit for bit."""

    def decode_tokens(self, tokens: np.ndarray) -> str | None:
        """The text of token ids for spike's per-example view (None: not text). Absent: ids only."""

    def injected_positions(self, step: int) -> list[int]:
        """Global batch positions a recorded fault replaced at `step`. Absent: none were."""

    def recompute_step(self, state: Any, step: int) -> Any:
        """The step from `state` recomputed with every intermediate by its recorded name: a
        replay.engine.recompute.StepRecomputation (its contract there). Absent: bisect names the step and
        the layer from the trace but not the op inside it, and says recompute_step would."""

    def evaluate(self, state: Any, batch: Any) -> np.ndarray:
        """float32 [n]: each row's loss of `state` on `batch` (for the trainer, int32 token rows
        [n, L+1], the mean next-token loss), deterministic (no dropout), `state` left intact.
        Absent: `replay compare --eval` refuses in one line."""

    def eval_batches(self) -> Any:
        """A fresh finite iterable of held-out batches (each shaped as the step's, examples along
        the recorded batch axis), the same on every call: what a loop without a PyTorch reference
        is compared on (run A's, for both runs). Absent: `replay compare --eval` of such a loop
        refuses in one line (the trainer draws held-out rows from its data instead)."""


def local_run(run: Run) -> Run:
    """A run on object storage is restored from a local copy (traces/storage/ondemand.py: its
    program and examples; each checkpoint fetched when it is read) and compared with its trace
    read where it is (by ranges, not downloaded); the same run read where it is otherwise."""
    from traces.storage import is_url

    if not is_url(run.path):
        return run
    from traces.storage.ondemand import local_copy

    # The remote run's reader: the copy holds no trace. (Errors name the URL, not the copy:
    # replay/cli/console._line, ondemand.in_url_terms.)
    return Run.open(local_copy(run.path)).reading_trace(run.trace)


def load(run: Run, *, allow_code: bool | None = None, **options: Any) -> Replayable:
    """The replayable that the run's manifest names (LEGACY_DEFAULT_FACTORY when it names none).

    The manifest's "replayable" entry ("module:function", and the legacy "replayable_path"
    folder) is resolved by replay.engine.code.import_entrypoint: replay's and the trainer's own
    factories import normally, an installed module by name, a folder the manifest names only
    with `allow_code` (None: the command's --allow-code) and never from a bundle. Any factory
    but the legacy default is called with `allow_code=` too when it takes it (it may resolve more
    code of its own); exceptions raised inside a user's factory and its replayable's methods
    are the user's (replay.engine.code.UserCodeError, exit 2), not replay's."""
    from replay.bundle.trust import manifest_problem
    from replay.engine.code import OWN_FACTORIES, CodeNotAllowed, call_user, code_allowed, import_entrypoint, is_bundle_run

    if allow_code is None:  # not passed down: the command's --allow-code (replay.engine.code.allowing)
        allow_code = code_allowed()
    run = local_run(run)
    if is_bundle_run(run):  # its manifest does not choose: the trainer's factory, or replay.init's
        refused = manifest_problem(run.manifest)  # (open_run refused it already; a Run opened otherwise is judged here)
        if refused is not None:
            raise CodeNotAllowed(f"{_shown(run)}: {refused}")
        loop = (run.manifest.get("bundle") or {}).get("source_replayable")
        if loop is not None:
            raise ReplayUnavailable(f"{_shown(run)}: is a bundle of a run of its own loop ({loop}), which a bundle "
                                    "cannot replay; replay the run it was packed from")
    if run.manifest.get("recorded_by") == "replay.torch" and "replayable" not in run.manifest:
        raise ReplayUnavailable(f"{run.path}: recorded by a PyTorch loop (replay.torch), which has no JAX program to "
                                "replay; compare its trace without replaying (replay bisect --no-refine)")
    target = run.manifest.get("replayable", LEGACY_DEFAULT_FACTORY)
    factory = import_entrypoint(run, target, allow_code=allow_code, search_path=run.manifest.get("replayable_path"))
    if target == LEGACY_DEFAULT_FACTORY:  # called as it always was: the run as given, no allow_code
        return factory(run, **options)
    if _takes(factory, "allow_code"):  # older factories (the legacy protocol) do not take it
        options["allow_code"] = allow_code
    if target in OWN_FACTORIES:  # replay's own: its errors are replay's
        return factory(_absolute(run), **options)
    return UserReplayable(call_user(factory, _absolute(run), **options))


class UserReplayable:
    """A user's replayable, with every protocol call (required or capability) made through
    replay.engine.code.call_user: an exception in the user's restore or step is reported as theirs
    (exit 2), naming it."""

    def __init__(self, inner: Any):
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.inner, name)
        if name in REQUIRED + CAPABILITIES and callable(value):
            return lambda *a, **kw: call_user(value, *a, **kw)
        return value


def _shown(run: Run) -> str:
    return str(getattr(run, "bundle", None) or run.path)


def _takes(fn: Any, keyword: str) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == keyword or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _absolute(run: Run) -> Run:
    """The run as a user's factory should see it: with an absolute path, so code that hands it to
    libraries needing one (orbax's CheckpointManager) works whatever the working directory."""
    path = Path(run.path)
    if path.is_absolute():
        return run
    view = copy.copy(run)
    view.path = path.resolve()
    return view
