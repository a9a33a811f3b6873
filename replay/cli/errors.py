"""Exit codes and the exceptions the CLI reports as one line instead of a traceback.

Exit codes (every command follows them):
    0  ok
    1  the answer is "they differ" (divergence found), or a bug in replay (internal error)
    2  bad input: a missing or damaged run, a bad option value, a crashed run
    3  the command exists but is not built yet

A *user error* is a mistake or a problem in the input, not in replay: `main` prints its
`str()` as one line on stderr and exits with its code; the traceback only with `--debug`.
`UserError` (and subclasses) carry their exit code; exception types from other packages are
made user errors with `register_user_error` (`traces.TraceError` is registered here; the
trainer's command registers `ConfigError` and `DataError`). Their messages must be one line
that says what is wrong and what to do.
"""

from __future__ import annotations

import traces

EXIT_OK = 0
EXIT_DIVERGED = 1
EXIT_BUG = 1
EXIT_BAD_INPUT = 2
EXIT_NOT_IMPLEMENTED = 3


class UserError(Exception):
    """A one-line, user-facing error. Raise it through `console.fail(msg, code)`."""

    def __init__(self, message: str, exit_code: int = EXIT_BAD_INPUT):
        super().__init__(message)
        self.exit_code = exit_code


_USER_ERRORS: dict[type[BaseException], int] = {}


def register_user_error(*types: type[BaseException], code: int = EXIT_BAD_INPUT) -> None:
    """Makes instances of `types` (and subclasses) user errors that exit with `code`."""
    for t in types:
        _USER_ERRORS[t] = code


def user_error_code(exc: BaseException) -> int | None:
    """The exit code when `exc` is a user error, else None (it is a bug)."""
    if isinstance(exc, UserError):
        return exc.exit_code
    for t in type(exc).__mro__:  # the most specific registered class wins
        if t in _USER_ERRORS:
            return _USER_ERRORS[t]
    return None


register_user_error(traces.TraceError, PermissionError)
