"""Time `replay audit` on a synthetic step-level trace (default 1,000,000 steps x 16 examples).

The example hashes follow the trainer's order (a fresh permutation of the dataset per epoch)
with a planted sampler bug: from `--plant` on, 100 steps replay the batches of 1000 steps
earlier, as a sampler that re-reads data after a resume does. Writing the trace is not
timed. Prints one JSON object on its last line: seconds (the whole audit() call, trace
reading included), read_seconds, analyze_seconds, found_step, planted_step.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from replay.audit import audit, audit_hashes, read_example_hashes
from traces import Run, Schema, StepRecord

B = 16
SEQ_LEN = 32
SCHEMA = Schema(examples_per_step=B, rng_words=2, metrics=(("loss", "loss"), ("grad_norm", "backward")))


def example_hash(ids: np.ndarray) -> np.ndarray:
    """splitmix64 of the example id: distinct ids give distinct, well-spread uint64 hashes."""
    x = ids.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def planted_hashes(steps: int, n_examples: int, plant: int | None, seed: int = 0) -> np.ndarray:
    """uint64 (steps, B): the per-epoch permutation order, then steps plant..plant+99 repeat plant-1000.."""
    slots = np.arange(steps * B, dtype=np.int64)
    epochs, pos = np.divmod(slots, n_examples)
    ids = np.empty_like(slots)
    for e in range(int(epochs[-1]) + 1):
        lo, hi = np.searchsorted(epochs, [e, e + 1])
        ids[lo:hi] = np.random.default_rng([seed, e]).permutation(n_examples)[pos[lo:hi]]
    hashes = example_hash(ids).reshape(steps, B)
    if plant is not None:
        back = min(1000, plant)
        n = min(100, steps - plant, back)
        hashes[plant : plant + n] = hashes[plant - back : plant - back + n]
    return hashes


def write_run(path: Path, hashes: np.ndarray, n_examples: int) -> None:
    manifest = {"config": {"model": {"seq_len": SEQ_LEN}}, "data": {"n_tokens": n_examples * (SEQ_LEN + 1)}}
    run = Run.create(path, SCHEMA, manifest)
    writer, rng, metrics = run.writer(), np.zeros(2, np.uint32), np.zeros(2, np.float32)
    for step in range(hashes.shape[0]):
        writer.append(StepRecord(step, rng, step + 1, hashes[step], metrics))
    run.finish()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--examples", type=int, default=1_000_003, help="dataset size N (epochs = steps*16/N)")
    parser.add_argument("--plant", type=int, default=None, help="first repeated step (default: 60%% of the run)")
    args = parser.parse_args()
    plant = args.plant if args.plant is not None else max(1, int(args.steps * 0.6))
    n_examples = min(args.examples, max(B, args.steps * B // 2))  # small --steps still spans 2 epochs
    hashes = planted_hashes(args.steps, n_examples, plant)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        write_run(Path(tmp) / "run", hashes, n_examples)
        write_seconds = time.perf_counter() - t0
        t0 = time.perf_counter()
        report = audit(Path(tmp) / "run")
        seconds = time.perf_counter() - t0
        run = Run.open(Path(tmp) / "run")
        t0 = time.perf_counter()
        read = read_example_hashes(run)
        t1 = time.perf_counter()
        audit_hashes(read, 0, n_examples)
        t2 = time.perf_counter()
    assert np.array_equal(read, hashes)
    print(json.dumps({
        "bench": "audit", "steps": args.steps, "examples_per_step": B, "dataset_size": n_examples,
        "epochs": report.epochs, "seconds": round(seconds, 3), "read_seconds": round(t1 - t0, 3),
        "analyze_seconds": round(t2 - t1, 3), "write_seconds": round(write_seconds, 1),
        "planted_step": plant, "found_step": report.first_early_repeat_step,
        "early_repeat_steps": report.early_repeat_steps, "ok": report.ok,
    }))


if __name__ == "__main__":
    main()
