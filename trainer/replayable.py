"""The replay protocol: what `replay run` needs from a training loop, and the trainer's implementation.

A loop is replayable when it can (1) restore its state as it was before step k from a
checkpoint, and (2) run step k again, returning the same metrics dict it recorded and the
global per-example hashes of the batch it fed. The engine compares the result with the trace.

Runs of `trainer/` are replayed by `TrainerReplay`. Another loop names its own factory in
the run manifest ("replayable": "module:function", marked @replay.entrypoint; the legacy
"replayable_path" names a folder to import it from, used only with --allow-code, never inside
the run or a bundle: see replay/code.py); `replay run` calls `function(run, data=...,
allow_data_change=..., allow_code=...)` (allow_code only if the factory takes it) and uses what
it returns, every call into it made through replay.code.call_user. A bundle never chooses its
factory: it replays with the trainer's or replay.init's, and one whose manifest names any other
code is refused (replay/bundle/trust.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import jax
import numpy as np

from traces import Run, Schema
from trainer.replay_data import TrainerDataProtocol
from trainer.replay_model import TrainerModelProtocol


class Replayable(Protocol):
    schema: Schema  # the run's trace schema (records it produces must fit it)

    def environment(self) -> dict: ...  # this machine, in the manifest's "environment" format

    def program_hash(self) -> str | None: ...  # hash of the step program as lowered here

    def checkpoint_steps(self) -> list[int]: ...  # steps k with a saved state before step k

    def restore(self, step: int) -> Any: ...  # the state before `step` (a checkpointed step)

    def step(self, state: Any, step: int) -> tuple[Any, dict, np.ndarray]: ...  # (state, metrics, example hashes)


TRAINER_FACTORY = "trainer.replayable:from_run"


def load(run: Run, *, allow_code: bool | None = None, **options: Any) -> Replayable:
    """The replayable that the run's manifest names (the trainer's by default).

    The manifest's "replayable" entry ("module:function", and the legacy "replayable_path"
    folder) is resolved by replay.code.import_entrypoint: replay's and the trainer's own
    factories import normally, an installed module by name, a folder the manifest names only
    with `allow_code` (None: the command's --allow-code) and never from a bundle. Any factory
    but the trainer's is called with `allow_code=` too when it takes it (it may resolve more
    code of its own); exceptions raised inside a user's factory and its replayable's methods
    are the user's (replay.code.UserCodeError, exit 2), not replay's."""
    from replay.bundle.trust import manifest_problem
    from replay.code import OWN_FACTORIES, CodeNotAllowed, call_user, code_allowed, import_entrypoint, is_bundle_run
    from replay.replayer import ReplayUnavailable

    if allow_code is None:  # not passed down: the command's --allow-code (replay.code.allowing)
        allow_code = code_allowed()
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
    target = run.manifest.get("replayable", TRAINER_FACTORY)
    factory = import_entrypoint(run, target, allow_code=allow_code, search_path=run.manifest.get("replayable_path"))
    if factory is from_run:
        return factory(run, **options)
    if _takes(factory, "allow_code"):  # older factories (the legacy protocol) do not take it
        options["allow_code"] = allow_code
    if target in OWN_FACTORIES:  # replay's own: its errors are replay's
        return factory(_absolute(run), **options)
    return UserReplayable(call_user(factory, _absolute(run), **options))


_PROTOCOL = ("environment", "program_hash", "checkpoint_steps", "restore", "step")


class UserReplayable:
    """A user's replayable, with every protocol call made through replay.code.call_user: an
    exception in the user's restore or step is reported as theirs (exit 2), naming it."""

    def __init__(self, inner: Any):
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.inner, name)
        if name in _PROTOCOL and callable(value):
            from replay.code import call_user

            return lambda *a, **kw: call_user(value, *a, **kw)
        return value


def _shown(run: Run) -> str:
    return str(getattr(run, "bundle", None) or run.path)


def _takes(fn: Any, keyword: str) -> bool:
    import inspect

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
    import copy

    view = copy.copy(run)
    view.path = path.resolve()
    return view


class TrainerReplay(TrainerDataProtocol, TrainerModelProtocol):
    """Replays a run of trainer/ on this machine's devices, from its own checkpoints."""

    def __init__(self, run: Run, data: str | None = None, allow_data_change: bool = False,
                 on_compile=None):
        from trainer import data as datalib
        from trainer.checkpoint import Checkpointer
        from trainer.config import MeshConfig, from_dict
        from trainer.faults import FaultPlan
        from trainer.loop import build
        from trainer.mesh import MeshError

        cfg = from_dict(run.manifest["config"])
        self.cfg = cfg
        spec = data or cfg.data.source
        bundled = None if data else run.manifest.get("bundle", {}).get("examples")  # a bundle carries its batches
        try:
            source = (datalib.open_example_file(run.path / bundled, cfg.model.vocab_size) if bundled
                      else datalib.open_source(spec, cfg.data.token_dtype, cfg.model.vocab_size))
        except datalib.DataError as e:
            raise datalib.DataError(f"the run's data source cannot be read ({e}); pass --data PATH to point at it") from None
        recorded = run.manifest.get("data", {}).get("fingerprint")
        if recorded and source.fingerprint() != recorded and not allow_data_change:
            raise datalib.DataError(
                f"data source {spec} has changed since the run was recorded (fingerprint {source.fingerprint()[:12]} "
                f"!= {recorded[:12]}); pass --data PATH to the original data, or --allow-data-change to replay "
                "anyway and see which steps' batches differ"
            )
        self.data_changed = bool(recorded) and source.fingerprint() != recorded
        faults = FaultPlan.from_manifest(run.manifest.get("faults"), cfg)  # a faulty run replays its faults
        try:
            built = build(cfg, source, on_compile=on_compile, faults=faults)
            self.mesh_note = None
        except MeshError:
            # The recorded mesh does not fit this machine: use all local devices for data parallelism.
            mesh_cfg = MeshConfig(data=-1, fsdp=1, mesh_invariant=cfg.mesh.mesh_invariant,
                                  n_microbatches=cfg.mesh.n_microbatches)
            built = build(cfg, source, mesh_cfg=mesh_cfg, on_compile=on_compile, faults=faults)
            self.mesh_note = f"the recorded mesh does not fit {jax.device_count()} devices; replaying data-parallel"
        self.built = built
        self.schema = built.schema
        self._ckpt = Checkpointer(run.checkpoint_dir, create=False)
        self._manifest = run.manifest
        self.unverified: list[int] = []  # checkpoints restored without a recorded fingerprint to check
        self.restore_notes: list[str] = []  # one line per unverified checkpoint, for the report

    def environment(self) -> dict:
        from replay.record.environment import environment

        return environment()

    def program_hash(self) -> str | None:
        return self.built.program_hash

    def checkpoint_steps(self) -> list[int]:
        return self._ckpt.steps()

    def restore(self, step: int) -> Any:
        """The state saved at `step`, verified on device against the fingerprint recorded when it
        was saved (CheckpointDamagedError on a mismatch or unreadable files). A checkpoint with
        no recorded fingerprint (older runs) is restored unverified and noted."""
        from trainer.checkpoint import recorded_fingerprint

        expected = recorded_fingerprint(self._manifest, step)
        state = self._ckpt.restore(step, self.built.abstract_sharded, fingerprint=expected)
        if expected is None and step not in self.unverified:
            self.unverified.append(step)
            self.restore_notes.append(f"{self._ckpt.path / str(step)}: checkpoint {step} has no recorded fingerprint "
                                      "(saved before replay recorded them), so it was restored unverified")
        return state

    def step(self, state: Any, step: int) -> tuple[Any, dict, np.ndarray]:
        return self.built.run_step(state, step)


def from_run(run: Run, **options: Any) -> TrainerReplay:
    return TrainerReplay(run, **options)
