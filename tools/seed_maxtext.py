"""The seed's bug on MaxText itself (issue 33, part 3a): the scenario and its row of the seed table.

OLMo 3's decoder with MaxText's olmo_grain loader, trained to step 4 on one process with MaxText's
own checkpointing (a preemption: `python -m replay.maxtext RUN --stop-at 4`), then resumed from
MaxText's checkpoint on two processes and, as a control, on one; the recording continues the same
run each time. Sizes: 4 layers, 64 wide, vocabulary 256, 64-token windows; a numpy token file of
64 windows made here; global batch 4 (one process with two CPU devices, or two processes with one
each), 8 steps. Three MaxText launches (four processes), about three minutes on two cores.

Runs where MaxText is installed (the venv tools/maxtext-env.sh builds):

    $MT/bin/python tools/seed_maxtext.py DIR     # trains the runs into DIR, prints the MaxText row as JSON

tests/maxtext/test_maxtext_seed.py runs the same scenario and checks it; tools/seed_table.py puts this
row beside OLMo-core's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

STEPS, STOP, PERIOD, WINDOWS, SEQ, GLOBAL_BATCH = 8, 4, 3, 64, 64, 4
OLMO3 = ["hardware=cpu", "dataset_type=olmo_grain", "olmo_apply_ngram_filter=false", f"steps={STEPS}",
         "per_device_batch_size=2", f"max_target_length={SEQ}", "model_name=olmo3-7b", "override_model_config=true",
         "base_num_decoder_layers=4", "sliding_window_size=16", "base_emb_dim=64", "base_num_query_heads=4",
         "base_num_kv_heads=4", "base_mlp_dim=128", "head_dim=16", "vocab_size=256", "attention=dot_product",
         "dtype=float32", "enable_checkpointing=true", f"checkpoint_period={PERIOD}", "async_checkpointing=false",
         "run_name=mt"]
ENV = dict(os.environ, DECOUPLE_GCLOUD="TRUE", JAX_PLATFORMS="cpu")
ONE = dict(ENV, XLA_FLAGS="--xla_force_host_platform_device_count=2")  # the same global batch as two processes
TWO = [dict(ENV, JAX_COORDINATOR_ADDRESS="127.0.0.1", JOB_INDEX="0", JOB_COMPLETION_INDEX=str(i),
            PROCESSES_IN_JOB="2", JAX_PROCESS_COUNT="2") for i in range(2)]  # MaxText's CPU launch variables


def _config() -> Path:
    import maxtext

    return Path(maxtext.__file__).parent / "configs" / "base.yml"


def _tokens(root: Path) -> Path:
    from maxtext.input_pipeline.olmo_data import build_index

    tokens = root / "tokens.npy"
    np.save(tokens, np.random.default_rng(0).integers(1, 256, size=SEQ * WINDOWS, dtype=np.uint32))
    index = root / "index.json"
    build_index([(str(tokens), "tiny")], SEQ, tokenizer="none").save(str(index))
    return index


def _launch(run: Path, out: Path, index: Path, env: dict, *sets: str, stop: tuple = ()) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "replay.maxtext", str(run), *stop, str(_config()), *OLMO3, *sets,
                             f"olmo_index_path={index}", f"base_output_directory={out}"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _wait(procs: list) -> None:
    try:
        errs = [p.communicate(timeout=600)[1] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:  # one process failing leaves the other in jax.distributed's shutdown barrier
            p.kill()
        raise
    if any(p.returncode for p in procs):
        raise RuntimeError("a MaxText process failed: " + " | ".join(e[-3000:] for e in errs))


def _resumed_copy(root: Path, name: str) -> tuple[Path, Path]:
    """The run folder and MaxText's output (its checkpoints) as the stop left them, copied for one resume."""
    run, out = root / name, root / f"out-{name}"
    shutil.copytree(root / "first", run)
    shutil.copytree(root / "out-first", out)
    return run, out


def train(root: Path) -> dict[str, Path]:
    """The stopped run, its resumes on one process ("one") and on two ("two"), and MaxText's checkpoints."""
    index = _tokens(root)
    _wait([_launch(root / "first", root / "out-first", index, dict(ONE), "skip_jax_distributed_system=true",
                   stop=("--stop-at", str(STOP)))])
    one, out_one = _resumed_copy(root, "one")
    _wait([_launch(one, out_one, index, dict(ONE), "skip_jax_distributed_system=true")])
    two, out_two = _resumed_copy(root, "two")
    _wait([_launch(two, out_two, index, env) for env in TWO])
    return {"first": root / "first", "maxtext": root / "out-first" / "mt" / "checkpoints", "one": one, "two": two}


def cli(*args: str) -> dict:
    """`replay ARGS --json` in a fresh process: its JSON report (exit 0 or 1, anything else raises)."""
    done = subprocess.run([sys.executable, "-m", "replay.cli.app", *args, "--json"], env=ENV, capture_output=True,
                          text=True, timeout=600)
    if done.returncode not in (0, 1):
        raise RuntimeError(f"replay {' '.join(args)} exited {done.returncode}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def refed(audit: dict) -> list[dict]:
    """Each example the audit found fed again: its step, position in the batch, and the step it was first fed."""
    return [{"step": r["step"], "position": p, "first_fed": f["step"]}
            for r in audit["early_repeats"] for p, f in zip(r["positions"], r["first_seen"])]


def row(runs: dict[str, Path], bisect_report: dict | None = None) -> dict:
    """The seed table's MaxText row: what each resume fed again, and what bisect of the two said."""
    report = bisect_report or cli("bisect", str(runs["two"]), str(runs["one"]))
    two, one = refed(cli("audit", str(runs["two"]))), refed(cli("audit", str(runs["one"])))
    fed_after = (STEPS - STOP) * GLOBAL_BATCH
    return {"framework": "maxtext", "processes": "1->2", "steps": STEPS, "resumed_at": STOP,
            "refed_examples": len(two), "refed_share": round(len(two) / fed_after, 4), "refed": two,
            "control_1_to_1": {"refed_examples": len(one), "refed_share": round(len(one) / fed_after, 4)},
            "bisect": {"step": report["first_step"], "cause": report["cause"],
                       "examples_fed_before": sum(bool(e["seen_before"]) for e in report["examples"]
                                                  if e["run"] == "A")}}


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("error: name the folder to train the runs into: python tools/seed_maxtext.py DIR", file=sys.stderr)
        sys.exit(2)
    try:
        import maxtext  # noqa: F401
    except ImportError:
        print("error: MaxText is not installed in this Python: run this with the venv tools/maxtext-env.sh builds "
              "(~/.cache/replay/maxtext-venv-0.2.5/bin/python)", file=sys.stderr)
        sys.exit(2)
    out = Path(sys.argv[1])
    if out.exists() and any(out.iterdir()):
        print(f"error: {out} is not empty: name a new or empty folder for the runs", file=sys.stderr)
        sys.exit(2)
    out.mkdir(parents=True, exist_ok=True)
    print(json.dumps(row(train(out))))
