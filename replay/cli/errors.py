"""The exit-code table now lives in replay/errors.py (library code may use it without importing
the CLI); this name stays for code written against the old path while the re-layout lands."""

from replay.errors import (  # noqa: F401
    EXIT_BAD_INPUT, EXIT_BUG, EXIT_CODES, EXIT_DIVERGED, EXIT_OK, INTERNAL_ERROR_CHARS, UserError, class_name,
    code_of_type, exit_code_of, message, user_error_code,
)
