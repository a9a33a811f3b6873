"""The import layers: traces <- replay <- trainer, and the CLI on top of replay's library.

    python tools/check_layers.py [ROOT] [--summary]

Reads every .py under ROOT/traces and ROOT/replay (ROOT: the repository, by default the folder
above this file) with `ast`, so imports inside functions and under `if TYPE_CHECKING:` count as
much as module-level ones, and so does `importlib.import_module("...")` with a constant name.
The rules:

  traces     imports nothing from replay/ or trainer/ (the run format stands alone);
  replay     imports nothing from trainer/ (the trainer is a client, like any user loop);
  replay.cli is imported only from replay/cli/ (library code never needs the command line).

Each violation is one line, `FILE:LINE: MODULE imports TARGET (RULE)`, and the exit code is 1;
with none, one summary line and exit 0. `--summary` adds one line per rule with its count
(to watch a count fall while the last imports are removed). Nothing is imported or run.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

PACKAGES = ("traces", "replay")
RULES = {
    "traces-alone": "traces imports neither replay nor trainer",
    "replay-below-trainer": "replay does not import trainer",
    "cli-on-top": "only replay/cli imports replay.cli",
}


@dataclass(frozen=True)
class Violation:
    file: str
    line: int
    module: str
    target: str
    rule: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.module} imports {self.target} ({RULES[self.rule]})"


def module_name(path: Path, root: Path) -> str:
    return ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")


def _resolve_relative(module: str, is_package: bool, level: int, name: str | None) -> str:
    """`from ..x import y` inside `module`: the absolute name of `..x`."""
    parts = module.split(".") if is_package else module.split(".")[:-1]
    base = parts[: len(parts) - (level - 1)] if level > 1 else parts
    return ".".join([*base, name] if name else base)


def imported_names(tree: ast.AST, module: str, is_package: bool, root: Path) -> list[tuple[int, list[str]]]:
    """(line, absolute module names) of each import statement in `tree`, wherever it is written.
    `from pkg import name` names `pkg.name` where that is a module under `root`, else `pkg`."""
    found: list[tuple[int, list[str]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.append((node.lineno, [alias.name for alias in node.names]))
        elif isinstance(node, ast.ImportFrom):
            base = (_resolve_relative(module, is_package, node.level, node.module) if node.level
                    else node.module or "")
            subs = [f"{base}.{a.name}" for a in node.names if _is_module(root, f"{base}.{a.name}")]
            found.append((node.lineno, subs or [base]))
        elif isinstance(node, ast.Call) and _is_import_call(node.func) and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                found.append((node.lineno, [arg.value]))
    return sorted(found, key=lambda item: item[0])


def _is_module(root: Path, name: str) -> bool:
    path = root.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _is_import_call(func: ast.expr) -> bool:
    if isinstance(func, ast.Attribute):
        return func.attr == "import_module"
    return isinstance(func, ast.Name) and func.id in ("import_module", "__import__")


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def rule_broken(module: str, target: str) -> str | None:
    if _within(module, "traces") and (_within(target, "replay") or _within(target, "trainer")):
        return "traces-alone"
    if _within(module, "replay") and _within(target, "trainer"):
        return "replay-below-trainer"
    if _within(target, "replay.cli") and not _within(module, "replay.cli"):
        return "cli-on-top"
    return None


def check(root: Path) -> tuple[list[Violation], int]:
    """(violations, number of files read) under root's layered packages."""
    violations: list[Violation] = []
    files = 0
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            files += 1
            module = module_name(path, root)
            rel = path.relative_to(root).as_posix()
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=rel)
            for line, targets in imported_names(tree, module, path.name == "__init__.py", root):
                broken: dict[str, list[str]] = {}  # one line per statement and rule
                for target in targets:
                    rule = rule_broken(module, target)
                    if rule is not None:
                        broken.setdefault(rule, []).append(target)
                violations += [Violation(rel, line, module, ", ".join(names), rule) for rule, names in broken.items()]
    return violations, files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", nargs="?", type=Path, default=Path(__file__).resolve().parents[1],
                        help="repository root (default: the one holding this tool)")
    parser.add_argument("--summary", action="store_true", help="also print the number of violations per rule")
    args = parser.parse_args(argv)
    if not all((args.root / p).is_dir() for p in PACKAGES):
        print(f"error: {args.root} is not the repository root (it needs traces/ and replay/); give the root",
              file=sys.stderr)
        return 2
    violations, files = check(args.root)
    for v in violations:
        print(v)
    if args.summary:
        counts = Counter(v.rule for v in violations)
        for rule, text in RULES.items():
            print(f"{counts[rule]:5d}  {text}")
    if violations:
        return 1
    print(f"check_layers: {files} files under {', '.join(PACKAGES)}: no import crosses a layer")
    return 0


if __name__ == "__main__":
    sys.exit(main())
