"""The object-store emulators' fixtures (tests/traces/emulators.py), registered once for this folder.

Imported into each test module instead, a session fixture is a separate fixture per module: two such
modules run by one worker started two emulators of a scheme, the second one's port went into the
environment (so subprocesses wrote to it) while this process's cached store (traces/storage.open_store)
still spoke to the first, and a run two processes had just recorded read as "no such run" here (seen:
test_remote_trainer then test_remote_processes in one worker)."""

from tests.traces.emulators import gcs, s3  # noqa: F401 - fixtures
