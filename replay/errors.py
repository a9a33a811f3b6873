"""Exit codes, and the one table that says which exceptions are the user's problem.

Exit codes (every command follows them):
    0  ok
    1  the runs differ: a divergence found, or a resume that did not reproduce a recorded step
    2  bad input or a damaged run: a missing or damaged run, bundle or checkpoint, a bad option
    3  a bug in replay (an internal error)

`EXIT_CODES` maps exception classes, named "module.QualName", to the code they exit with;
the most specific class in the exception's MRO that the table names wins, and an exception
it does not name is a bug (3). Classes are named by string so the table needs no import
(opening a run must not start JAX) and is the same in every process, whatever ran before:
a registry filled in by commands as they ran made `ConfigError` a bug or not depending on
which command the process had run first. `UserError` carries its own code.

The table lives here, not in replay/cli/, so library code can raise and classify user errors
without importing the CLI (the layers: traces <- replay <- replay.cli; tools/check_layers.py).

A user error's message is the whole report (`main` prints it as one `error:` line; the
traceback only with `--debug`), so it must say what is wrong and what to do.
"""

from __future__ import annotations

from types import MappingProxyType

EXIT_OK = 0
EXIT_DIVERGED = 1
EXIT_BAD_INPUT = 2
EXIT_BUG = 3

EXIT_CODES = MappingProxyType({
    # the runs differ
    "traces.errors.ResumeDivergedError": EXIT_DIVERGED,
    # the run format: a missing, foreign, newer, locked or damaged run; a full disk
    "traces.errors.TraceError": EXIT_BAD_INPUT,
    "traces.errors.DiskFullError": EXIT_BAD_INPUT,
    "replay.audit.NothingToAudit": EXIT_BAD_INPUT,
    # bundles (replay pack / unpack)
    "replay.bundle.format.PackError": EXIT_BAD_INPUT,
    "replay.bundle.format.NotABundleError": EXIT_BAD_INPUT,
    "replay.bundle.format.BundleCorruptError": EXIT_BAD_INPUT,
    "replay.bundle.format.NewerBundleError": EXIT_BAD_INPUT,
    # a missing, unusable or damaged checkpoint (any loop's)
    "replay.record.orbax_io.CheckpointError": EXIT_BAD_INPUT,
    "replay.record.orbax_io.CheckpointDamagedError": EXIT_BAD_INPUT,
    # a loop's own bad input (the trainer's config, data, mesh and planted faults subclass it)
    "replay.errors.InputError": EXIT_BAD_INPUT,
    # replaying: what cannot be replayed here, or a bad range
    "replay.engine.engine.ReplayInputError": EXIT_BAD_INPUT,
    "replay.errors.ReplayUnavailable": EXIT_BAD_INPUT,
    "replay.spike.detect.SpikeInputError": EXIT_BAD_INPUT,
    # user code and the recording API: a refused or failing entry point, a record that does not fit
    "replay.engine.code.CodeNotAllowed": EXIT_BAD_INPUT,
    "replay.engine.code.UserCodeError": EXIT_BAD_INPUT,
    "replay.record.errors.RecordError": EXIT_BAD_INPUT,
    "replay.record.exported.ExportedProgramError": EXIT_BAD_INPUT,
    "replay.record.examples_store.ExampleStoreError": EXIT_BAD_INPUT,
    "replay.record.export.ExportError": EXIT_BAD_INPUT,  # a step jax.export cannot serialize (caught in export.py)
    "replay.record.recorder.RecordSchemaError": EXIT_BAD_INPUT,
    # one-line errors raised by name (console.fail, library code); the instance's exit_code wins
    "replay.errors.UserError": EXIT_BAD_INPUT,
    # a path the user gave that cannot be read or written as asked
    "builtins.PermissionError": EXIT_BAD_INPUT,
    "builtins.IsADirectoryError": EXIT_BAD_INPUT,
    "builtins.NotADirectoryError": EXIT_BAD_INPUT,
})

class ReplayUnavailable(Exception):
    """A run that cannot be replayed here (missing checkpoint, data, code): bad input, exit 2.

    Only what the input explains becomes one: a damaged checkpoint stays the checkpoint's own
    error (replay.record.orbax_io.CheckpointDamagedError), and anything unexpected stays itself (a bug).
    Defined here, below the engine and the recording API, which both raise it."""


INTERNAL_ERROR_CHARS = 400  # of the exception's text on the internal-error line; --debug shows it all


class InputError(Exception):
    """Bad input a loop explains itself (its config, data source, mesh or planted faults): exit 2.

    A loop's error classes subclass it (with their own bases too: the trainer's are ValueErrors),
    so replay classifies them, and refuses to replay a run whose loop raises one while opening
    it, without importing the loop (replay.engine.replayer: "cannot be replayed here")."""


class UserError(Exception):
    """A one-line, user-facing error. The CLI raises it through `console.fail(msg, code)`."""

    def __init__(self, message: str, exit_code: int = EXIT_BAD_INPUT):
        super().__init__(message)
        self.exit_code = exit_code


def class_name(cls: type) -> str:
    """The key of `cls` in EXIT_CODES."""
    return f"{cls.__module__}.{cls.__qualname__}"


def code_of_type(cls: type[BaseException]) -> int | None:
    """The exit code of exceptions of class `cls`, or None when it is a bug."""
    for t in cls.__mro__:  # the most specific class the table names wins
        code = EXIT_CODES.get(class_name(t))
        if code is not None:
            return code
    return None


def user_error_code(exc: BaseException) -> int | None:
    """The exit code when `exc` is a user error, else None (it is a bug)."""
    if isinstance(exc, UserError):
        return exc.exit_code
    return code_of_type(type(exc))


def exit_code_of(exc: BaseException) -> int:
    """The exit code `exc` ends a command with."""
    code = user_error_code(exc)
    return EXIT_BUG if code is None else code


def message(exc: BaseException) -> str:
    """The one line printed after `error: ` for `exc`."""
    if user_error_code(exc) is None:
        text = f"{type(exc).__name__}: {exc}"
        if len(text) > INTERNAL_ERROR_CHARS:
            text = text[:INTERNAL_ERROR_CHARS] + " ..."
        return f"internal error, this is a bug in replay: {text}"
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        return f"{exc.filename}: {exc.strerror[0].lower()}{exc.strerror[1:]}; check the path and its permissions"
    return str(exc) or type(exc).__name__

