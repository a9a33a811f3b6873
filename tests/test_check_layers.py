"""tools/check_layers.py and tools/check_lengths.py, on small trees written here and on this repository.

The checks read files with `ast` and import nothing, so each run is a plain python process.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ROOT / "tools" / "check_layers.py"
LENGTHS = ROOT / "tools" / "check_lengths.py"

CLEAN = {
    "traces/__init__.py": "import numpy as np\nfrom traces.io import read\n",
    "traces/io.py": "def read():\n    import json\n    return json\n",
    "replay/__init__.py": "from traces import io\n",
    "replay/engine/engine.py": "import traces\n\n\ndef run():\n    from replay import errors\n    return errors\n",
    "replay/errors.py": "EXIT_BUG = 3\n",
    "replay/bisect/__init__.py": "from ..engine import run\nfrom . import scan\n",
    "replay/bisect/scan.py": "from replay.errors import EXIT_BUG\n",
    "replay/cli/__init__.py": "",
    "replay/cli/console.py": "from replay.errors import EXIT_BUG\n",
    "replay/cli/app.py": "from replay.cli import console\nfrom . import console as c2\n",
    "trainer/__init__.py": "",
    "trainer/model.py": "import replay\nfrom replay.cli import console\n",  # the trainer sits on top
}


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def run_tool(tool: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(tool), *map(str, args)], capture_output=True, text=True, timeout=60)


def test_clean_tree_passes(tmp_path):
    done = run_tool(LAYERS, write_tree(tmp_path, CLEAN))
    assert done.returncode == 0, done.stdout + done.stderr
    assert len(done.stdout.strip().splitlines()) == 1 and "no import crosses a layer" in done.stdout


def test_function_level_trainer_import_in_replay_fails(tmp_path):
    tree = write_tree(tmp_path, {**CLEAN, "replay/engine/engine.py": CLEAN["replay/engine/engine.py"]
                                 + "\n\ndef f():\n    from trainer import model\n"})
    done = run_tool(LAYERS, tree)
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.splitlines() == [
        "replay/engine/engine.py:10: replay.engine.engine imports trainer.model (replay does not import trainer)"]


def test_each_rule_and_its_count(tmp_path):
    tree = write_tree(tmp_path, {
        **CLEAN,
        "traces/io.py": "def read():\n    from replay.engine import engine\n",
        "replay/bisect/scan.py": "from ..cli import console\n",  # relative, still the CLI
        "replay/audit.py": "import importlib\nmod = importlib.import_module('trainer.model')\n",
    })
    done = run_tool(LAYERS, tree, "--summary")
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert "traces/io.py:2: traces.io imports replay.engine.engine (traces imports neither replay nor trainer)" in lines
    assert "replay/bisect/scan.py:1: replay.bisect.scan imports replay.cli.console (only replay/cli imports replay.cli)" \
        in lines
    assert "replay/audit.py:2: replay.audit imports trainer.model (replay does not import trainer)" in lines
    counts = {line.split(None, 1)[1]: int(line.split()[0]) for line in lines if line.strip()[0].isdigit()}
    assert counts == {"traces imports neither replay nor trainer": 1, "replay does not import trainer": 1,
                      "only replay/cli imports replay.cli": 1}


def test_this_repository_keeps_traces_and_replay_library_below_the_cli():
    """The rules that already hold here stay held (replay -> trainer imports are still being removed)."""
    done = run_tool(LAYERS, ROOT, "--summary")
    counts = {line.split(None, 1)[1]: int(line.split()[0]) for line in done.stdout.splitlines()
              if line.strip() and line.strip()[0].isdigit()}
    assert counts["traces imports neither replay nor trainer"] == 0, done.stdout
    assert counts["only replay/cli imports replay.cli"] == 0, done.stdout


def test_lengths(tmp_path):
    tree = write_tree(tmp_path, {"replay/ok.py": "x = 1\n" * 450, "trainer/long.py": "x = 1\n" * 451,
                                 "traces/__init__.py": ""})
    done = run_tool(LENGTHS, tree)
    assert done.returncode == 1 and done.stdout.splitlines() == ["trainer/long.py: 451 lines (over 450)"], done.stdout
    (tree / "trainer" / "long.py").write_text("x = 1\n" * 450)
    done = run_tool(LENGTHS, tree)
    assert done.returncode == 0 and "none over 450 lines" in done.stdout, done.stdout
