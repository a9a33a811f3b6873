"""Is the compiled train step the same program as at an earlier commit? (no timing noise at all)

    python -m bench.step_hlo [--against c1ae22a^] [--preset demo] [--levels off,layer] [--set KEY=VALUE ...]

Extracts trainer/, replay/ and traces/ of the commit `--against` with `git archive`
(read-only) into a temporary directory and, in one child process per side, compiles the jitted train step
(trainer.step.compile_step, no mesh) of `--preset` at each level from abstract shapes, then
compares XLA:CPU's optimized HLO text with the metadata stripped (op names, source files and
lines, stack frames: they name the Python that built an op, not what it computes). The same
text is the same program, so the same speed: a stronger answer than a benchmark to "did this
change make the default path slower?". Each side imports its own three packages, so a commit
that moves modules between them (a re-layout) is compared whole; a commit whose trainer lacks
compile_step(cfg, level) fails to import, which is reported as an error.

Default: c1ae22a^, the commit before the session-4 model change (fused attention option,
remat, scan, sliding window), against the working tree with model.attention=explicit (the
default): `identical` true for tiny and demo at levels off and layer (measured 2026-12-01).
Since b8da212 the default path is another program on purpose (tree_sum's backward a broadcast,
dropout masks drawn flat: about 25% less compile time, the same bits in mesh-invariant mode), so
against c1ae22a^ it now reports false; `--against b8da212` is the baseline for later changes.

Prints one JSON object on the last line: per level, the two texts' SHA-256 and whether they
are equal, and `identical` (the budget: true). Cost: two compiles per level and side (about
10-40 s each on 2 cores); nothing depends on a run's length.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_CHILD = r"""
import hashlib, json, re, sys
import jax, jax.numpy as jnp
from trainer.config import apply_overrides
try:  # a commit before the presets had their own module
    from trainer.config import get_preset
except ImportError:
    from trainer.presets import get_preset
from trainer.step import compile_step, init_state
preset, levels, sets, out = sys.argv[1], sys.argv[2].split(","), json.loads(sys.argv[3]), sys.argv[4]
cfg = apply_overrides(get_preset(preset), sets)
shape = (cfg.data.global_batch_size, cfg.model.seq_len)
batch = {k: jax.ShapeDtypeStruct(shape, jnp.int32) for k in ("inputs", "targets")}
state = jax.eval_shape(lambda: init_state(cfg))
for level in levels:
    open(f"{out}/{level}.hlo", "w").write(compile_step(cfg, level).lower(state, batch).compile().as_text())
"""


def strip(hlo: str) -> str:
    """The HLO's computations without what names the Python behind them: metadata={...}, stack
    frame ids, the module name and the header tables (file names, functions, frames)."""
    hlo = re.sub(r", metadata=\{[^}]*\}", "", hlo)
    hlo = re.sub(r", stack_frame_id=\d+", "", hlo)
    start = hlo.find("\n\n%")  # the first computation: the tables before it list source files
    return hlo[start + 1:] if start >= 0 else re.sub(r"^HloModule \S+", "HloModule X", hlo)


def _compile(root: Path, args: argparse.Namespace, out: Path) -> str | None:
    """Compile in a child whose packages are root's; None on success, else its last error line."""
    env = dict(os.environ, PYTHONPATH=str(root), JAX_PLATFORMS="cpu")  # its own packages only
    done = subprocess.run([sys.executable, "-c", _CHILD, args.preset, args.levels, json.dumps(args.set or []),
                           str(out)], cwd=root, env=env, capture_output=True, text=True)
    return None if done.returncode == 0 else (done.stderr.strip().splitlines() or ["failed"])[-1]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", default="c1ae22a^", help="the earlier commit (any git revision)")
    ap.add_argument("--preset", default="demo")
    ap.add_argument("--levels", default="off,layer")
    ap.add_argument("--set", action="append", help="config override for the current side (repeatable)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="replay-bench-step-hlo-") as tmp:
        old_root, new_out, old_out = Path(tmp, "old"), Path(tmp, "new-hlo"), Path(tmp, "old-hlo")
        for d in (old_root, new_out, old_out):
            d.mkdir()
        archive = subprocess.run(["git", "archive", args.against, "trainer", "replay", "traces"],
                                 cwd=ROOT, capture_output=True)
        if archive.returncode:
            print(f"error: git archive {args.against}: {archive.stderr.decode().strip()}", file=sys.stderr)
            raise SystemExit(2)
        subprocess.run(["tar", "-x", "-C", str(old_root)], input=archive.stdout, check=True)
        new_args = argparse.Namespace(**{**vars(args)})
        old_args = argparse.Namespace(**{**vars(args), "set": []})  # the old config may lack the new keys
        errors = {"current": _compile(ROOT, new_args, new_out), args.against: _compile(old_root, old_args, old_out)}
        levels = {}
        if not any(errors.values()):
            for level in args.levels.split(","):
                new, old = (strip((d / f"{level}.hlo").read_text()) for d in (new_out, old_out))
                levels[level] = {"sha256_current": hashlib.sha256(new.encode()).hexdigest()[:16],
                                 "sha256_against": hashlib.sha256(old.encode()).hexdigest()[:16],
                                 "chars": len(new), "identical": new == old}
    print(json.dumps({"bench": "step_hlo", "against": args.against, "preset": args.preset, "overrides": args.set or [],
                      "levels": levels, "errors": {k: v for k, v in errors.items() if v},
                      "identical": bool(levels) and all(v["identical"] for v in levels.values()),
                      "budget": {"identical": True}}))


if __name__ == "__main__":
    main()
