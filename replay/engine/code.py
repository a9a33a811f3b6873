"""Which code replays a run, and what happens when that code raises.

A run's manifest names the function that rebuilds its loop ("module:function"). Replaying
runs that code, so resolving it is a security decision, not a convenience:

- replay's and the trainer's own factories (`replay.*`, `trainer.*`) import normally;
- any other module is imported by name from the environment as installed: `sys.path` with
  every folder the manifest names, and the run folder itself, left out, so a file that
  travels with a run is never picked up by accident;
- a folder the manifest names (`search_path`, relative to the run or absolute) is used only
  with `allow_code=True` (the CLI's `--allow-code`), and never when it lies inside the run
  folder or inside a folder a bundle was unpacked to: --allow-code allows the user's own
  checkout, never code that travels with a run;
- a bundle never chooses code: for a bundle (a .rpk file, or a folder `replay unpack` wrote,
  known by the MARKER file unpack writes there, which the bundle's bytes cannot remove) only
  replay's own factories (OWN_FACTORIES) are resolved, whatever its manifest says;
- a module of Python's standard library is never imported as an entry point (no loop factory
  lives there, and some run code when imported), and a function replay calls must be one of
  OWN_FACTORIES or carry the @replay.entrypoint marker, checked before it is called;
- code loaded from a folder is loaded by file location under a module name unique to that
  folder, so two runs whose loops are both `train.py` in two checkouts each get their own
  module (importing by name would hand run B the module run A imported first).

`call_user(fn, ...)` calls user code and turns an exception raised inside it into
`UserCodeError`: one line naming the user's function and the exception (exit 2), instead of
an "internal error" that blames replay. Exceptions that already are user errors of replay's
own (a damaged checkpoint a factory read through replay, say) pass through unchanged.

Where a module comes from (a bundle's unpack folder, module locations, a folder's modules under
their unique names) is replay/engine/code_paths.py; the policy and the imports are here.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any, Callable
from replay.errors import user_error_code
from replay.engine.code_paths import MARKER  # noqa: F401 - bundle commands and tests import it from here
from replay.engine.code_paths import (
    alias_of, has_location, inside, is_forbidden, locations_inside, meta_spec, module_locations,
    same_file, siblings_from, unpacked_from,
)

TRUSTED_PACKAGES = ("replay", "trainer")  # replay's own factories: they ship with replay itself
# The only functions replay calls without a marker: the trainer's and replay.init's factories.
OWN_FACTORIES = ("trainer.replayable:from_run", "replay.record.replayable:from_run")
API_FACTORY = OWN_FACTORIES[1]
ALLOW_FLAG = "--allow-code"
_display_names: dict[str, str] = {}  # unique module name -> the name the manifest gave it


class CodeNotAllowed(Exception):
    """The run names code that this replay must not (or cannot) run; the message says what to pass or install."""


class EntrypointNotFound(CodeNotAllowed):
    """The named module or function does not exist where the policy allows looking for it."""


class UserCodeError(Exception):
    """An exception raised inside the user's code (a factory, restore, step); `__cause__` is the original."""

    def __init__(self, function: str, exc: BaseException):
        self.function = function
        self.original = exc
        where = _user_frame(exc)
        # The whole message on one line: JAX's often starts with a header ("Mismatch details (1 found):")
        # whose substance is on the lines after it.
        text = " ".join(str(exc).split())
        text = text if len(text) <= 600 else text[:597] + "..."
        super().__init__(f"{function} (your code) raised {type(exc).__name__}"
                         f"{': ' + text if text else ''}{f' at {where}' if where else ''}; "
                         "fix it there, or pass --debug for the traceback")


_allowed = [False]  # this process's --allow-code, for paths that do not pass it down explicitly


class allowing:
    """`with allowing(flag):` the CLI's --allow-code for everything loaded inside (bisect and pack
    open runs deep inside; `trainer.replayable.load(run)` without allow_code reads it here)."""

    def __init__(self, allow: bool):
        self.allow = bool(allow)

    def __enter__(self):
        _allowed.append(self.allow)

    def __exit__(self, *exc):
        _allowed.pop()
        return False


def code_allowed() -> bool:
    """The --allow-code in force (False unless a command's `allowing` says so)."""
    return _allowed[-1]


def is_bundle_run(run) -> bool:
    """The run was unpacked from a bundle (a file someone sent), so nothing in it may run: it was
    opened from a bundle file, its manifest says so, or a folder holding it carries the MARKER
    `replay unpack` wrote (the one a crafted manifest cannot talk away)."""
    return (getattr(run, "bundle", None) is not None or isinstance(run.manifest.get("bundle"), dict)
            or unpacked_from(run.path) is not None)


def _brief(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def is_spec(spec: Any) -> bool:
    module_name, sep, attr = str(spec).partition(":")
    return (isinstance(spec, str) and bool(sep) and bool(attr)
            and all(p.isidentifier() for p in module_name.split(".") + attr.split(".")))


def import_entrypoint(run, spec: str, *, allow_code: bool, search_path: str | None = None) -> Any:
    """The object `spec` ("module:function") names for `run`, resolved by the policy above.

    Raises CodeNotAllowed (one line saying to pass --allow-code, or what to install) when the
    policy refuses, EntrypointNotFound when the module or function is not there, and
    UserCodeError when importing the module raises."""
    module_name, sep, attr = str(spec).partition(":")
    if not is_spec(spec):
        raise EntrypointNotFound(f"{_shown(run)}: its manifest names the replay entry point {_brief(spec)}, "
                                 "which is not of the form module:function")
    own = spec in OWN_FACTORIES
    if is_bundle_run(run) and not own:  # before anything is looked up: a bundle's names are not followed
        raise CodeNotAllowed(f"{_shown(run)}: is a bundle whose manifest names code ({_brief(spec)}); code a "
                             "bundle names is never run, with or without --allow-code: a bundle replays only "
                             "from its exported program (or the trainer's code); replay the run it was packed "
                             "from to use your code")
    top = module_name.split(".")[0]
    # Python's standard library holds no loop factory, and some of its modules act when imported:
    # never imported by name (a user's own test.py in a named folder is loaded by location below).
    stdlib = top in sys.stdlib_module_names or top in sys.builtin_module_names
    folder = _folder(run, search_path) if search_path else None
    if stdlib and folder is None:
        raise CodeNotAllowed(f"{_shown(run)}: its manifest names {_brief(spec)} as the code that replays it, a "
                             "function of Python's standard library, not a loop factory; replay calls only "
                             "functions marked @replay.entrypoint: fix the manifest, or record the run again")
    forbidden = [Path(run.path).resolve()] + ([folder] if folder else [])
    trusted = top in TRUSTED_PACKAGES
    module = None if stdlib else _installed(module_name, forbidden, trusted)
    if module is None and not trusted and folder is not None:
        carried = _carried(run, folder)
        if carried:
            raise CodeNotAllowed(f"{_shown(run)}: its manifest names code in {folder} ({module_name}), {carried}; "
                                 "code that travels with a run or a bundle is never run, with or without "
                                 f"{ALLOW_FLAG}: install {module_name}, or keep it in your checkout")
        if not allow_code:
            raise CodeNotAllowed(f"{_shown(run)}: its replay entry point {module_name} is not installed here; "
                                 f"it is in {folder}, which replay imports from only when asked: pass "
                                 f"{ALLOW_FLAG} to run that code, or install {module_name}")
        module = _from_folder(module_name, folder)
    if module is None:
        raise EntrypointNotFound(f"{_shown(run)}: its manifest names the replay entry point {spec!r}, but "
                                 f"{module_name} cannot be imported here; install it (or put it on PYTHONPATH)")
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise EntrypointNotFound(f"{_shown(run)}: its manifest names the replay entry point {spec!r}, but "
                                     f"{_origin(module)} has no {attr!r}; is it the same version of the code?")
        obj = getattr(obj, part)
    if not own and not getattr(obj, _MARK, False):
        raise CodeNotAllowed(f"{_shown(run)}: its manifest names {_brief(spec)}, which is not marked "
                             "@replay.entrypoint; replay calls only functions declared as loop factories: "
                             "decorate it, or fix the manifest")
    return obj


_MARK = "__replay_entrypoint__"  # replay.record.loop.MARK, set by @replay.entrypoint (no import: no JAX here)


def _carried(run, folder: Path) -> str | None:
    """Why `folder` holds code that came with the run rather than from the user (None: it does not)."""
    if inside(folder, [Path(run.path).resolve()]):
        return "inside the run's own folder"
    marked = unpacked_from(folder)
    return f"inside {marked}, a folder a bundle was unpacked to" if marked is not None else None


def function_name(fn: Callable) -> str:
    """module.qualname of `fn` as the user wrote it (the manifest's module name, not an alias)."""
    target = getattr(fn, "__func__", fn)  # a bound method: its function
    module = getattr(target, "__module__", None) or type(fn).__module__
    qual = getattr(target, "__qualname__", None) or getattr(target, "__name__", None)
    if qual is None:  # a callable object
        qual = f"{type(fn).__qualname__}.__call__"
    return f"{_display_names.get(module, module)}.{qual}"


def call_user(fn: Callable, *args: Any, **kw: Any) -> Any:
    """fn(*args, **kw), with an exception raised inside it turned into UserCodeError."""
    return call_user_as(None, fn, *args, **kw)


def call_user_as(name: str | None, fn: Callable, *args: Any, **kw: Any) -> Any:
    """call_user, with the error naming `name` (the user's function) where `fn` is replay's own
    that runs it (Program.compile tracing the Loop's step), not the user's."""
    try:
        return fn(*args, **kw)
    except (UserCodeError, CodeNotAllowed):
        raise
    except Exception as e:
        if _is_user_error(e):  # replay's own one-line errors keep their message and exit code
            raise
        raise UserCodeError(name or function_name(fn), e) from e


# --- resolution ------------------------------------------------------------------------------------------------


def _folder(run, search_path: str) -> Path:
    p = Path(search_path).expanduser()
    return (p if p.is_absolute() else Path(run.path) / p).resolve()


def _origin(module: ModuleType) -> str:
    return getattr(module, "__file__", None) or module.__name__


def _installed(module_name: str, forbidden: list[Path], trusted: bool) -> ModuleType | None:
    """The module imported by name from sys.path without the forbidden folders; None when it is
    not there or would come from one of them. Its location is checked before anything executes,
    and a module already imported is used only if the filtered path would find that same file
    (one imported earlier from a folder since removed from sys.path is not "installed")."""
    top = module_name.split(".")[0]
    path = [p for p in sys.path if not is_forbidden(p or os.getcwd(), forbidden)]
    loaded = sys.modules.get(top)
    if loaded is not None and (trusted or not has_location(loaded)):
        if locations_inside(module_locations(loaded), forbidden):
            return None
    else:
        spec = importlib.machinery.PathFinder.find_spec(top, path) or meta_spec(top)
        if spec is None:
            return None
        locations = ([spec.origin] if spec.has_location and spec.origin else []) + list(
            spec.submodule_search_locations or [])
        if locations_inside(locations, forbidden):
            return None
        if loaded is not None and same_file(module_locations(loaded), locations) is False:
            return None  # importing would hand back a module from elsewhere
    saved = list(sys.path)
    sys.path[:] = path
    try:
        module = _import(module_name, module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):  # the module itself, not something it imports
            return None
        raise UserCodeError(f"import {module_name}", e) from e
    finally:
        sys.path[:] = saved
    if locations_inside(module_locations(module), forbidden):
        return None
    return module


def _import(name: str, shown: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError:
        raise
    except Exception as e:  # the module's own top-level code raised
        raise UserCodeError(f"import {shown}", e) from e


def _from_folder(module_name: str, folder: Path) -> ModuleType | None:
    """`module_name` loaded from `folder` under a name unique to the folder. Sibling modules it
    imports at import time resolve from the folder too, and are dropped from sys.modules after,
    so another folder's siblings of the same name load their own."""
    top, _, rest = module_name.partition(".")
    alias = alias_of(module_name, folder)
    full = alias + (f".{rest}" if rest else "")
    if full in sys.modules:
        return sys.modules[full]
    if alias not in sys.modules:
        spec = importlib.machinery.PathFinder.find_spec(top, [str(folder)])
        if spec is None or spec.loader is None:
            return None
        spec = importlib.util.spec_from_file_location(alias, spec.origin,
                                                      submodule_search_locations=spec.submodule_search_locations)
        module = importlib.util.module_from_spec(spec)
        _display_names[alias] = top
        sys.modules[alias] = module
        with siblings_from(folder):
            try:
                spec.loader.exec_module(module)
            except BaseException as e:
                sys.modules.pop(alias, None)
                if isinstance(e, Exception):
                    raise UserCodeError(f"import {top} (from {folder})", e) from e
                raise
    if not rest:
        return sys.modules[alias]
    with siblings_from(folder):
        try:
            module = importlib.import_module(full)
        except ModuleNotFoundError:
            return None
        except Exception as e:
            raise UserCodeError(f"import {module_name} (from {folder})", e) from e
    _display_names[full] = module_name
    return module


# --- errors -----------------------------------------------------------------------------------------------------


def _is_user_error(exc: BaseException) -> bool:
    return user_error_code(exc) is not None


def _user_frame(exc: BaseException) -> str | None:
    """file:line of the innermost frame outside replay/trainer/jax, where the user's code raised."""
    here = Path(__file__).resolve().parent.parent
    own = [here / p for p in TRUSTED_PACKAGES] + [here / "traces"]
    found = None
    for frame in traceback.extract_tb(exc.__traceback__):
        f = frame.filename
        if inside(f, own) or "site-packages" in f or f.startswith("<"):
            continue
        found = f"{Path(f).name}:{frame.lineno}"
    return found


def _shown(run) -> str:
    bundle = getattr(run, "bundle", None)
    return str(bundle) if bundle is not None else str(run.path)
