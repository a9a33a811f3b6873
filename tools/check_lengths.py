"""No source file over the length limit, so each module stays one idea a reader can hold.

    python tools/check_lengths.py [ROOT] [--max N]

Counts the lines of every .py under ROOT/replay, ROOT/traces and ROOT/trainer (ROOT: the
repository, by default the folder above this file). Each file over N lines (default 450) is
one line, `FILE: LINES lines (over N)`, and the exit code is 1; with none, one summary line
and exit 0.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

PACKAGES = ("replay", "traces", "trainer")
MAX_LINES = 450


def too_long(root: Path, limit: int = MAX_LINES) -> tuple[list[tuple[str, int]], int]:
    """([(file, lines)] of the files over `limit`, longest first; number of files read)."""
    over, files = [], 0
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            files += 1
            with path.open("rb") as f:
                lines = sum(1 for _ in f)
            if lines > limit:
                over.append((path.relative_to(root).as_posix(), lines))
    return sorted(over, key=lambda item: (-item[1], item[0])), files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", nargs="?", type=Path, default=Path(__file__).resolve().parents[1],
                        help="repository root (default: the one holding this tool)")
    parser.add_argument("--max", type=int, default=MAX_LINES, help=f"most lines a file may have (default {MAX_LINES})")
    args = parser.parse_args(argv)
    if not any((args.root / p).is_dir() for p in PACKAGES):
        print(f"error: {args.root} is not the repository root (it needs {', '.join(PACKAGES)}); give the root",
              file=sys.stderr)
        return 2
    over, files = too_long(args.root, args.max)
    for name, lines in over:
        print(f"{name}: {lines} lines (over {args.max})")
    if over:
        return 1
    print(f"check_lengths: {files} files under {', '.join(PACKAGES)}: none over {args.max} lines")
    return 0


if __name__ == "__main__":
    sys.exit(main())
