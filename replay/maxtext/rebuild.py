"""MaxText's loop rebuilt from a run's recorded argv, for a replay with MaxText's code.

MaxText builds its model, optimizer, mesh, sharding rules, state and data pipeline inside
`train.main` (train_utils.setup_train_loop, then train_utils.jit_train_step). Rather than copy
that sequence (and drift from it as MaxText changes), `rebuild` runs MaxText's own `main` with the
recorded argv and stops it at its first call of the jitted step: what that call receives is the
state entering step 0 and step 0's batch, built by MaxText's code exactly as in training.

Two settings are overridden for the rebuild, neither part of the step's program: MaxText's
checkpointing is off (a rebuild must start from step 0's state, not resume from whatever the run's
output folder holds) and its output folder is a temporary one (a replay writes nothing of
MaxText's where the run wrote). The step is traced inside replay's program, where `jax.set_mesh`
may not be entered, so a replay sets MaxText's mesh and logical axis rules for its thread (what
MaxText's own `with jax.set_mesh(mesh), logical_axis_rules(...)` gives the trace while training), and
traces MaxText's jitted step itself (its shardings and donation kept, as `run.step` kept them).

Batches: `batch_at(k)` draws from MaxText's own data loader, forward from the last batch drawn (a
replay asks in step order), or from a fresh iterator when asked for an earlier step (k + 1 `next`
calls; MaxText's pipelines are deterministic in the step). A replay restored from MaxText's checkpoint
of a `dataset_type=grain` run first sets a fresh loader's Grain iterator to the state MaxText saved with
it (`seek`), so step k costs one `next`. On several processes (replay's
--coordinator started jax.distributed; MaxText joins it) each loader gives its process's rows of a
global array, gathered into the global batch (one all-gather of the batch a step). Cost of a rebuild: one MaxText setup
(model init and data pipeline) and MaxText's ahead-of-time compile of its step, once per argv.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from typing import Any
from replay.errors import ReplayUnavailable

OVERRIDES = ("enable_checkpointing=false",)


@dataclass
class Rebuilt:
    config: Any
    mesh: Any
    rules: Any
    jitted: Any
    state: Any
    loader: Any
    last: Any  # the batch the loader gave last, for step `drawn - 1`
    drawn: int = 1
    _fresh: list = field(default_factory=list)

    def enter_mesh(self) -> None:
        """MaxText's mesh and logical axis rules set for this thread from now on, as MaxText's loop has
        them while it calls its step (`with jax.set_mesh(mesh), logical_axis_rules(...)`): replay
        traces the step inside its own program, where no mesh may be entered, and both are part of
        the lowered program (its hash) as they were while recording."""
        import jax
        from flax.core.spmd import set_logical_axis_rules

        jax.set_mesh(self.mesh)
        set_logical_axis_rules(self.rules)

    def init(self) -> Any:
        import jax

        # MaxText's step donates its state: each caller gets its own copy of step 0's, placed as it was.
        return jax.tree.map(lambda x: jax.device_put(x, x.sharding, may_alias=False), self.state)

    def abstract_state(self) -> Any:
        """The state's shapes with MaxText's own shardings (PartitionSpecs as MaxText wrote them, which
        the program's input shardings, hence its hash, carry)."""
        import jax

        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self.state)

    def batch_at(self, k: int) -> Any:
        if k < self.drawn - 1:
            self.loader, self.drawn, self.last = self._new_loader(), 0, None
        while self.drawn <= k:
            self.last = self.loader.load_next_batch()
            self.drawn += 1
        return _global(self.last)

    def seek(self, k: int, saved: Any) -> bool:
        """A fresh loader whose Grain iterator is set to `saved` (MaxText's checkpoint k - 1's `iter` folder:
        the iterator after the batch of step k - 1), so batch_at(k) draws one batch, not k + 1. False (nothing
        changed) where the folder holds no state for this process (another process count: MaxText's
        expansion_factor_real_data case, not handled) or the loader is not Grain's."""
        import json

        import grain
        import jax

        mine = saved / f"process_{jax.process_index()}-of-{jax.process_count()}.json"
        loader = self._new_loader() if mine.is_file() else None
        grain_iterator = getattr(getattr(loader, "data_iterator", None), "local_iterator", None)
        if not isinstance(grain_iterator, grain.DatasetIterator):  # MaxText's own test, grain_utility._state_to_text
            return False
        grain_iterator.set_state(json.loads(mine.read_text()))
        self.loader, self.drawn, self.last = loader, k, None
        return True

    def _new_loader(self) -> Any:
        import jax
        from maxtext.common.data_loader import create_dataloader
        from maxtext.input_pipeline.input_pipeline_interface import create_data_iterator
        from maxtext.utils.rampup_batch import create_rampup_manager

        with jax.set_mesh(self.mesh):
            iterator, _ = create_data_iterator(self.config, self.mesh)
            return create_dataloader(self.config, self.mesh, iterator, None, create_rampup_manager(self.config, None))


def _global(batch: Any) -> Any:
    """The batch as host arrays of the global batch: on several processes MaxText's loader gives each
    process only its rows of a global jax.Array; replay hashes and feeds the global batch."""
    import jax

    if all(getattr(x, "is_fully_addressable", True) for x in jax.tree.leaves(batch)):
        return batch
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(batch, tiled=True)


_built: dict[tuple, Rebuilt] = {}


def rebuild(argv: list[str]) -> Rebuilt:
    """MaxText's state entering step 0, its jitted step and its data, from `argv` (MaxText's train
    argv without the program name); once per argv in a process."""
    key = tuple(argv)
    if key not in _built:
        _built[key] = _run_until_first_step(list(argv))
    return _built[key]


def maxtext_checkpoint(argv: list[str], directory: str, label: int) -> Any:
    """MaxText's own checkpoint `label` (its folder `directory`/`label`, as its checkpoint manager wrote it:
    the Linen layout under `items`) restored by MaxText's code onto MaxText's abstract state: its `main`
    run with `load_full_state_path` up to its first step, whose state is captured. MaxText's checkpoint s
    holds the state AFTER step s (optimizer count s + 1), i.e. replay's state entering step k = s + 1
    (checked bit for bit, tests/maxtext/test_maxtext.py). MaxText refuses the checkpoint of the run's
    last step (`steps` reached): there is no step after it to replay anyway.

    What a replay restored from MaxText's checkpoints runs (replay/maxtext/checkpoints.py)."""
    # MaxText reads load_full_state_path only with its checkpointing on; the output folder stays a
    # temporary one, so its manager finds no checkpoint of its own there and loads the path given.
    return _run_until_first_step([*argv, f"load_full_state_path={directory}/{label}/items"],
                                 ("enable_checkpointing=true",)).state


def _run_until_first_step(argv: list[str], overrides: tuple = OVERRIDES) -> Rebuilt:
    from flax.core.spmd import get_logical_axis_rules
    from maxtext.trainers.pre_train import train
    from maxtext.utils import train_utils

    from replay.maxtext import absl_flags_parsed

    class _Captured(Exception):
        """Raised from the first call of MaxText's jitted step: the rebuild has what it needs. A signal
        that never leaves this function (caught below), so not one of the package's error classes."""

    got: dict = {}
    setup, jit_step = train_utils.setup_train_loop, train_utils.jit_train_step

    def setup_train_loop(config, *args, **kwargs):
        out = setup(config, *args, **kwargs)
        got.update(config=config, mesh=out[4], loader=out[7])
        return out

    class Capture:
        def __init__(self, jitted: Any):
            self.jitted = jitted

        def __call__(self, state: Any, batch: Any, *rng: Any) -> Any:
            got.update(state=state, batch=batch, jitted=self.jitted, rules=get_logical_axis_rules())
            raise _Captured

        def __getattr__(self, name: str) -> Any:  # MaxText lowers and compiles it ahead of the loop
            return getattr(self.jitted, name)

    def jit_train_step(config, *args, **kwargs):
        return Capture(jit_step(config, *args, **kwargs))

    import jax

    # Several processes: replay's --coordinator started jax.distributed, and MaxText joins it. One: MaxText
    # must not start it (the run's own argv may ask it to, from environment variables a replay lacks).
    alone = () if jax.distributed.is_initialized() else ("skip_jax_distributed_system=true",)
    train_utils.setup_train_loop, train_utils.jit_train_step = setup_train_loop, jit_train_step
    absl_flags_parsed()
    try:
        with tempfile.TemporaryDirectory(prefix="replay-maxtext-") as out:
            train.main(["train", *argv, *overrides, *alone, f"base_output_directory={out}"])
    except _Captured:
        pass
    finally:
        train_utils.setup_train_loop, train_utils.jit_train_step = setup, jit_step
    if "state" not in got:
        raise ReplayUnavailable("MaxText, run with the recorded argv, trained no step through its jitted train step; "
                                "its loop cannot be rebuilt (replay without --allow-code)")
    return Rebuilt(config=got["config"], mesh=got["mesh"], rules=got["rules"], jitted=got["jitted"],
                   state=got["state"], loader=got["loader"], last=got["batch"])
