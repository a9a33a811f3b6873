"""The seed table (issue 33, part 3): the motivating bug on the real systems, one row each.

A run trained on one process, stopped, and resumed on two, against the same run resumed on one:
how many of the examples fed after the resume had been fed before in the epoch (`replay audit`),
and where `replay bisect` of the two resumes says they part.

    python tools/seed_table.py [DIR] [--maxtext-row FILE] [--json]

- MaxText 0.2.5 (olmo_grain): tools/seed_maxtext.py, run with the MaxText venv's Python (the one
  tools/maxtext-env.sh builds; MAXTEXT_VENV names another), about three minutes; or the row a
  previous run printed (`--maxtext-row FILE`: tools/seed_maxtext.py's output, or the "seed" of
  tools/maxtext-env.sh's JSON line).
- OLMo-core 3.0.0 (its own data loader, gloo ranks): tools/seed_row.py in this Python (torch and
  ai2-olmo-core installed: the `dev` extra), about a minute.

Prints a table, then both rows as one JSON object on the last line (`--json`: only that line).
Runs go to DIR (default: a new temporary folder), which must be new or empty.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_VENV = Path.home() / ".cache" / "replay" / "maxtext-venv-0.2.5"


def _fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def maxtext_row(root: Path, saved: Path | None) -> dict:
    if saved is not None:
        data = json.loads(saved.read_text().strip().splitlines()[-1])
        data = data.get("seed", data)  # tools/maxtext-env.sh's line holds the row under "seed"
        if not isinstance(data, dict) or data.get("framework") != "maxtext":
            _fail(f"{saved} holds no MaxText seed row (tools/seed_maxtext.py's output or tools/maxtext-env.sh's line)")
        return data
    python = Path(os.environ.get("MAXTEXT_VENV", DEFAULT_VENV)) / "bin" / "python"
    if not python.exists():
        _fail(f"no MaxText venv at {python.parent.parent}: run tools/maxtext-env.sh once (it builds it), "
              "or pass --maxtext-row FILE")
    done = subprocess.run([str(python), str(ROOT / "tools" / "seed_maxtext.py"), str(root / "maxtext")],
                          cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        _fail(f"the MaxText scenario failed (exit {done.returncode}): {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def olmo_core_row(root: Path) -> dict:
    sys.path.insert(0, str(ROOT))  # tools/seed_row.py and the runs it trains (tests/torch) from this checkout
    try:
        from tools.seed_row import olmo_core_row as make
    except ImportError as err:
        _fail(f"OLMo-core's row needs torch and ai2-olmo-core in this Python ({err}): pip install -e '.[dev]'")
    (root / "olmo-core").mkdir()
    return make(root / "olmo-core")


def table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    out = Table(title="The seed: a resume on another process count (1 -> 2) against one on the same (1 -> 1)")
    for name in ("framework", "steps", "resumed at", "re-fed examples", "re-fed share", "1 -> 1 control re-fed",
                 "bisect 1->2 vs 1->1"):
        out.add_column(name)
    for r in rows:
        control = r.get("control_1_to_1")
        out.add_row(r["framework"], str(r["steps"]), str(r.get("resumed_at", r.get("since"))), str(r["refed_examples"]),
                    f"{r['refed_share']:.4f}",
                    f"{control['refed_examples']} ({control['refed_share']:.4f})" if control else "-",
                    f"step {r['bisect']['step']}, {r['bisect']['cause']}")
    Console().print(out)


def main(argv: list[str]) -> None:
    as_json = "--json" in argv
    argv = [a for a in argv if a != "--json"]
    saved = None
    if "--maxtext-row" in argv:
        i = argv.index("--maxtext-row")
        if i + 1 >= len(argv) or not Path(argv[i + 1]).is_file():
            _fail("--maxtext-row needs a file holding the MaxText row")
        saved = Path(argv[i + 1])
        del argv[i:i + 2]
    if len(argv) > 1 or any(a.startswith("-") for a in argv):
        _fail("usage: python tools/seed_table.py [DIR] [--maxtext-row FILE] [--json]")
    root = Path(argv[0]) if argv else Path(tempfile.mkdtemp(prefix="seed-table-"))
    if root.exists() and any(root.iterdir()):
        _fail(f"{root} is not empty: name a new or empty folder for the runs")
    root.mkdir(parents=True, exist_ok=True)
    rows = [maxtext_row(root, saved), olmo_core_row(root)]
    if not as_json:
        table(rows)
    print(json.dumps({"seed_table": rows, "runs": str(root)}))


if __name__ == "__main__":
    main(sys.argv[1:])
