"""replay: record and replay JAX training, bit for bit.

The recording API (JAX is imported only when one of these is first used, so `import replay`
and the CLI's commands that only read runs stay light):

    run = replay.init("runs/a", config=cfg, entrypoint=make, dataset_size=N)
    step = run.step(batch_axis=0)(train_step)   # same signature, same outputs, also recorded
    run.save(k, state)                          # checkpoint k: the state entering step k
    run.finish()
    replay.tap(grads, "grad")                   # inside the step: fingerprint what it computes
    @replay.entrypoint
    def make(config) -> replay.Loop: ...        # the replay side: step, batch_at or data, init

See README.md, "Your own training loop".
"""

from __future__ import annotations

from typing import Any
import importlib

__all__ = ["Loop", "RecordError", "Tokens", "entrypoint", "init", "tap"]

_PUBLIC = {
    "init": ("replay.record.run", "init"),
    "tap": ("replay.record.taps", "tap"),
    "Loop": ("replay.record.loop", "Loop"),
    "entrypoint": ("replay.record.loop", "entrypoint"),
    "RecordError": ("replay.record.errors", "RecordError"),
    "Tokens": ("replay.record.manifest", "Tokens"),
}


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        module, attr = _PUBLIC[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'replay' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
