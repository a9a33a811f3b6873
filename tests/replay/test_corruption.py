"""Random damage to a real run: its multi-segment trace, a checkpoint data file, its run.json.

The promise under test (issue 10): no damaged input is ever reported identical, bit-exact or
complete; each is refused with one `error:` line on stderr, exit 2, naming the damaged file.
The commands are the ones that would otherwise vouch for the run: `show --verify` (complete),
`bisect A B` (identical), `run B --steps ...` (bit-exact). Before damaging anything, the same
commands on the intact copy must say "complete", "identical" and "bit-exact" (exit 0), so a
check that refused everything would fail here too.

One tiny run (the session's, tests/tiny_run.py) is read by the module; each case damages a fresh
copy of it. The trace of the copy is rewritten into segments of 4 records, so the damage lands in
sealed segments, the unsealed tail, headers, seals and the gaps between files.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path

import pytest

from tests.cli_util import invoke
from tests.tiny_run import tiny_run
from traces import Run, TraceWriter

STEPS, PER_SEGMENT = 20, 4
TRACE_CASES, MANIFEST_CASES, CHECKPOINT_CASES = 48, 40, 4  # checkpoint: material damages wanted
VOUCHING_WORDS = re.compile(r"\b(identical|bit-exact|complete)\b", re.IGNORECASE)


@pytest.fixture(autouse=True)
def _no_debug(monkeypatch):
    monkeypatch.delenv("REPLAY_DEBUG", raising=False)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    """(A, B): A as trained (one segment; the tiny preset's run, 20 steps, shared with other files: read
    only), B the same run with its trace in 4-record segments."""
    a = tiny_run()
    assert Run.open(a).manifest["config"]["steps"] == STEPS
    b = tmp_path_factory.mktemp("corruption") / "B"
    shutil.copytree(a, b)
    _resegment(b)
    return a, b


def _resegment(path: Path) -> None:
    run = Run.open(path)
    records = [run.trace.read(k) for k in range(run.trace.start, run.trace.end)]
    shutil.rmtree(run.trace_dir)
    writer = TraceWriter(run.trace_dir, run.schema, segment_records=PER_SEGMENT, first_step=0)
    for rec in records:
        writer.append(rec)
    writer.close()


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _refused(result, *names: str, after_status: bool = False) -> None:
    """Exit 2, exactly one stderr line, `error: ...`, naming one of `names`; nothing vouching.

    after_status: the damage can only be seen once the replay restores the checkpoint, so the
    replay's status lines (compiling, the contract line, the progress bar) may come first; the
    error is still the one line that says what is wrong, and the last."""
    lines = [l for l in result.stderr.splitlines() if l.strip()]
    assert result.exit_code == 2, (result.exit_code, result.output)
    errors = [l for l in lines if l.startswith("error: ")]
    if after_status:
        assert len(errors) == 1 and lines[-1] == errors[0], result.stderr
        assert not any(l.startswith("warning: ") for l in lines), result.stderr
    else:
        assert len(lines) == 1 and errors, result.stderr
    assert any(n in errors[0] for n in names), (names, errors[0])
    assert not VOUCHING_WORDS.search(result.stdout), result.stdout
    assert "Traceback" not in result.output


def test_the_intact_copies_are_vouched_for(trained):
    """The baseline the damage cases depart from: without damage, every command vouches."""
    a, b = trained
    assert len(list((b / "trace").glob("*.seg"))) == STEPS // PER_SEGMENT
    show = invoke("show", str(b), "--verify")
    assert show.exit_code == 0 and "complete" in show.stdout, show.output
    bis = invoke("bisect", str(a), str(b))
    assert bis.exit_code == 0 and "identical" in bis.stdout, bis.output
    run = invoke("run", str(b), "--steps", f"0:{STEPS - 1}")
    assert run.exit_code == 0 and "bit-identical" in run.stdout, run.output


# ------------------------------------------------------------------------------ the trace

def _damage_trace(rng: random.Random, trace_dir: Path) -> tuple[str, Path]:
    """One random damage to one segment file; returns (what, the file)."""
    seg = rng.choice(sorted(trace_dir.glob("*.seg")))
    size = seg.stat().st_size
    kind = rng.choice(["flip", "flip", "flip", "truncate", "zero", "delete", "directory"])
    if kind == "flip":
        data = bytearray(seg.read_bytes())
        at = rng.randrange(size)
        data[at] ^= rng.randrange(1, 256)
        seg.write_bytes(bytes(data))
        return f"flip byte {at}", seg
    if kind == "truncate":
        cut = rng.randrange(size)
        os.truncate(seg, cut)
        return f"truncate to {cut}", seg
    if kind == "zero":
        start = rng.randrange(size)
        length = rng.randint(1, 64)
        with open(seg, "r+b") as f:
            f.seek(start)
            f.write(b"\0" * min(length, size - start))
        return f"zero {length} bytes at {start}", seg
    if kind == "delete":
        seg.unlink()
        return "delete", seg
    seg.unlink()
    seg.mkdir()
    return "replace with a directory", seg


def test_random_trace_damage_is_never_vouched_for(trained, tmp_path):
    a, b = trained
    rng = random.Random(10)
    seen_kinds = set()
    for case in range(TRACE_CASES):
        damaged = _copy(b, tmp_path / f"t{case}")
        what, seg = _damage_trace(rng, damaged / "trace")
        if what.startswith("zero") and (b / "trace" / seg.name).read_bytes() == seg.read_bytes():
            continue  # zeroed bytes that were zero already: not damage
        seen_kinds.add(what.split()[0])
        # Any file of the damaged trace may be the one named: a deleted segment is named by the
        # gap it leaves (its successor) or, at the end, by the run's recorded end.
        names = (str(damaged / "trace"),)
        # audit reads the checksummed index tables and spike's scan one metric column, not whole records: a
        # record-level change that opening the run cannot see is theirs to miss (never to vouch for).
        hidden = not Run.open(damaged).damage
        for args in (("show", str(damaged), "--verify"), ("bisect", str(a), str(damaged)),
                     ("run", str(damaged), "--steps", f"0:{STEPS - 1}"), ("audit", str(damaged)),
                     ("spike", str(damaged), "--window", "5"),
                     ("compare", str(a), str(damaged), "--eval", "--examples", "8"),
                     ("pack", str(damaged), "--steps", f"0:{STEPS - 1}", "--out", str(tmp_path / f"t{case}.rpk"))):
            if hidden and args[0] == "compare":
                continue  # it evaluates checkpoints and never reads a record: nothing here for it to see
            result = invoke(*args)
            if hidden and args[0] in ("audit", "spike") and result.exit_code == 0:
                assert not re.search(r"identical|bit-exact", result.stdout, re.IGNORECASE), result.stdout
                assert args[0] != "audit" or "not the records" in result.stderr, result.stderr  # audit says so
                continue
            try:
                assert not (tmp_path / f"t{case}.rpk").exists(), "packed a damaged run"
                _refused(result, *names)
            except AssertionError as e:
                raise AssertionError(f"case {case} ({what} of {seg.name}), `replay {args[0]}`: {e}") from None
    assert seen_kinds >= {"flip", "truncate", "delete"}, seen_kinds


# ------------------------------------------------------------------------------ run.json

def _damage_manifest(rng: random.Random, path: Path) -> str:
    text = path.read_bytes()
    kind = rng.choice(["flip", "flip", "truncate", "edit"])
    if kind == "flip":
        data = bytearray(text)
        at = rng.randrange(len(data))
        data[at] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(data))
        return f"flip a bit of byte {at}"
    if kind == "truncate":
        cut = rng.randrange(len(text))
        path.write_bytes(text[:cut])
        return f"truncate to {cut}"
    manifest = json.loads(text)
    edits = [
        ("format_version", -1),
        ("config.seed", manifest["config"]["seed"] + 1),
        ("config.optimizer.lr", 0.5),
        ("data.fingerprint", "0" * 16),
        ("program_hash", "f" * 64),
        ("checkpoints", [0]),
        ("trace_first_step", 4),
    ]
    key, value = rng.choice(edits)
    node = manifest
    *parents, leaf = key.split(".")
    for p in parents:
        node = node[p]
    node[leaf] = value
    path.write_text(json.dumps(manifest, indent=2))
    return f"edit {key}"


def test_random_manifest_damage_is_never_vouched_for(trained, tmp_path):
    a, b = trained
    rng = random.Random(4)
    original = json.loads((b / "run.json").read_text())
    checked = 0
    for case in range(MANIFEST_CASES):
        damaged = _copy(b, tmp_path / f"m{case}")
        what = _damage_manifest(rng, damaged / "run.json")
        try:
            if json.loads((damaged / "run.json").read_text()) == original:
                continue  # the bytes changed, the content did not (e.g. the trailing newline)
        except ValueError:
            pass
        checked += 1
        for args in (("show", str(damaged)), ("bisect", str(a), str(damaged)),
                     ("run", str(damaged), "--steps", "0:3"), ("audit", str(damaged)), ("spike", str(damaged)),
                     ("verify", str(damaged), "--steps", "0:2"), ("compare", str(a), str(damaged), "--eval"),
                     ("pack", str(damaged), "--steps", "0:3", "--out", str(tmp_path / f"m{case}.rpk"))):
            result = invoke(*args)
            try:
                _refused(result, "run.json")
            except AssertionError as e:
                raise AssertionError(f"case {case} ({what}), `replay {args[0]}`: {e}") from None
    assert checked >= MANIFEST_CASES * 3 // 4


STRIPPED_EDITS = [("config.seed", 8), ("config.optimizer.lr", 0.5), ("program_hash", "f" * 64),
                  ("checkpoints", [0]), ("data.fingerprint", "0" * 16), ("delete segment 0", None)]


@pytest.mark.parametrize("key,value", STRIPPED_EDITS, ids=[k for k, _ in STRIPPED_EDITS])
def test_an_edit_with_the_checksum_keys_removed_is_never_vouched_for(trained, tmp_path, key, value):
    """Issue 30 (3): removing manifest_sha256 and trace_first_step used to make the manifest pass
    for one recorded before checksums, so each of these edits was accepted with exit 0 (and a
    deleted leading segment called complete). Every command that reads a run refuses them."""
    a, b = trained
    damaged = _copy(b, tmp_path / "stripped")
    manifest = json.loads((damaged / "run.json").read_text())
    del manifest["manifest_sha256"], manifest["trace_first_step"]
    if value is None:
        (damaged / "trace" / "000000000000.seg").unlink()
    else:
        node = manifest
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    (damaged / "run.json").write_text(json.dumps(manifest, indent=2))
    for args in (("show", str(damaged), "--verify"), ("bisect", str(a), str(damaged)), ("audit", str(damaged)),
                 ("run", str(damaged), "--steps", "0:3"), ("spike", str(damaged)),
                 ("verify", str(damaged), "--steps", "0:2"), ("compare", str(a), str(damaged), "--eval"),
                 ("pack", str(damaged), "--steps", "0:3", "--out", str(tmp_path / "b.rpk"))):
        for trust in ((), ("--trust-unchecked-manifest",)):
            result = invoke(*trust, *args)
            try:
                _refused(result, "run.json")
            except AssertionError as e:
                raise AssertionError(f"{key} edited, checksum keys removed, `replay {' '.join(trust + args[:1])}`: {e}")
    assert not (tmp_path / "b.rpk").exists()


# ------------------------------------------------------------------------------ checkpoint data

def _data_files(checkpoint: Path) -> list[Path]:
    """The files of orbax's OCDBT store (array chunks and b-tree nodes), not its JSON metadata."""
    files = [p for p in checkpoint.rglob("*") if p.is_file() and p.parent.name == "d"]
    assert files, f"no OCDBT data files under {checkpoint}: has orbax's layout changed?"
    return files


def _restored_leaves(run: Path, step: int):
    """The state's leaves as host arrays, restored by orbax alone (no fingerprint check), or
    None when orbax cannot read the checkpoint: the independent judge of whether a damage is
    material (a flipped bit in, say, a b-tree node's timestamp changes no restored value)."""
    import jax
    import numpy as np

    from trainer import mesh as M
    from replay.record.checkpointer import Checkpointer
    from trainer.config import from_dict

    cfg = from_dict(json.loads((run / "run.json").read_text())["config"])
    try:
        with Checkpointer(run / "checkpoints", create=False) as ck:
            state = ck.restore(step, M.sharded_abstract_state(cfg, M.make_mesh(cfg.mesh)))
    except Exception:  # noqa: BLE001 - any failure to read is material damage
        return None
    return [np.asarray(jax.device_get(x)).tobytes() for x in jax.tree.leaves(state)]


@pytest.mark.slow
def test_random_checkpoint_data_damage_is_never_vouched_for(trained, tmp_path):
    """Orbax's chunks carry no checksum: without the recorded state fingerprint a flipped bit in
    them restores silently, and the replay would call the difference a divergence. Each damage
    is judged material or not by restoring with orbax alone and comparing every leaf's bytes;
    a material one must be refused, and CHECKPOINT_CASES material ones must be seen."""
    a, b = trained
    intact = _restored_leaves(b, 10)
    assert intact is not None
    rng = random.Random(7)
    material = attempts = 0
    # orbax names its data files at random, so which bytes a seeded flip hits differs between runs:
    # damage until CHECKPOINT_CASES material ones were seen (bounded), judging every one.
    while material < CHECKPOINT_CASES and attempts < 4 * CHECKPOINT_CASES:
        case, attempts = attempts, attempts + 1
        damaged = _copy(b, tmp_path / f"c{case}")
        files = sorted(_data_files(damaged / "checkpoints" / "10"), key=lambda p: (p.stat().st_size, p.name))
        # Half the cases hit the chunk file that holds the parameters' bytes (the largest).
        target = files[-1] if case % 2 == 0 else rng.choice(files)
        data = bytearray(target.read_bytes())
        at = rng.randrange(len(data))
        data[at] ^= 1 << rng.randrange(8)
        target.write_bytes(bytes(data))
        result = invoke("run", str(damaged), "--steps", "10:12")
        if _restored_leaves(damaged, 10) == intact:
            assert result.exit_code == 0, result.output  # nothing restored changed: the replay stands
            continue
        material += 1
        try:
            _refused(result, "checkpoints/10: checkpoint 10 is damaged", after_status=True)
        except AssertionError as e:
            raise AssertionError(f"case {case} (bit flip at byte {at} of {target}): {e}") from None
    assert material >= CHECKPOINT_CASES, (material, attempts)
