"""The README's quick start is exactly two commands, and .ci/run runs exactly its test command."""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def quick_start_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line for line in block.splitlines() if line.strip()]


def test_quick_start_is_two_commands():
    install_and_demo, tests = quick_start_commands()
    assert install_and_demo == "pip install -e . && replay demo"
    assert tests == "pip install -e '.[dev]' && python -m pytest"


def test_ci_runs_the_readme_test_command():
    script = ROOT / ".ci" / "run"
    assert os.access(script, os.X_OK)
    lines = [l for l in script.read_text().splitlines() if l.strip() and not l.startswith("#")]
    assert "set -euo pipefail" in lines
    assert quick_start_commands()[1] in lines
