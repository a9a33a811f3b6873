"""Plugins: installed packages that add commands to the `replay` CLI and prepare a process for
the runs they recorded, without replay importing them.

A plugin is a module named by an entry point of the group `replay.plugins` (in its
pyproject.toml: `[project.entry-points."replay.plugins"] NAME = "package.module"`). It may define
  * `register(app)`: add its commands to the typer app (the trainer: `train`, `plan`, `demo`);
  * `prepare_process(manifest: dict) -> None`: called before JAX starts for a run a command is
    about to replay (the trainer's mesh-invariant runs need XLA:CPU settings in place first);
  * `torch_reference(run) -> reference | None`: a PyTorch model of the run's model, for
    `replay compare --eval` (a replay.torch run's checkpoints are evaluated with it, and the
    float32 noise floor of either side is measured with it); None for a run the plugin does not
    know. The contract of `reference` is replay.compare.sides.TorchReference.

This is how the trainer's commands reach the one `replay` CLI while the dependencies point one
way (traces <- replay <- trainer). Entry points are read once per process and each plugin is
imported on first use, so a command that needs none (`replay show`) imports none. A plugin that
fails to import or register is one warning line and is skipped: a broken install must not take
down the commands that do not need it. From a checkout that was never installed there are no
entry points, hence no plugin commands (`pip install -e .` registers them).
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any, Callable
from importlib.metadata import entry_points

GROUP = "replay.plugins"

Warn = Callable[[str], None]

_entry_points: tuple | None = None
_loaded: dict[str, ModuleType | None] = {}  # entry point name -> its module, None when it failed


def _stderr_warning(msg: str) -> None:
    sys.stderr.write(f"warning: {msg}\n")


def _discover() -> tuple:
    """The group's entry points, one per name (a package found twice on sys.path counts once)."""
    global _entry_points
    if _entry_points is None:
        unique: dict[str, Any] = {}
        for ep in entry_points(group=GROUP):
            unique.setdefault(ep.name, ep)
        _entry_points = tuple(unique[name] for name in sorted(unique))
    return _entry_points


def _failed(ep, exc: BaseException, warn: Warn) -> None:
    text = " ".join(str(exc).split())
    warn(f"replay plugin {ep.name} ({ep.value}) is skipped: {type(exc).__name__}: {text}; "
         "reinstall or uninstall the package that provides it")


def _plugins(warn: Warn) -> list[tuple[Any, ModuleType]]:
    """(entry point, module) of each plugin that imports, imported on first call (each failure
    warned about once per process)."""
    plugins = []
    for ep in _discover():
        if ep.name not in _loaded:
            try:
                _loaded[ep.name] = ep.load()
            except Exception as exc:
                _loaded[ep.name] = None
                _failed(ep, exc, warn)
        if _loaded[ep.name] is not None:
            plugins.append((ep, _loaded[ep.name]))
    return plugins


def register_commands(app, warn: Warn = _stderr_warning) -> None:
    """Each plugin's `register(app)`: its commands join `app`."""
    for ep, module in _plugins(warn):
        register = getattr(module, "register", None)
        if register is None:
            continue
        try:
            register(app)
        except Exception as exc:
            _failed(ep, exc, warn)


def first_answer(hook: str, *args: Any, warn: Warn = _stderr_warning) -> Any:
    """The first answer other than None of the plugins' `hook(*args)`, in entry-point name order;
    None when no plugin defines `hook` or every one answers None. Errors propagate: a plugin that
    knows the run and finds it unusable says why (one line), as prepare_process does."""
    for _, module in _plugins(warn):
        fn = getattr(module, hook, None)
        if fn is not None:
            answer = fn(*args)
            if answer is not None:
                return answer
    return None


def prepare_process(manifest: dict, warn: Warn = _stderr_warning) -> None:
    """Each plugin's `prepare_process(manifest)`, before JAX starts for the run of `manifest`.
    Its errors propagate: a process that cannot replay the run as recorded is the user's to fix
    (a ConfigError naming the setting), not a plugin to skip."""
    for _, module in _plugins(warn):
        prepare = getattr(module, "prepare_process", None)
        if prepare is not None:
            prepare(manifest)
