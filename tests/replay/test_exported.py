"""Exported programs: a run recorded through replay.init replays without the user's code, from the
jax.export program and the example store it recorded; a bundle of it replays after the run and
its data are gone. Tampering with either file is refused (exit 2, naming it); a real difference
is caught (exit 1). In-process tests record with an entry point that cannot be imported (so the
CLI must use the exported program); the fresh-process ones (slow) use examples/optax_loop.py as a
user runs it, from another working directory.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from typer.testing import CliRunner

import replay
from replay.cli.app import app
from replay.record import examples_store
from replay.record.hashing import example_hashes
from traces import Run

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))
import optax_loop  # noqa: E402

STEPS = 12
MISSING = "_replay_no_such_module_:make"  # an entry point nothing can import: only the exported program replays


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def record(path: Path, entrypoint=MISSING, steps: int = STEPS, **bug) -> Path:
    """examples/optax_loop.py's train(), with another entry point named in the manifest."""
    cfg = optax_loop.Config(steps=steps, checkpoint_every=5, **bug)
    loop = optax_loop.make(dataclasses.asdict(cfg))
    run = replay.init(path, config=dataclasses.asdict(cfg), entrypoint=entrypoint, store_examples=True)
    step = run.step(batch_axis=0, metric_kinds=optax_loop.METRIC_KINDS)(loop.step)
    state = loop.init()
    for k in range(steps):
        if k % cfg.checkpoint_every == 0:
            run.save(k, state)
        state, _ = step(state, loop.batch_at(k))
    run.save(steps, state)
    run.finish()
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("exported")
    return {"clean": record(root / "clean"), "lr": record(root / "lr", lr_bump_at=8),
            "code": record(root / "code", entrypoint=optax_loop.make)}


def report_of(result) -> dict:
    assert result.exit_code in (0, 1), result.output
    return json.loads(result.stdout)


# ---------------------------------------------------------------------------- what is recorded


def test_the_store_hashes_as_the_trace_does():
    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(5, 3, 2)).astype(np.float32), "y": rng.integers(0, 9, (5,)).astype(np.int32)}
    for b, axis in ((batch, 0), (rng.normal(size=(4, 7)).astype(np.float16), 0), ({"t": batch["x"]}, 1)):
        leaves = examples_store.rows_of(b, axis)
        assert np.array_equal(examples_store.hashes_of(leaves), example_hashes(b, axis))


def test_the_manifest_records_the_program_and_the_store(runs):
    m = Run.open(runs["clean"]).manifest
    ex, store = m["exported"], m["example_store"]
    assert "error" not in ex and ex["devices"] == 1 and ex["file"] == "program/step.jaxexport"
    assert [s["path"] for s in ex["state"]][:2] == ["step", "params.dense_0.b"] and len(ex["batch"]) == 2
    assert ex["record"][:3] == ["loss", "grad_norm", "lr"] and "fingerprints" in ex["record"]
    assert store["enabled"] and [l["path"] for l in store["leaves"]] == ["x", "y"]
    assert store["leaves"][0]["shape"] == [16]


def test_the_store_grows_with_distinct_examples_not_steps(tmp_path):
    batch = optax_loop.batch_at(optax_loop.Config(), 3)
    writer = examples_store.ExampleWriter(tmp_path, 0)
    hashes = example_hashes(batch)
    writer.add(batch, hashes)
    size = (tmp_path / examples_store.FILE).stat().st_size
    for _ in range(3):
        writer.add(batch, hashes)  # the same examples fed again: nothing written
    writer.close()
    assert (tmp_path / examples_store.FILE).stat().st_size == size
    index, end = examples_store.scan(tmp_path / examples_store.FILE)
    assert len(index) == len(set(hashes.tolist())) and end == size


def test_a_torn_last_frame_is_a_crash_not_damage(tmp_path):
    batch = optax_loop.batch_at(optax_loop.Config(), 0)
    writer = examples_store.ExampleWriter(tmp_path, 0)
    writer.add(batch, example_hashes(batch))
    writer.close()
    f = tmp_path / examples_store.FILE
    whole = f.stat().st_size
    with open(f, "r+b") as fh:
        fh.truncate(whole - 7)
    index, end = examples_store.scan(f)
    assert len(index) == len(batch["x"]) - 1 and end < whole - 7
    resumed = examples_store.ExampleWriter(tmp_path, 0, resume=True)  # truncates the torn frame, re-adds it
    resumed.add(batch, example_hashes(batch))
    resumed.close()
    assert len(examples_store.scan(f)[0]) == len(batch["x"])


def _record_keyed(path: Path, seed: int, impl: str, steps: int = 6) -> Path:
    """A step whose state holds a typed key it splits every step (the NNX Rngs pattern, without NNX)."""
    @jax.jit
    def step(state, batch):
        key, sub = jax.random.split(state["key"])
        noise = jax.random.normal(sub, batch.shape)
        w = state["w"] + jnp.mean(batch + noise)
        return {"key": key, "w": w}, {"loss": jnp.mean(batch) * w}

    run = replay.init(path, config={}, entrypoint=MISSING, store_examples=True)
    wrapped = run.step(step)
    state = {"key": jax.random.key(seed, impl=impl), "w": jnp.zeros(())}
    for k in range(steps):
        if k % 3 == 0:
            run.save(k, state)
        state, _ = wrapped(state, np.full((4, 2), k, np.float32))
    run.finish()
    return path


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_a_step_with_typed_keys_in_the_state_replays_from_its_exported_program(tmp_path, impl):
    """Typed keys cross the exported signature as their raw words, wrapped back inside it; orbax
    restores them as typed keys, whose words are fed. Before, such a step was not exported."""
    run = _record_keyed(tmp_path / "r", 0, impl)
    ex = Run.open(run).manifest["exported"]
    assert "error" not in ex, ex
    key = next(s for s in ex["state"] if s["path"] == "key")
    width = 2 if impl == "threefry2x32" else 4
    assert key == {"path": "key", "dtype": "uint32", "shape": [width], "key": impl}
    j = report_of(invoke("run", str(run), "--steps", "1:5", "--json"))
    assert j["all_bit_exact"] and (j["checkpoint"], j["replayed"] + j["warmup_replayed"]) == (0, 6), j
    assert j["notes"][0].startswith("replayed from the exported program")
    # the comparison sees the key: the same program against another seed's trace differs at step 3's rng
    other = _record_keyed(tmp_path / "other", 1, impl)
    copy = tmp_path / "mixed"
    shutil.copytree(run, copy)
    shutil.rmtree(copy / "trace")
    shutil.copytree(other / "trace", copy / "trace")
    result = invoke("run", str(copy), "--steps", "3:4", "--json")
    assert result.exit_code == 1, result.output
    assert json.loads(result.stdout)["first_mismatch"]["step"] == 3


# ---------------------------------------------------------------------------- replaying without code


def test_replays_bit_exact_from_the_exported_program(runs):
    result = invoke("run", str(runs["clean"]), "--steps", "6:11", "--json")
    assert result.exit_code == 0, result.output
    j = report_of(result)
    assert (j["checkpoint"], j["replayed"], j["bit_exact"], j["warmup_bit_exact"]) == (5, 6, 6, 1)
    assert j["all_bit_exact"] and j["contract"]["expect_bits"]
    assert any(n.startswith("replayed from the exported program (program/step.jaxexport)") for n in j["notes"])


def test_an_importable_entry_point_replays_with_the_users_code(runs):
    j = report_of(invoke("run", str(runs["code"]), "--steps", "6:8", "--json"))
    assert j["all_bit_exact"] and j["notes"][0] == "replayed with your code (optax_loop:make)"


def test_an_injected_difference_is_caught(runs, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(runs["clean"], copy)
    shutil.rmtree(copy / "trace")
    shutil.copytree(runs["lr"] / "trace", copy / "trace")  # steps 0..7 identical, 8 differs in its update
    result = invoke("run", str(copy), "--steps", "6:10", "--json")
    assert result.exit_code == 1, result.output
    first = json.loads(result.stdout)["first_mismatch"]
    assert first["step"] == 8 and first["fields"][0]["kind"] == "update"


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def test_a_tampered_program_is_refused_naming_it(runs, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(runs["clean"], copy)
    member = copy / "program/step.jaxexport"
    _flip(member, member.stat().st_size // 2)
    result = invoke("run", str(copy), "--steps", "6:8")
    assert result.exit_code == 2, result.output
    line = result.stderr.strip().splitlines()
    assert len(line) == 1 and "program/step.jaxexport" in line[0] and "damaged" in line[0], result.stderr


def test_a_tampered_row_frame_is_refused_naming_it(runs, tmp_path):
    """A flipped byte in the frame of an example the replay feeds: found when that step's batch is
    read through the index (opening reads the index, not rows.bin), one line, exit 2."""
    copy = tmp_path / "run"
    shutil.copytree(runs["clean"], copy)
    h = int(Run.open(copy).trace.read(7).example_hashes[3])
    off, clen, _ = examples_store.scan(copy / examples_store.FILE)[0][h]
    _flip(copy / examples_store.FILE, off + clen // 2)
    result = invoke("run", str(copy), "--steps", "6:8")
    assert result.exit_code == 2, result.output
    errors = [l for l in result.stderr.splitlines() if l.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    assert errors[0] == result.stderr.strip().splitlines()[-1]
    assert "examples/rows.bin" in errors[0] and "damaged" in errors[0] and "example 3 of step 7" in errors[0]


def test_rows_swapped_under_a_valid_checksum_are_refused(runs, tmp_path):
    """A frame rewritten with other rows (and a fresh crc) fails the re-hash against the trace."""
    copy = tmp_path / "run"
    shutil.copytree(runs["clean"], copy)
    f = copy / examples_store.FILE
    data = bytearray(f.read_bytes())
    head = examples_store._HEAD
    magic, h, clen, rlen = head.unpack_from(data, 0)
    raw = bytearray(examples_store.zstandard.ZstdDecompressor().decompress(bytes(data[20 + 4:24 + clen])))
    raw[0] ^= 1
    frame = examples_store._frame(h, bytes(raw), examples_store.zstandard.ZstdCompressor(level=3))
    f.write_bytes(frame + bytes(data[24 + clen:]))
    assert struct.unpack_from("<I", frame, 20)[0] == zlib.crc32(frame[24:], zlib.crc32(frame[:20]))
    result = invoke("run", str(copy), "--steps", "0:1")  # step 0 feeds the first example stored
    assert result.exit_code == 2, result.output
    assert "examples/rows.bin" in result.stderr and "hash to" in result.stderr


def test_a_bundle_replays_after_the_run_is_deleted(runs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(runs["clean"], run)
    bundle = tmp_path / "bug.rpk"
    result = invoke("pack", str(run), "--steps", "7:10", "-o", str(bundle))
    assert result.exit_code == 0, result.output
    shutil.rmtree(run)
    j = report_of(invoke("run", str(bundle), "--json"))
    assert j["all_bit_exact"] and (j["checkpoint"], j["replayed"], j["warmup_bit_exact"]) == (5, 4, 2)
    assert any("exported program" in n for n in j["notes"])


def test_a_bundle_never_uses_code_even_when_it_is_installed(runs, tmp_path):
    bundle = tmp_path / "bug.rpk"
    assert invoke("pack", str(runs["code"]), "--steps", "6:7", "-o", str(bundle)).exit_code == 0
    j = report_of(invoke("run", str(bundle), "--json"))
    assert j["all_bit_exact"] and j["notes"][0].startswith("replayed from the exported program")


def test_a_full_pack_without_stored_examples_is_refused(tmp_path):
    cfg = optax_loop.Config(steps=2, checkpoint_every=5)
    loop = optax_loop.make(dataclasses.asdict(cfg))
    run = replay.init(tmp_path / "r", config=dataclasses.asdict(cfg), entrypoint=MISSING, store_examples=False)
    step = run.step(loop.step)
    state = loop.init()
    run.save(0, state)
    for k in range(2):
        state, _ = step(state, loop.batch_at(k))
    run.finish()
    assert Run.open(tmp_path / "r").manifest["example_store"] == {"format": 1, "enabled": False}
    assert not (tmp_path / "r" / "examples").exists()
    result = invoke("pack", str(tmp_path / "r"), "--steps", "0:1", "-o", str(tmp_path / "b.rpk"))
    assert result.exit_code == 2 and "store_examples=True" in result.stderr, result.output


# ---------------------------------------------------------------------------- fresh processes, as a user runs it


# `replay run RUN`, `replay pack RUN -o BUNDLE`, the run deleted, `replay run BUNDLE`: in one fresh process
# (argv: RUN BUNDLE), each command as the console script runs it; their results as one JSON line.
_ELSEWHERE = r"""
import json, shutil, sys
from typer.testing import CliRunner
from replay.cli.app import app
run, bundle = sys.argv[1:3]
done = []
def cli(*args):
    r = CliRunner().invoke(app, list(args))
    done.append({"code": r.exit_code, "stdout": r.stdout, "stderr": r.stderr[-3000:]})
cli("run", run, "--steps", "6:11", "--json")
cli("pack", run, "--steps", "7:10", "-o", bundle)
shutil.rmtree(run)  # the run, its checkpoints and its examples: gone
cli("run", bundle, "--json")
print(json.dumps({"results": done, "user_code_imported": "optax_loop" in sys.modules}))
"""


@pytest.mark.slow
def test_fresh_process_elsewhere_replays_the_example_from_its_exported_program(tmp_path):
    """Recorded by the example as a user runs it; replayed, packed and replayed from the bundle by
    one fresh process in another folder, where the example's code cannot be imported."""
    out = tmp_path / "mlp"
    rec = subprocess.run([sys.executable, str(EXAMPLES / "optax_loop.py"), "--out", str(out), "--steps", "12",
                          "--checkpoint-every", "5"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert rec.returncode == 0, rec.stderr
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    bundle = elsewhere / "bug.rpk"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    child = subprocess.run([sys.executable, "-c", _ELSEWHERE, str(out), str(bundle)], cwd=elsewhere, env=env,
                           capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    got = json.loads(child.stdout.strip().splitlines()[-1])
    replayed, packed, from_bundle = got["results"]
    assert not got["user_code_imported"] and not out.exists()
    assert replayed["code"] == 0, replayed["stderr"]
    j = json.loads(replayed["stdout"])
    assert j["all_bit_exact"] and (j["replayed"], j["bit_exact"]) == (6, 6)
    assert j["notes"][0].startswith("replayed from the exported program")
    assert packed["code"] == 0, packed["stderr"]
    assert from_bundle["code"] == 0, from_bundle["stderr"]
    assert json.loads(from_bundle["stdout"])["all_bit_exact"]


def _run_of_a_checkout(runs, tmp_path: Path) -> Path:
    """A copy of the clean run whose manifest names its loop in a folder that is not on sys.path
    (as a user's checkout is): its code imports only with --allow-code."""
    from traces.run import write_manifest

    module = "issue31_cached_loop"
    folder = tmp_path / "checkout"
    if not folder.exists():
        folder.mkdir()
        shutil.copy(EXAMPLES / "optax_loop.py", folder / f"{module}.py")
    run = tmp_path / f"run{len(list(tmp_path.glob('run*')))}"
    shutil.copytree(runs["clean"], run)
    manifest = json.loads((run / "run.json").read_text())
    manifest.update(entrypoint=f"{module}:make", entrypoint_path=str(folder))
    write_manifest(run / "run.json", manifest)
    return run


def test_each_command_opens_a_run_with_the_code_its_own_allow_code_allows(runs, tmp_path):
    """One process running commands in turn (a script or a notebook calling the CLI) gets for each
    the replayable its own --allow-code gives, not the one an earlier command opened and
    replay.engine.replayer.open_replayable keeps: compare --eval (which needs the loop's evaluate)
    works with --allow-code after a compare without it opened the exported program, and is refused
    without it after a compare with it loaded the loop's code."""
    from tests.cli_util import assert_one_line_error

    def compare(a: Path, b: Path, *flags: str):
        return invoke("compare", str(a), str(b), "--eval", "--json", *flags)

    def refused(result) -> None:
        assert_one_line_error(result, "loop's own code", "--allow-code")

    def agrees(result) -> None:
        assert result.exit_code == 0 and json.loads(result.stdout)["agree"], result.output

    first, second = _run_of_a_checkout(runs, tmp_path), _run_of_a_checkout(runs, tmp_path)
    refused(compare(first, second))
    agrees(compare(first, second, "--allow-code"))
    third, fourth = _run_of_a_checkout(runs, tmp_path), _run_of_a_checkout(runs, tmp_path)
    agrees(compare(third, fourth, "--allow-code"))
    refused(compare(third, fourth))
