"""Every shared constant has one home: a second module-level definition of one of these names under
traces/, replay/, trainer/ or bench/ fails, naming both files (issue 31: LEVELS was defined six times,
with defaults that disagreed). A name that means something else gets a name of its own."""

from __future__ import annotations

import ast
import shutil
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("traces", "replay", "trainer", "bench")
NAMES = ("TRACE_LEVELS", "RECORD_LEVELS", "LEVELS", "BATCH_AXES", "TENSOR_KINDS", "METRIC_KINDS",
         "FINGERPRINTS_KEY", "DATA_FINGERPRINTS_KEY")
HOMES = {"TRACE_LEVELS": "trainer/constants.py", "RECORD_LEVELS": "replay/record/options.py",
         "BATCH_AXES": "trainer/constants.py", "TENSOR_KINDS": "traces/schema.py",
         "METRIC_KINDS": "traces/schema.py", "FINGERPRINTS_KEY": "replay/record/checkpoints.py",
         "DATA_FINGERPRINTS_KEY": "replay/record/data_iterator.py"}


def _assigned(tree: ast.Module) -> set[str]:
    """Names bound at module level by an assignment (imports re-export a home, they do not define)."""
    out: set[str] = set()
    for node in tree.body:
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
        for target in targets:
            for n in ast.walk(target):
                if isinstance(n, ast.Name):
                    out.add(n.id)
    return out


def definitions(root: Path) -> dict[str, list[str]]:
    found: dict[str, list[str]] = defaultdict(list)
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            for name in _assigned(ast.parse(path.read_text(), str(path))) & set(NAMES):
                found[name].append(path.relative_to(root).as_posix())
    return found


def duplicates(root: Path) -> list[str]:
    out = []
    for name, files in sorted(definitions(root).items()):
        if len(files) > 1:
            fix = f"import it from {HOMES[name]}" if name in HOMES else "one home, or a name of its own per meaning"
            out.append(f"{name} is defined in {' and '.join(files)}: {fix}")
    return out


def test_each_constant_is_defined_once():
    assert duplicates(ROOT) == []


def test_each_constant_lives_in_its_home():
    found = definitions(ROOT)
    assert {name: files[0] for name, files in found.items() if len(files) == 1} == HOMES


def test_the_scan_catches_a_second_definition(tmp_path):
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    assert duplicates(tmp_path) == []
    extra = tmp_path / "trainer" / "step.py"
    extra.write_text(extra.read_text() + '\nBATCH_AXES = ("data", "fsdp")\n')
    assert duplicates(tmp_path) == ["BATCH_AXES is defined in trainer/constants.py and trainer/step.py: "
                                    "import it from trainer/constants.py"]
