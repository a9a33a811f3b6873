"""Does the trainer record the same bits as at an earlier commit? Traces, checkpoints, program.

    python -m bench.trainer_bits [--against REV] [--cases tiny,tiny-layer,demo]

The guard for a change that must not change what the trainer computes or writes (a re-layout,
the trainer recording through another module): `git archive` extracts trainer/, replay/ and
traces/ of `--against` (read-only) into a temporary folder, and each side trains every case in
a child process whose packages are its own (`replay train`, CPU, one device). Then, per case:
every trace record compared bit for bit (traces.same_bits over the decoded records, schemas
equal), the manifests' program_hash and checkpoint_fingerprints equal, and every checkpoint
read back from disk (orbax, no target: as saved) leaf by leaf, path, dtype, shape and bytes.
The files themselves cannot be compared by name: OCDBT names its data files at random. A control trains the first case once more on the current side with the
learning rate moved by 1% and must differ from the earlier side in its records and checkpoint
fingerprints: the comparison can fail.

Prints one JSON object last: per case the findings, `identical` (the budget: true) and the
control's `differs` (the budget: true). Cost: two trainings per case and side plus the control
(tiny ~10-30 s each on 2 cores, demo ~30-60 s); nothing else.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = {
    "tiny": ["--preset", "tiny", "--steps", "20", "--set", "checkpoint.every_steps=10"],
    "tiny-layer": ["--preset", "tiny", "--steps", "12", "--set", "checkpoint.every_steps=6", "--set",
                   "trace.level=layer"],
    "demo": ["--preset", "demo", "--steps", "12", "--set", "checkpoint.every_steps=6"],
}
CONTROL = ["--set", "optimizer.lr=0.00101"]  # tiny's default lr 1e-3, moved by 1%
_CHILD = "import sys; from replay.cli.app import main; sys.argv = ['replay'] + sys.argv[1:]; main()"


def _train(root: Path, out: Path, args: list[str]) -> str | None:
    env = dict(os.environ, PYTHONPATH=str(root), JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    done = subprocess.run([sys.executable, "-c", _CHILD, "train", "--out", str(out), *args], cwd=root, env=env,
                          capture_output=True, text=True)
    return None if done.returncode == 0 else (done.stderr.strip().splitlines() or ["failed"])[-1]


def _records(path: Path):
    from traces import Run

    run = Run.open(path)
    return run, [run.trace.read(k) for k in range(run.trace.start, run.trace.end)]


def _saved(path: Path, step: int) -> dict[str, tuple]:
    """{leaf path: (dtype, shape, bytes)} of checkpoint `step` as stored."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    item = path / "checkpoints" / str(step)
    item = item / ("state" if (item / "state").is_dir() else "default")
    tree = ocp.StandardCheckpointer().restore(item.absolute())
    out = {}
    for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        x = np.asarray(leaf)
        out[jax.tree_util.keystr(p)] = (str(x.dtype), x.shape, x.tobytes())
    return out


def compare(a_path: Path, b_path: Path) -> dict:
    from traces import same_bits

    a, ra = _records(a_path)
    b, rb = _records(b_path)
    records = (a.manifest["schema"] == b.manifest["schema"] and len(ra) == len(rb)
               and all(same_bits(a.schema, x, y) for x, y in zip(ra, rb)))
    fps = a.manifest.get("checkpoint_fingerprints")
    steps = sorted(int(k) for k in fps or {})
    differing, leaves = [], 0
    for step in steps:
        sa, sb = _saved(a_path, step), _saved(b_path, step)
        leaves += len(sa)
        differing += [f"{step}:{k}" for k in sorted(set(sa) | set(sb)) if sa.get(k) != sb.get(k)]
    out = {"steps": len(ra), "records_bit_identical": records,
           "program_hash_equal": a.manifest.get("program_hash") == b.manifest.get("program_hash"),
           "checkpoints": steps,
           "checkpoint_fingerprints_equal": bool(fps) and fps == b.manifest.get("checkpoint_fingerprints"),
           "checkpoint_leaves_compared": leaves, "checkpoint_leaves_differing": differing[:10]}
    out["identical"] = records and out["program_hash_equal"] and out["checkpoint_fingerprints_equal"] and not differing
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", default="HEAD", help="the earlier commit (any git revision)")
    ap.add_argument("--cases", default=",".join(CASES))
    args = ap.parse_args(argv)
    cases = args.cases.split(",")
    with tempfile.TemporaryDirectory(prefix="replay-bench-trainer-bits-") as tmp:
        old_root, runs = Path(tmp, "old"), Path(tmp, "runs")
        old_root.mkdir()
        archive = subprocess.run(["git", "archive", args.against, "trainer", "replay", "traces"], cwd=ROOT,
                                 capture_output=True)
        if archive.returncode:
            print(f"error: git archive {args.against}: {archive.stderr.decode().strip()}", file=sys.stderr)
            raise SystemExit(2)
        subprocess.run(["tar", "-x", "-C", str(old_root)], input=archive.stdout, check=True)
        errors, results = {}, {}
        for case in cases:
            for side, root in (("against", old_root), ("current", ROOT)):
                err = _train(root, runs / f"{case}-{side}", CASES[case])
                if err:
                    errors[f"{case} ({side})"] = err
            if not any(k.startswith(case + " ") for k in errors):
                results[case] = compare(runs / f"{case}-against", runs / f"{case}-current")
        control = {}
        first = cases[0]
        err = _train(ROOT, runs / "control", CASES[first] + CONTROL)
        if err or first not in results:
            errors["control"] = err or "its case failed"
        else:
            c = compare(runs / f"{first}-against", runs / "control")
            control = {"case": first, "change": CONTROL[1], "records_bit_identical": c["records_bit_identical"],
                       "checkpoint_fingerprints_equal": c["checkpoint_fingerprints_equal"],
                       "checkpoint_leaves_differing": len(c["checkpoint_leaves_differing"]),
                       "differs": not c["records_bit_identical"] and not c["checkpoint_fingerprints_equal"]
                       and bool(c["checkpoint_leaves_differing"])}
    print(json.dumps({"bench": "trainer_bits", "against": args.against, "cases": results, "control": control,
                      "errors": errors, "identical": bool(results) and not errors
                      and all(r["identical"] for r in results.values()),
                      "budget": {"identical": True, "control_differs": True}}))


if __name__ == "__main__":
    main()
