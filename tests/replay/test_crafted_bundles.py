"""Crafted bundles: what someone who controls every byte of a bundle, its checksums included, can
make replay do. Each variant below is a real bundle (`replay pack` of a small replay.init run)
rewritten so that only its content is malicious: the tar payload changed, then the zstd frame,
the payload's sha256 and the header crcs recomputed (and the manifest's own checksum, through
traces' write_manifest), so every integrity check passes and only replay's judgement of what a
bundle may hold stands between the file and the user's machine.

Every command that reads a run (show, run, bisect, audit, spike, verify, compare, pack, unpack),
with and without --allow-code where it takes it, must: exit 2 with one `error:` line naming the
bundle file; import nothing the bundle names or carries (sys.modules, and the side effect the
carried module has when imported); call no function the bundle names (sys.exit, os.system and
print with the run would show); write no file anywhere but where it was told (nothing, when it
refuses); and never say identical, bit-exact or complete. Folders `replay unpack` wrote stay
bundles (its FROM_BUNDLE.json mark), and code inside a run's own folder never runs, mark or not.

Also here, sharing the recorded run: `replay bisect RUN BUNDLE` of a run and its own bundle with
--allow-code (one side replays with the user's code, the other from the exported program; issue
30, item 5: was exit 2, "the runs' states have different structures").
"""

from __future__ import annotations

import builtins
import hashlib
import io
import json
import os
import re
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np
import pytest
import zstandard

import traces
from replay.bundle import format as fmt
from replay.engine.code import MARKER
from tests.cli_util import assert_one_line_error, invoke
from tests.replay.test_exported import record
from traces.run import write_manifest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))  # the example is "installed": its entry point imports by name
import optax_loop  # noqa: E402

EVIL = "evil_rpk"  # the module a crafted bundle carries or names
ENV = "REPLAY_CRAFTED_IMPORTED"
VOUCHING = re.compile(r"\b(identical|bit-exact|complete)\b")
CODE = """
import os, pathlib
pathlib.Path({flag!r}).write_text("imported")
os.environ[{env!r}] = "1"
import replay
@replay.entrypoint
def make(config):
    pathlib.Path({flag!r}).write_text("called")
@replay.entrypoint
def replayable(run, **kw):
    pathlib.Path({flag!r}).write_text("called")
"""


def _record(path: Path, **bug) -> Path:
    """examples/optax_loop.py's loop, 8 steps, recorded naming its own entry point (test_exported's recorder)."""
    return record(path, entrypoint=optax_loop.make, steps=8, **bug)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("crafted")
    run = _record(root / "run")
    bundle = root / "clean.rpk"
    result = invoke("pack", str(run), "--steps", "5:7", "-o", str(bundle))
    assert result.exit_code == 0, result.output
    return {"root": root, "run": run, "bundle": bundle, "members": read_members(bundle)}


# ---------------------------------------------------------------------------- rewriting a bundle's payload


def read_members(path: Path) -> list[tuple[tarfile.TarInfo, bytes | None]]:
    fmt.verify(path)
    with open(path, "rb") as f:
        f.seek(fmt.HEADER_SIZE)
        raw = zstandard.ZstdDecompressor().stream_reader(f).read()
    with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as tar:
        return [(m, tar.extractfile(m).read() if m.isfile() else None) for m in tar.getmembers()]


def write_bundle(path: Path, members) -> Path:
    """The members as a bundle whose every checksum holds: tar, zstd frame, sha256, header crcs."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    payload = zstandard.ZstdCompressor(level=3, write_checksum=True).compress(buf.getvalue())
    path.write_bytes(fmt._encode_header(len(payload), hashlib.sha256(payload).digest(), False) + payload)
    fmt.verify(path)  # the crafted file passes every integrity check
    return path


def member(name: str, data: bytes = b"", kind: bytes = tarfile.REGTYPE, **attrs) -> tuple[tarfile.TarInfo, bytes | None]:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.mtime = kind, 0o644, 0
    for k, v in attrs.items():
        setattr(info, k, v)
    if kind == tarfile.REGTYPE:
        info.size = len(data)
        return info, data
    return info, None


def manifest_of(members) -> dict:
    return json.loads(next(d for i, d in members if i.name == "run.json"))


def with_manifest(members, manifest: dict, checksum: bool = True) -> list:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run.json"
        write_manifest(path, manifest)  # its checksum recomputed: the manifest passes its own check
        data = path.read_bytes()
    if not checksum:
        body = json.loads(data)
        body.pop("manifest_sha256")
        data = json.dumps(body).encode()
    return [member("run.json", data) if i.name == "run.json" else (i, d) for i, d in members]


def set_keys(checksum: bool = True, **keys):
    """Manifest keys set (None: removed)."""
    def craft(members, ctx):
        m = manifest_of(members)
        for k, v in keys.items():
            m.pop(k, None) if v is None else m.__setitem__(k, v)
        return with_manifest(members, m, checksum)
    return craft


def plus(*extra):
    """Members appended (after the checkpoint: everything real is extracted before them)."""
    return lambda members, ctx: members + [e(ctx) if callable(e) else e for e in extra]


def chain(*crafts):
    def craft(members, ctx):
        for c in crafts:
            members = c(members, ctx)
        return members
    return craft


def carried(name: str):
    return lambda ctx: member(name, CODE.format(flag=str(ctx["flag"]), env=ENV).encode())


class _Unpickled:
    def __init__(self, flag: str):
        self.flag = flag

    def __reduce__(self):  # what unpickling would run
        return exec, (f"open({self.flag!r}, 'w').write('unpickled')",)


def pickled_npz(name: str):
    def make(ctx):
        buf = io.BytesIO()
        np.savez(buf, rows=np.array([_Unpickled(str(ctx["flag"]))], dtype=object), allow_pickle=True)
        return member(name, buf.getvalue())
    return make


def pickle_file(name: str):
    import pickle

    return lambda ctx: member(name, pickle.dumps(_Unpickled(str(ctx["flag"]))))


CRAFTED = {
    # manifest keys that name code
    "replayable sys:exit": set_keys(replayable="sys:exit"),
    "replayable builtins:print": set_keys(replayable="builtins:print"),
    "replayable os:system": set_keys(replayable="os:system"),
    "replayable names a module it carries": chain(set_keys(replayable=f"{EVIL}:replayable", replayable_path="."),
                                                  plus(carried(f"{EVIL}.py"))),
    "replayable_path inside it": set_keys(replayable_path="."),
    "entrypoint carried in program/": chain(set_keys(entrypoint=f"{EVIL}:make", entrypoint_path="program", exported=None),
                                            plus(carried(f"program/{EVIL}.py"))),
    "entrypoint_path inside it": set_keys(entrypoint=f"{EVIL}:make", entrypoint_path=".", exported=None),
    "entrypoint on a trainer-like bundle": set_keys(replayable=None, entrypoint=f"{EVIL}:make"),
    # issue 30 item 2: the "bundle" key dropped, the entry point a module inside it
    "no bundle key, code inside": chain(set_keys(bundle=None, entrypoint=f"{EVIL}:make", entrypoint_path=".",
                                                 exported=None), plus(carried(f"{EVIL}.py"))),
    "no bundle key, no exported program": set_keys(bundle=None, exported=None),
    "checksum removed, replayable sys:exit": set_keys(checksum=False, replayable="sys:exit"),
    "the unpack mark shipped inside": plus(member(MARKER, b"{}")),
    "sitecustomize in trace/": plus(carried("trace/sitecustomize.py")),
    # pickles: never unpickled
    "pickled npz in data/": plus(pickled_npz("data/examples.npz")),
    "pickle in a checkpoint": plus(pickle_file("checkpoints/5/state.pkl")),
    "unnamed file in examples/": plus(pickle_file("examples/rows2.bin")),
    # members that point outside the destination, or are not files
    "../ member": plus(member("../escaped-dotdot", b"x")),
    "nested ../ member": plus(member("trace/../../escaped-nested", b"x")),
    "absolute member": plus(lambda ctx: member(str(ctx["work"] / "escaped-abs"), b"x")),
    "symlink out": plus(member("trace/link", kind=tarfile.SYMTYPE, linkname="../../escaped-link")),
    "absolute symlink": plus(member("trace/abslink", kind=tarfile.SYMTYPE, linkname="/etc/passwd")),
    "hard link inside": plus(member("trace/hard", kind=tarfile.LNKTYPE, linkname="run.json")),
    "hard link out": plus(member("trace/hard", kind=tarfile.LNKTYPE, linkname="../escaped-hard")),
    "PAX path override": plus(member("trace/ok.seg", b"x", pax_headers={"path": "../escaped-pax"})),
    "fifo": plus(member("trace/fifo", kind=tarfile.FIFOTYPE)),
    "character device": plus(member("trace/null", kind=tarfile.CHRTYPE, devmajor=1, devminor=3)),
    "block device": plus(member("trace/sda", kind=tarfile.BLKTYPE, devmajor=8, devminor=0)),
}


# ---------------------------------------------------------------------------- what must not happen


@pytest.fixture
def watch(tmp_path, monkeypatch):
    """Records every call of a function a bundle could name (with the run, as replay would call a
    factory); temporary folders go under tmp_path/tmp, so what commands leave there is seen."""
    calls: list[str] = []
    real_exit, real_print = sys.exit, builtins.print

    def named(*args) -> bool:
        return any(isinstance(a, traces.Run) for a in args)

    def spy_exit(*a):
        if named(*a):
            calls.append("sys.exit")
        return real_exit(*a)

    def spy_print(*a, **kw):
        if named(*a):
            calls.append("print")
        return real_print(*a, **kw)

    monkeypatch.setattr(sys, "exit", spy_exit)
    monkeypatch.setattr(builtins, "print", spy_print)
    monkeypatch.setattr(os, "system", lambda *a: calls.append("os.system") or 0)
    monkeypatch.delenv(ENV, raising=False)
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    return {"calls": calls, "work": tmp_path, "flag": tmp_path / "side-effect", "modules": set(sys.modules)}


def commands(target: Path, run: Path, work: Path) -> list[tuple[str, ...]]:
    t, r, out = str(target), str(run), str(work / "out.rpk")
    return [
        ("show", t), ("run", t, "--steps", "6:7"), ("run", t, "--steps", "6:7", "--allow-code"), ("bisect", r, t),
        ("bisect", r, t, "--allow-code"),
        ("audit", t), ("spike", t), ("spike", t, "--step", "6", "--allow-code"), ("verify", t, "--steps", "6"),
        ("compare", t, r, "--eval"), ("pack", t, "--steps", "6:7", "-o", out),
        ("pack", t, "--steps", "6:7", "-o", out, "--allow-code"), ("unpack", t, str(work / "dest")),
    ]


def assert_untouched(watch) -> None:
    assert watch["calls"] == [], watch["calls"]
    new = [sys.modules[n] for n in set(sys.modules) - watch["modules"] if n in sys.modules]
    assert EVIL not in sys.modules and not any(_from(m, watch["work"]) or _from(m, Path(tempfile.gettempdir()))
                                               for m in new), "a module from the bundle was imported"
    assert ENV not in os.environ and not watch["flag"].exists()
    assert not list(Path("/tmp").glob("escaped-*")) and not list(watch["work"].parent.glob("escaped-*"))


def _from(module, folder: Path) -> bool:
    f = getattr(module, "__file__", None)
    return bool(f) and Path(folder) in Path(f).resolve().parents


def assert_refused(result, target: Path) -> None:
    line = assert_one_line_error(result, str(target))
    assert not VOUCHING.search(result.output), result.output


# ---------------------------------------------------------------------------- the crafted bundles


@pytest.mark.parametrize("name", list(CRAFTED))
def test_a_crafted_bundle_is_refused_by_every_command(base, watch, name):
    work = watch["work"]
    crafted = write_bundle(work / "crafted.rpk", CRAFTED[name](list(base["members"]), watch))
    for args in commands(crafted, base["run"], work):
        result = invoke(*args)
        assert_refused(result, crafted)
        assert_untouched(watch)
    # nothing written anywhere: no unpacked folder, no bundle, no temporary folder left behind
    assert sorted(p.relative_to(work).as_posix() for p in work.rglob("*")) == ["crafted.rpk", "tmp"]


def test_the_uncrafted_bundle_passes_the_same_commands(base, watch):
    """The refusals above are the crafting's: the bundle they were made from is accepted (the
    check can fail), after a round trip through the same rewriting."""
    work = watch["work"]
    same = write_bundle(work / "same.rpk", list(base["members"]))
    for args in (("show", str(same)), ("run", str(same), "--allow-code"), ("bisect", str(base["run"]), str(same)),
                 ("unpack", str(same), str(work / "dest"))):
        result = invoke(*args)
        assert result.exit_code == 0, (args, result.output)
    assert (work / "dest" / MARKER).is_file()
    assert_untouched(watch)


# ---------------------------------------------------------------------------- unpacked, then changed


def _unpacked_and_changed(base, work: Path, keep_mark: bool) -> Path:
    """`replay unpack` of the real bundle, then what a bundle could not do itself: its manifest
    made to name a module placed inside the folder (absolute path: a bundle cannot know it, but
    a user's own edit can), its exported program dropped so only code could replay it."""
    dest = work / "unpacked"
    result = invoke("unpack", str(base["bundle"]), str(dest))
    assert result.exit_code == 0, result.output
    assert (dest / MARKER).is_file()
    manifest = traces.Run.open(dest).manifest
    for key in ("bundle", "exported"):
        manifest.pop(key)
    write_manifest(dest / "run.json", {**manifest, "entrypoint": f"{EVIL}:make", "entrypoint_path": str(dest)})
    (dest / f"{EVIL}.py").write_text(CODE.format(flag=str(work / "side-effect"), env=ENV))
    if not keep_mark:
        (dest / MARKER).unlink()
    return dest


@pytest.mark.parametrize("keep_mark", [True, False], ids=["marked", "mark-removed"])
def test_an_unpacked_bundle_never_runs_code_placed_in_it(base, watch, keep_mark):
    """Marked: every command refuses the folder (it is a bundle's, and its manifest now names code).
    Mark removed:
    a run folder, whose own code still never runs (old code imported it with --allow-code);
    commands that need no code read it as the run it now is."""
    dest = _unpacked_and_changed(base, watch["work"], keep_mark)
    replaying = {"run", "bisect", "pack"}
    for args in commands(dest, base["run"], watch["work"]):
        if args[0] == "unpack":
            continue  # takes a bundle file, not a folder
        result = invoke(*args)
        if keep_mark:
            assert_refused(result, dest)
        elif args[0] in replaying or "--step" in args:  # bisect's trace scan first says what it compared
            assert_one_line_error(result, str(dest))
        else:
            assert result.exit_code in (0, 2), (args, result.output)
        assert_untouched(watch)
    if not keep_mark:
        line = assert_one_line_error(invoke("run", str(dest), "--steps", "6:7", "--allow-code"),
                                     "inside the run's own folder")
        assert EVIL in line


# ---------------------------------------------------------------------------- a run and its own bundle (item 5)


@pytest.mark.parametrize("flags", [[], ["--allow-code"]], ids=["plain", "allow-code"])
def test_bisect_of_a_run_and_its_own_bundle_is_identical_either_way(base, flags):
    """The run replays with its code (installed), the bundle from its exported program: their states
    compare as the same tree (was exit 2: "the runs' states have different structures")."""
    for a, b in ((base["run"], base["bundle"]), (base["bundle"], base["run"])):
        result = invoke("bisect", str(a), str(b), "--json", *flags)
        assert result.exit_code == 0, result.output
        report = json.loads(result.stdout)
        assert report["identical"] and report.get("failure") is None, report


def test_bisect_with_code_against_a_bundle_still_finds_a_difference(base, tmp_path):
    """The check can fail: a run whose learning rate changes at step 6, against the clean run's
    bundle, differs at step 6, with the cause found by replaying each side its own way."""
    other = _record(tmp_path / "lr", lr_bump_at=6)
    result = invoke("bisect", str(other), str(base["bundle"]), "--json", "--allow-code")
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert report["first_step"] == 6 and report.get("failure") is None, report


def test_the_trainers_example_loader_never_unpickles(tmp_path):
    """A trainer bundle's data/examples.npz is read with allow_pickle=False: an object array in it
    is a damaged bundle (DataError), and what it holds never runs."""
    from trainer import data as datalib

    flag = tmp_path / "side-effect"
    path = tmp_path / "examples.npz"
    np.savez(path, meta=np.frombuffer(b"{}", np.uint8), ids=np.array([_Unpickled(str(flag))], dtype=object),
             rows=np.zeros((1, 2)), allow_pickle=True)
    with pytest.raises(datalib.DataError, match="unreadable"):
        datalib.open_example_file(path, 10)
    assert not flag.exists()
