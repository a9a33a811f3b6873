"""Runs of tests/replay/fixtures/tinyloop.py recorded from copies of it in tmp folders (helpers
for test_code_safety.py and test_user_errors.py).

Each copy is loaded for recording under a name of its own, never as `tinyloop`, so nothing
the tests record makes `tinyloop` importable by name: replay has to find each run's code the
way the policy in replay/engine/code.py allows.
"""

from __future__ import annotations

import importlib.util
import itertools
import sys
from pathlib import Path

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "tinyloop.py"
_count = itertools.count()


def copy_loop(folder: Path, scale: float = 1.0, name: str = "tinyloop") -> Path:
    """tinyloop.py copied into `folder` as NAME.py, with SCALE set to `scale`."""
    folder.mkdir(parents=True, exist_ok=True)
    text = FIXTURE.read_text().replace("SCALE = 1.0 ", f"SCALE = {scale!r} ", 1)
    assert f"SCALE = {scale!r}" in text
    target = folder / f"{name}.py"
    target.write_text(text)
    return target


def load_copy(path: Path):
    """The module at `path`, under a fresh name (not its file's)."""
    name = f"_tinyloop_recorder_{next(_count)}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def record(module, out: Path, **config) -> Path:
    return module.train(module.Config(**config), out)
