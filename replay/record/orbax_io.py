"""What goes wrong reading and writing orbax checkpoints, said in one line, and orbax kept quiet.

Shared by the checkpoint module (replay/record/checkpoints.py, checkpointer.py: every loop's
checkpoints, the trainer's too) and exported.py: one class per failure, so an exit code (the
table in replay/errors.py) and an `except` mean the same thing whichever loop saved.

Orbax reports through absl logging, asyncio and unraisable-exception hooks from its threads;
`_quiet_orbax` keeps all of that off the terminal while it works: failures become one-line
errors. Nothing here imports orbax or JAX.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import logging
import os
import re
import sys
import threading
import warnings
from typing import Any, Callable


class CheckpointError(ValueError):
    """A missing or unusable checkpoint; the message is one line for users."""


class CheckpointDamagedError(CheckpointError):
    """A checkpoint whose files cannot be read, or whose state differs from the one saved."""


class CheckpointDiskFullError(CheckpointError):
    """The disk filled up while a checkpoint was being saved; the checkpoint was not completed."""


_WHAT_TO_DO = "restore from another checkpoint or re-create the run"


def _read_failure(exc: BaseException) -> str:
    """A short reason from orbax's exception chain: TensorStore's status and the leaf it read."""
    texts = []
    while exc is not None:
        texts.append(" ".join(str(exc).split()))
        exc = exc.__cause__ or exc.__context__
    for text in reversed(texts):  # the innermost error says what TensorStore found
        m = re.search(r'\b([A-Z_]{5,}): (.*)', text)
        if m:
            status, detail = m.groups()
            leaf = re.search(r'Error reading "([^"/]+)', detail)
            detail = re.sub(r"\[tensorstore_spec=.*", "", detail)
            detail = detail.rsplit('": ', 1)[-1] if leaf else re.sub(r'"[^"]*"', "", detail)
            where = f"cannot read {leaf.group(1)}" if leaf else "cannot read it"
            return f"{where}: {status} {detail[:120].rstrip(' ;:')}"
    return f"cannot read it: {texts[-1][:160]}" if texts else "cannot read it"


def _is_disk_full(exc: BaseException) -> bool:
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            return True
        text = str(exc)
        if "No space left on device" in text or "os_error_code='28'" in text:  # TensorStore's ValueError
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def disk_of(path: str | os.PathLike) -> str:
    """'the disk holding PATH (DEVICE mounted at MOUNT)', from /proc/self/mounts where there is one."""
    path = os.path.realpath(path)
    best = ("", "")
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                device, mount = line.split()[:2]
                inside = path == mount or path.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best[1]):
                    best = (device, mount)
    except OSError:
        pass
    where = f" ({best[0]} mounted at {best[1]})" if best[1] else ""
    return f"the disk holding {path}{where}"


# How many quiet sections and asynchronous writes are open: the loggers stay silenced while any is,
# and get their own levels back when the last closes (saved by the first).
_QUIET_LOCK = threading.Lock()
_quiet_depth = 0
_saved_levels: list[int] = []
_LOGGERS = ("absl", "asyncio")


def _silence() -> None:
    global _quiet_depth, _saved_levels
    with _QUIET_LOCK:
        if _quiet_depth == 0:
            loggers = [logging.getLogger(name) for name in _LOGGERS]
            _saved_levels = [lg.level for lg in loggers]
            for lg in loggers:
                lg.setLevel(logging.CRITICAL + 1)
        _quiet_depth += 1


def _unsilence() -> None:
    global _quiet_depth
    with _QUIET_LOCK:
        _quiet_depth -= 1
        if _quiet_depth == 0:
            for name, level in zip(_LOGGERS, _saved_levels):
                logging.getLogger(name).setLevel(level)


@contextlib.contextmanager
def _quiet_orbax():
    """Keeps orbax's chatter off the terminal while it works: absl logs from its threads, and the
    unraisable errors a failed read or write leaves behind (see _drop_orbax_leftovers). The
    failure itself still propagates as an exception, which callers turn into one line."""
    _drop_orbax_leftovers()
    _silence()
    try:
        yield
    except BaseException:
        # Orbax's un-awaited coroutines warn when collected, as late as interpreter exit.
        warnings.filterwarnings("ignore", message="coroutine '.*' was never awaited", category=RuntimeWarning)
        gc.collect()
        raise
    finally:
        _unsilence()


def quiet_until_released() -> Callable[[], None]:
    """Keeps orbax quiet past the call that started an asynchronous save: its writer threads log a
    failure (a full disk: three absl ERROR records with ~70-line tracebacks each) when it happens,
    not when the caller waits for it. Returns the release (idempotent); call it once the save has
    been waited for (its failure, if any, raised as one line)."""
    _drop_orbax_leftovers()
    _silence()
    released = threading.Event()

    def release() -> None:
        if not released.is_set():
            released.set()
            _unsilence()

    return release


def _from_orbax(unraisable: Any) -> bool:
    """An unraisable error left by a failed orbax operation: its un-awaited read and write
    coroutines, and TensorStore callbacks posting to orbax's closed event loops."""
    if isinstance(unraisable.exc_value, RuntimeError) and "Event loop is closed" in str(unraisable.exc_value):
        return True
    code = getattr(unraisable.object, "cr_code", None)
    tb = unraisable.exc_traceback
    files = [code.co_filename] if code is not None else []
    while tb is not None:
        files.append(tb.tb_frame.f_code.co_filename)
        tb = tb.tb_next
    return any(f"{os.sep}orbax{os.sep}" in f for f in files)


def _drop_orbax_leftovers() -> None:
    """Orbax's leftovers surface from its threads and whenever they are collected, as late as
    interpreter exit (hundreds of lines after a full disk): drop those, and only those."""
    if getattr(sys.unraisablehook, "_drops_orbax", False):
        return
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if not _from_orbax(unraisable):
            previous(unraisable)

    hook._drops_orbax = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook
    logging.getLogger("asyncio").addFilter(lambda record: "exception was never retrieved" not in record.getMessage())
