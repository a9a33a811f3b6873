"""bench.sdc / bench.sdc_overhead (8-device children, bench/_eight_devices.py): bad arguments are one
error line and exit 2, before any child starts; a failing child is one line (exit 3), not its traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench import _eight_devices

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("args", [["bench.sdc", "--steps", "-1"], ["bench.sdc", "--corruptions", "0"],
                                  ["bench.sdc", "--steps", "abc"], ["bench.sdc_overhead", "--rounds", "0"]])
def test_bad_arguments_are_one_error_line(args):
    done = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and args[-2] in lines[0], done.stderr


def test_a_failing_child_is_one_line_and_exit_3(capsys):
    with pytest.raises(SystemExit) as e:
        _eight_devices.run("bench._no_such_bench")
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 3 and len(err) == 1 and "bench._no_such_bench" in err[0] and err[0].startswith("error: ")
