"""What a bundle may hold, judged after its checksums pass: they prove only that the bytes are
those packed, not who packed them, and whoever wrote the file controls every byte of it (its
sha256, its crcs and the manifest's own checksum included).

- `member_problem`: a tar member outside the layout of replay/bundle/format.py (MEMBERS, the
  top-level names `replay pack` writes) or holding code (CODE_SUFFIXES: a module, a pickle);
- `layout_problem`: a file under data/, program/ or examples/ that the manifest does not name
  (the batch rows, the exported program, the example store), so nothing replay reads;
- `manifest_problem`: a manifest that does not describe a bundle, or names code (`code_problem`):
  a bundle never chooses the code that replays it;
- `mark`: replay.engine.code.MARKER, written by `unpack` into the folder it fills before the first
  member: replay's own mark on the user's machine, which keeps the folder a bundle's for every
  command (replay.engine.code.is_bundle_run) whatever its manifest says; a member of that name is refused.

Each returns the reason as text (None: nothing wrong); replay/bundle/format.py raises it.
"""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath

from replay.engine.code import ALLOW_FLAG, API_FACTORY, MARKER, OWN_FACTORIES, is_spec
from traces.run import MANIFEST

MEMBERS = frozenset({MANIFEST, "COMPLETE", "REPORT.md", "trace", "data", "checkpoints", "program", "examples"})
CODE_SUFFIXES = (".py", ".pyc", ".pyo", ".pyd", ".pyw", ".pth", ".so", ".dylib", ".dll", ".pkl", ".pickle", ".egg",
                 ".whl")
BUNDLE_CODE_TAIL = ("a bundle never chooses the code that replays it (replay pack writes none), and code it names is "
                    f"never run, with or without {ALLOW_FLAG}: ask for a bundle written by `replay pack`")


def member_problem(name: str) -> str | None:
    """Why the tar member `name` (already known to stay inside the bundle) is refused, or None."""
    parts = PurePosixPath(name).parts
    if parts[0] not in MEMBERS or name.lower().endswith(CODE_SUFFIXES):
        return (f"member {brief(name)} is not part of a bundle (replay pack writes only "
                f"{', '.join(sorted(MEMBERS))}, and no code); nothing was unpacked from it")
    return None


def layout_problem(stage: Path, manifest: dict) -> str | None:
    named = set()
    for entry, key in ((manifest.get("bundle"), "examples"), (manifest.get("exported"), "file"),
                       (manifest.get("example_store"), "file")):
        if isinstance(entry, dict) and isinstance(entry.get(key), str):
            named.add(entry[key])
    for top in ("data", "program", "examples"):
        for p in sorted((stage / top).rglob("*")) if (stage / top).is_dir() else []:
            rel = p.relative_to(stage).as_posix()
            if p.is_file() and rel not in named:
                return (f"member {brief(rel)} is not part of a bundle (its manifest names no such file); nothing "
                        "was unpacked from it")
    return None


def code_problem(manifest: dict) -> str | None:
    """What a bundle's manifest names of code (None: nothing but replay's own factories).

    A bundle replays with the factory replay knows for its kind of run (the trainer's, or
    replay.init's exported program), never with code its manifest chooses: any other
    "replayable", a folder of code ("replayable_path", a relative "entrypoint_path": inside the
    bundle), or an "entrypoint" where replay.init's factory is not the one named (only replay.init
    runs have one, and a bundle's is shown, never imported) is refused. `replay pack` writes none
    of these (an absolute "entrypoint_path" of an older pack names the packer's folder: unused)."""
    named = manifest.get("replayable")
    if named is not None and named not in OWN_FACTORIES:
        return f"its manifest names code to replay it with ('replayable': {brief(named)})"
    if "replayable_path" in manifest:
        return f"its manifest names a folder of code ('replayable_path': {brief(manifest['replayable_path'])})"
    where = manifest.get("entrypoint_path")
    if where is not None and not (isinstance(where, str) and Path(where).is_absolute()):
        return f"its manifest names a folder of code inside it ('entrypoint_path': {brief(where)})"
    entry = manifest.get("entrypoint")
    if entry is not None and (named != API_FACTORY or not is_spec(entry)):
        return f"its manifest names code to replay it with ('entrypoint': {brief(entry)})"
    return None


def manifest_problem(manifest: dict) -> str | None:
    if not isinstance(manifest.get("bundle"), dict):  # replay pack always writes it
        return ("its manifest does not describe a bundle (no \"bundle\" entry), so it was not written by `replay "
                f"pack`, or was edited after `replay unpack` (whose mark it still holds); {BUNDLE_CODE_TAIL}")
    problem = code_problem(manifest)
    return None if problem is None else f"{problem}; {BUNDLE_CODE_TAIL}"


def mark(folder: Path, bundle: Path, sha256: bytes) -> None:
    note = {"unpacked_from": str(Path(bundle).absolute()), "sha256": sha256.hex(),
            "why": "written by replay unpack: this folder came from a bundle, so replay runs no code from it"}
    with open(folder / MARKER, "x") as f:
        json.dump(note, f, indent=1)


def brief(name: str) -> str:
    text = repr(name)
    return text if len(text) <= 80 else text[:77] + "..."
