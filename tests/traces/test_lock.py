"""RUN/.lock: one function takes it for a writer (Run.create/resume) and for a trainer that only
checks a run before touching it (create=False)."""

import os

import pytest

from traces import RunLockedError
from traces.run import LOCK, take_lock


def test_a_check_holds_the_lock_without_writing_and_refuses_a_live_writer(tmp_path):
    assert take_lock(tmp_path, create=False) is None and not (tmp_path / LOCK).exists()  # no lock file: none made
    writer = take_lock(tmp_path)
    assert (tmp_path / LOCK).read_text() == f"pid {os.getpid()}"
    with pytest.raises(RunLockedError, match=f"being written by pid {os.getpid()}"):
        take_lock(tmp_path, create=False)
    os.close(writer)
    check = take_lock(tmp_path, create=False)
    assert check is not None and (tmp_path / LOCK).read_text() == f"pid {os.getpid()}"  # nothing written
    with pytest.raises(RunLockedError):
        take_lock(tmp_path)
    os.close(check)
