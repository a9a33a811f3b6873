"""Where code comes from, for replay/engine/code.py's policy: the folder a bundle was unpacked to
(its MARKER), the locations a module was or would be imported from, and a folder's modules loaded
under a name unique to the folder. Nothing here imports or runs the user's code itself.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import os
import sys
from pathlib import Path
from types import ModuleType

from traces.storage import is_url

# Written by `replay unpack` (and by every command that opens a bundle) into the folder it unpacks
# to: replay's own mark, on the user's machine, so a bundle's bytes can neither forge it away nor
# keep a folder they fill from being known as a bundle's (format.py refuses a member of this name).
MARKER = "FROM_BUNDLE.json"
ALIAS_PREFIX = "_replay_code_"  # sys.modules names of modules loaded from a folder (alias_of)


def unpacked_from(path: str | os.PathLike) -> Path | None:
    """The folder at or above `path` that a bundle was unpacked to (it holds MARKER), else None."""
    if is_url(path):  # a run in a bucket: `replay unpack` unpacks only to local folders
        return None
    try:
        p = Path(path).resolve()
    except (OSError, RuntimeError):
        return None
    for folder in (p, *p.parents):
        try:
            if os.path.lexists(folder / MARKER):
                return folder
        except OSError:
            continue
    return None


def inside(path: str | os.PathLike | None, folders: list[Path]) -> bool:
    if not path:
        return False
    p = Path(path).resolve()
    return any(p == f or f in p.parents for f in folders)


def has_location(module: ModuleType) -> bool:
    return bool(getattr(module, "__file__", None))


def module_locations(module: ModuleType) -> list[str]:
    found = [module.__file__] if getattr(module, "__file__", None) else []
    return found + [str(p) for p in (getattr(module, "__path__", None) or [])]


def is_forbidden(path: str | os.PathLike, forbidden: list[Path]) -> bool:
    return inside(path, forbidden) or unpacked_from(path) is not None


def locations_inside(locations: list[str], forbidden: list[Path]) -> bool:
    return any(is_forbidden(p, forbidden) for p in locations)


def same_file(a: list[str], b: list[str]) -> bool | None:
    if not a or not b:
        return None
    return Path(a[0]).resolve() == Path(b[0]).resolve()


def meta_spec(top: str):
    for finder in sys.meta_path:  # editable installs and the like register their own finders
        if isinstance(finder, type) and issubclass(finder, importlib.machinery.PathFinder):
            continue
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        try:
            spec = find(top, None)
        except Exception:
            continue
        if spec is not None:
            return spec
    return None


def alias_of(module_name: str, folder: Path) -> str:
    digest = hashlib.sha256(str(folder).encode()).hexdigest()[:12]
    return f"{ALIAS_PREFIX}{digest}_{module_name.split('.')[0]}"


class siblings_from:
    """While a folder's module executes: the folder first on sys.path; after: the plain-named
    modules imported from it forgotten (the loaded module keeps its references to them)."""

    def __init__(self, folder: Path):
        self.folder = folder

    def __enter__(self):
        self.before = set(sys.modules)
        sys.path.insert(0, str(self.folder))

    def __exit__(self, *exc):
        try:
            sys.path.remove(str(self.folder))
        except ValueError:
            pass
        for name in set(sys.modules) - self.before:
            if name.startswith(ALIAS_PREFIX):
                continue
            if inside(getattr(sys.modules[name], "__file__", None), [self.folder]):
                del sys.modules[name]
        return False
