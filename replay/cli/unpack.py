"""`replay unpack FILE DIR`: write a bundle's files out (a run folder with its REPORT.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from replay.cli import console
from replay.engine.code import MARKER


def unpack(
    file: Annotated[Path, typer.Argument(metavar="FILE", help="The bundle (what `replay pack` wrote).", show_default=False)],
    dest: Annotated[Path, typer.Argument(metavar="DIR", help="A new (or empty) folder to write it to.", show_default=False)],
    json_out: Annotated[bool, typer.Option("--json", help="Print what was written as JSON.")] = False,
) -> None:
    """Verify a bundle and write its files to DIR: a run folder you can show, run or bisect."""
    from replay import bundle
    from traces import Run

    from traces.storage import is_url, shown

    if is_url(file):  # a bundle is one file: copying it here is one command
        console.fail(f"{shown(file)}: unpack reads a bundle from local disk; copy the file here first")
    console.local_output("DIR", dest)  # show, run and bisect read the bundle FILE itself, unpacked or not
    header = bundle.unpack(file, dest)
    info = Run.open(dest).manifest.get("bundle") or {}
    files = sorted(p for p in dest.rglob("*") if p.is_file())
    sizes = {}
    for p in files:
        top = p.relative_to(dest).parts[0]
        sizes[top] = sizes.get(top, 0) + p.stat().st_size
    if json_out:
        console.print_json({"path": str(dest), "format_version": header.format_version, "lite": header.lite,
                            "steps": info.get("steps"), "checkpoint": info.get("checkpoint"),
                            "files": [str(p.relative_to(dest)) for p in files], "sizes": sizes})
        return
    console.print_table([(name, bundle.fmt_bytes(n)) for name, n in sorted(sizes.items())],
                        columns=("in " + str(dest), "size"), justify=("left", "right"))
    a, b = info.get("steps", ["A", "B"])
    console.print_text(f"unpacked {file} (bundle format_version {header.format_version}, checksum ok) to {dest}: "
                       f"read {dest / bundle.REPORT}; it is a run: "
                       + (f"replay show {dest}" if header.lite else f"replay run {dest} --steps {a}:{b}")
                       + f" (it stays a bundle's: {MARKER} marks it, and replay runs no code from it)")


def register(app: typer.Typer) -> None:
    app.command("unpack")(unpack)
