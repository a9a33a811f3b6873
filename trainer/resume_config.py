"""The config a run is resumed with: the run's own, refused when the command asks for another or
for fewer steps than the run is configured for (`replay train --resume`, the demo).
"""

from __future__ import annotations

from pathlib import Path

from traces import Run
from trainer.config import Config, ConfigError, config_diff, from_dict, to_dict


def load_resume_config(path: Path, cfg: Config | None, steps: int | None) -> Config:
    """The config of the run to resume, refusing a different one.

    `steps` is the run's new total length: a resume trains up to it, so it may only grow. Fewer
    steps than the run is configured for would rewrite its config (and drop what it planned to
    record), so that is refused; a shorter run is a new run."""
    run = Run.open(path)
    recorded = from_dict(run.manifest["config"])
    if steps is not None and steps < 1:
        raise ConfigError(f"--steps {steps}: a run takes at least 1 step; give --steps 1 or more")
    if steps is not None and steps < recorded.steps:
        raise ConfigError(f"--steps {steps}: {path} is configured for {recorded.steps} steps and a resume can only "
                          f"extend it; give --steps {recorded.steps} or more, or omit --steps to finish it as configured")
    if cfg is not None:
        diff = [d for d in config_diff(recorded, cfg) if d[0] != "steps"]
        if diff:
            key, a, b = diff[0]
            raise ConfigError(f"{path} was made with {key}={a!r}, not {b!r}: resume with the run's own config "
                              f"(drop --preset/--set) or train a new run")
    total = steps if steps is not None else recorded.steps
    if run.status == "complete" and total <= run.trace.end:
        # Nothing to train: refused before the lock or a compile, so the run stays byte for byte as it was.
        raise ConfigError(f"{path} already has {run.trace.end} steps and is complete, so there is nothing to train; "
                          f"pass a larger --steps (more than {run.trace.end}) to continue it")
    return from_dict({**to_dict(recorded), "steps": total})
