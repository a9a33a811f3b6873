"""The trainer's implementation of the loop protocol (replay/engine/protocol.py): `TrainerReplay`.

`replay run` reaches runs of trainer/ as it reaches any loop: through the factory their manifest
names, `from_run` here (runs recorded before manifests named one get it as replay.engine.protocol's
LEGACY_DEFAULT_FACTORY). The protocol itself, and `load`, live in replay/engine/protocol.py; `load`,
`Replayable` and TRAINER_FACTORY are re-exported here for older callers. The capabilities replay's
commands ask of a trainer run are methods of the mixins TrainerDataProtocol and TrainerModelProtocol.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from replay.engine.protocol import LEGACY_DEFAULT_FACTORY, Replayable, load  # noqa: F401  (re-exported)
from replay.errors import ReplayUnavailable
from traces import Run
from trainer.replay_data import TrainerDataProtocol
from trainer.replay_model import TrainerModelProtocol
from replay.record.checkpointer import Checkpointer
from replay.record.checkpoints import recorded_fingerprint
from trainer import data as datalib
from trainer import mesh as meshlib
from trainer.config import MeshConfig, from_dict
from trainer.faults import FaultPlan
from trainer.mesh import MeshError

TRAINER_FACTORY = LEGACY_DEFAULT_FACTORY


class TrainerReplay(TrainerDataProtocol, TrainerModelProtocol):
    """Replays a run of trainer/ on this machine's devices, from its own checkpoints."""

    def __init__(self, run: Run, data: str | None = None, allow_data_change: bool = False,
                 on_compile=None):
        from trainer.loop import build, state_step

        config = run.manifest.get("config")
        if not isinstance(config, dict):  # no trainer config: a run of some other loop naming no factory
            raise ReplayUnavailable(
                f"{run.path}: run.json names no loop to replay it with (no `replayable`) and holds no trainer config "
                "to rebuild replay train's step from; record it with replay.init(..., entrypoint=make) or replay train")
        cfg = from_dict(config)
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
        self._ckpt = Checkpointer(run.checkpoint_dir, create=False, step_of=state_step)
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
        expected = recorded_fingerprint(self._manifest, step)
        state = self._ckpt.restore(step, self.built.abstract_sharded, fingerprint=expected)
        if expected is None and step not in self.unverified:
            self.unverified.append(step)
            self.restore_notes.append(f"{self._ckpt.path / str(step)}: checkpoint {step} has no recorded fingerprint "
                                      "(saved before replay recorded them), so it was restored unverified")
        return state

    def step(self, state: Any, step: int) -> tuple[Any, dict, np.ndarray]:
        return self.built.run_step(state, step)

    def initial_state(self) -> Any:
        """The state entering step 0, as `replay train` builds it from the config's seed."""
        return meshlib.init_sharded_state(self.built.cfg, self.built.mesh)


def from_run(run: Run, **options: Any) -> TrainerReplay:
    return TrainerReplay(run, **options)
