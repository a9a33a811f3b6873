"""The trainer as a replay plugin (entry point `replay.plugins` in pyproject.toml; replay/plugins.py).

Its commands (`replay train`, `replay plan`, `replay demo`: trainer/cli/) join the one `replay` CLI,
a run it recorded in mesh-invariant mode gets its process prepared before JAX starts, and
`replay compare --eval` gets its PyTorch reference model (`torch_reference`). replay
never imports the trainer; it finds this module through the entry point. Light at import (no
JAX): `replay --help` loads it.
"""

from __future__ import annotations
from replay.engine.code import OWN_FACTORIES


def register(app) -> None:
    """Add the trainer's commands to the `replay` typer app."""
    from trainer.cli import demo, plan, train

    for module in (train, plan, demo):
        module.register(app)


def torch_reference(run):
    """The trainer's PyTorch reference (Hugging Face OLMo) of a trainer run or of a replay.torch
    run of that reference, for `replay compare --eval`; None for other runs
    (trainer/replay_reference.py; contract: replay.compare.sides.TorchReference)."""
    from trainer.replay_reference import for_run

    return for_run(run)


def prepare_process(manifest: dict) -> None:
    """A mesh-invariant run (trainer/invariant.py) needs XLA:CPU settings in place before anything
    starts JAX; a command about to replay it calls this first (ConfigError, one line, if too late)."""
    trainer_factory = OWN_FACTORIES[0]
    if manifest.get("replayable", trainer_factory) != trainer_factory or manifest.get("recorded_by") == "replay.torch":
        return  # another loop's run: its config's "mesh" is that loop's, not the trainer's mode
    config = manifest.get("config")
    mesh = config.get("mesh") if isinstance(config, dict) else None
    if isinstance(mesh, dict) and mesh.get("mesh_invariant"):
        from trainer import invariant

        invariant.prepare_process()
