"""`replay verify` on every example loop and on the trainer's `tiny`, in one fresh 4-device process.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m tests.examples.verify_probe OUT

(4 devices must be set before JAX starts, so this runs apart from the suite's process.) For each
loop it records a clean run, and runs the CLI in-process:

    clean    verify --steps 6:7 of the clean run: expected clean, exit 0
    chip     the same with one chip made faulty: every shard that device computes comes back with
             one bit flipped, at the one place results leave the devices
             (replay.verify.rotation.shard_fingerprints): expected exit 1 naming that device
    trace    the clean run's code and checkpoints with a trace whose steps from CHANGED_AT on record
             other parameters after the update (one bit of each "update" fingerprint flipped: a
             recorded step that no re-execution reproduces, what a fault in training alone leaves):
             expected exit 1, a "trace" finding at the first step the traces differ. Rewritten from
             the clean trace rather than recorded by a second run with another learning rate: that
             run's step is another program, compiled and exported for this alone

and writes every report to OUT/results.json for tests/examples/test_verify_loops.py to judge.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

STEPS, EVERY, CHANGED_AT, BAD_DEVICE = 10, 5, 7, 1
EXAMPLES = ("optax_loop", "nnx_loop", "equinox_loop", "linen_lm")


def _mixed(clean: Path, out: Path) -> Path:
    """The clean run's manifest, checkpoints and code with its trace rewritten: from step CHANGED_AT
    on, the low bit of every fingerprint of a tensor of kind "update" flipped (every record before
    it as recorded)."""
    import dataclasses

    import numpy as np

    from traces import Run
    from traces.writer import TraceWriter

    shutil.copytree(clean, out)
    run = Run.open(out)
    update = np.array([kind == "update" for _, kind in run.schema.tensors])
    assert update.any(), run.schema.tensors
    records = []
    for rec in run.trace.records():
        if rec.step >= CHANGED_AT:
            assert rec.fingerprints is not None, rec.step
            rec = dataclasses.replace(rec, fingerprints=np.where(update, rec.fingerprints ^ np.uint64(1), rec.fingerprints))
        records.append(rec)
    shutil.rmtree(run.trace_dir)
    writer = TraceWriter(run.trace_dir, run.schema, first_step=records[0].step)
    for rec in records:
        writer.append(rec)
    writer.close()
    return out


def _record_example(name: str, root: Path) -> Path:
    import importlib

    example = importlib.import_module(name)
    return Path(example.train(example.Config(steps=STEPS, checkpoint_every=EVERY), str(root / f"{name}-clean")))


def _record_trainer(root: Path) -> Path:
    from tests.cli_util import invoke

    out = root / "tiny-clean"
    # One block: its compiles (training, then verify's rotated re-run) were over a third of this
    # probe's CPU with two, and no verify claim is about a second block.
    result = invoke("train", "--preset", "tiny", "--steps", str(STEPS), "--out", str(out),
                    "--set", f"checkpoint.every_steps={EVERY}", "--set", "model.n_layers=1")
    assert result.exit_code == 0, result.output
    return out


def _verify(run: Path, *extra: str) -> dict:
    from tests.cli_util import invoke

    result = invoke("verify", str(run), "--steps", "6:7", "--json", *extra)
    lines = result.stdout.strip().splitlines()
    return {"exit": result.exit_code, "report": json.loads(lines[-1]) if lines and lines[-1].startswith("{") else None,
            "stderr": result.stderr[-2000:]}


def _with_bad_chip(device: int):
    """shard_fingerprints as a chip `device` that returns every result with its low bit flipped."""
    from replay.verify import rotation

    honest = rotation.shard_fingerprints

    def faulty(outputs):
        return {key: [(d, fp ^ 1 if d == device else fp) for d, fp in values]
                for key, values in honest(outputs).items()}

    return faulty


def main(out: Path) -> None:
    import jax

    from replay.verify import rotation

    assert jax.device_count() == 4, jax.devices()
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    results = {}
    for name in EXAMPLES + ("tiny",):
        run = _record_trainer(out) if name == "tiny" else _record_example(name, out)
        clean = _verify(run)
        honest = rotation.shard_fingerprints
        rotation.shard_fingerprints = _with_bad_chip(BAD_DEVICE)
        try:
            chip = _verify(run)
        finally:
            rotation.shard_fingerprints = honest
        trace = _verify(_mixed(run, out / f"{name}-mixed"))
        results[name] = {"clean": clean, "chip": chip, "trace": trace}
    (out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
