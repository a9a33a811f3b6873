"""The model side of the loop protocol, as the trainer implements it (see replay/engine/protocol.py).

What replay's commands ask of a run's model through its replayable (a step recomputed with every
intermediate, a tensor by its recorded name, the loss of a state on a batch): mixed into
trainer.replayable.TrainerReplay, so the trainer answers exactly as any loop's replayable would.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from trainer import rng, sdc
from trainer.recompute import TrainerRecomputation, eval_losses
from replay.engine.placement import rotated, rotated_sharding
from trainer.sdc import faulty_config
from trainer.step import compile_step


class TrainerModelProtocol:
    """Model capabilities of TrainerReplay (self.built, self.cfg are the trainer's)."""

    # ---------------------------------------------------------------- refine, recompute, compare --eval
    # (replay/engine/recompute.py, replay/bisect/refine.py, replay/bisect/cross_distance.py,
    # replay/compare/sides.py)

    def recompute_step(self, state: Any, step: int) -> Any:
        """Step `step` recomputed from `state` (the state entering it, as restore/step give it,
        before the run's faults) with every intermediate: a replay.engine.recompute.StepRecomputation
        (trainer/recompute.py). Its inputs are exactly what the run's step program is fed (faults
        applied; a layer-bf16 fault's faulty config); its forward layers, block intermediates,
        loss and gradients come from separately jitted programs, computed on first use."""
        return TrainerRecomputation(self.built, state, step)

    def evaluate(self, state: Any, batch: np.ndarray) -> np.ndarray:
        """float32 [n]: each row's mean next-token cross-entropy under `state.params`, without
        z-loss or dropout. `batch`: int32 token rows [n, L+1] (inputs row[:-1], targets row[1:]),
        any n, evaluated data.global_batch_size rows at a time."""
        return eval_losses(self.cfg, state.params, batch)

    # ---------------------------------------------------------------- replay verify (silent data corruption)
    # (replay/verify/__init__.py; the recorded names are replay/verify/names.py's)

    def rotated_step(self, state: Any, step: int, rotate: int) -> Any:
        """(new state, metrics) of `step` from `state` (not consumed) with the mesh's devices rotated
        by `rotate` (replay/engine/placement.py): the run's step program compiled for the rotated
        shardings (compile_step keeps it), fed the state and the batch as run_step feeds them (the
        run's faults before the step, the batch it was fed, a faulty config's program), moved to the
        rotated devices. For `replay verify` on runs that are not mesh-invariant."""
        built = self.built
        plan = built.faults
        seen = plan.before(state, step, built._init_opt_state) if plan else state  # rotated() copies it
        arrays, _ = built.device_batch(plan.batch_step(step) if plan else step, fed_at=step)
        step_cfg = (plan.model_cfg(step) if plan else None) or built.cfg
        shardings = jax.tree.map(lambda a: rotated_sharding(a.sharding, rotate), built.abstract_sharded)
        program = compile_step(step_cfg, built.level(step), shardings, rotated_sharding(built.batch_sharding, rotate))
        return program(rotated(seen, rotate), rotated(arrays, rotate))

    def replica_layout(self) -> tuple[int, int] | None:
        """(devices, microbatches) of the step as replayed here; None unless mesh-invariant, the
        only mode that computes each microbatch's gradient apart, on one device."""
        built = self.built
        if not built.cfg.mesh.mesh_invariant:
            return None
        return int(built.mesh.devices.size), built.cfg.mesh.n_microbatches

    def layer_groups(self) -> list[str]:
        """The layers one replica fingerprint covers (the model's top-level modules), in execution order."""
        return [g for g, _ in sdc.layer_groups(self.built.cfg)]

    def replica_fingerprints(self, state: Any, step: int, rotate: int) -> np.ndarray:
        """uint64[microbatches, layers]: every microbatch's per-layer gradient fingerprint at `step`
        from `state` (entering it), device d doing the work of device (d + rotate) % n
        (trainer/sdc.py `replica_lanes`: no reduction, no update). The run's faults are applied as
        its step applies them (the state before, the batch fed, a faulty config's program); of the
        SDC faults only a persistent one (a bad chip) acts again. One program per distinct config,
        compiled on first use and kept."""
        built = self.built
        plan = built.faults
        seen = state if not plan else plan.before(state, step, built._init_opt_state)
        arrays, _ = built.device_batch(plan.batch_step(step) if plan else step, fed_at=step)
        step_cfg = (plan.model_cfg(step) if plan else None) or built.cfg
        programs = self.__dict__.setdefault("_replica_programs", {})
        fn = programs.get(step_cfg)  # the clean config's program, and a faulty config's
        if fn is None:
            fn = programs[step_cfg] = jax.jit(lambda p, key, s, r, b: sdc.replica_lanes(
                p, step_cfg, b, jax.random.wrap_key_data(key, impl="threefry2x32"), s, r, built.mesh))
        key = jax.random.key_data(rng.step_key(jax.random.wrap_key_data(seen.key, impl="threefry2x32"), seen.step))
        lanes = np.asarray(fn(seen.params, key, step, rotate, arrays), np.uint32)
        return (lanes[..., 0].astype(np.uint64) << np.uint64(32)) | lanes[..., 1].astype(np.uint64)

    def rerun_step(self, state: Any, step: int) -> tuple[dict, np.ndarray] | None:
        """(metrics, example hashes) of `step` from `state` as a re-execution meets it, None when
        that is `step` itself: a transient SDC fault of the run (sdc@S, a one-off event in training)
        does not act again; every other fault does (a bad chip too: it is still bad). Only at a
        transient's step is anything run here: the step with the transient left out, from a copy of
        `state` (the step donates its input), one more step and, with a chip, one more program."""
        built = self.built
        plan = built.faults
        if not plan or not any(not f.persistent and f.step == step for f in plan.sdc):
            return None
        chips = [f for f in plan.sdc if f.persistent]
        chips_cfg = faulty_config(built.cfg, chips) if chips and step >= min(f.step for f in chips) else None
        state = jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else x, state)
        state = plan.before(state, step, built._init_opt_state)
        arrays, hashes = built.device_batch(plan.batch_step(step), fed_at=step)
        if chips_cfg is None:
            program = built.compiled[built.level(step)]
        else:  # one program per level, compiled on first use (compile_step keeps it)
            shardings = jax.tree.map(lambda a: a.sharding, built.abstract_sharded)
            program = compile_step(chips_cfg, built.level(step), shardings, built.batch_sharding)
        _, metrics = program(state, arrays)
        return metrics, hashes
