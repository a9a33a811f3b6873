"""The seed's bug on MaxText itself (issue 33, part 3a): OLMo 3 with MaxText's olmo_grain loader,
trained to step 4 on one process with MaxText's own checkpointing, resumed from MaxText's
checkpoint on two processes and, as a control, on one. The recording continues the same run.

Runs in the venv tools/maxtext-env.sh builds (skips elsewhere). Sizes: OLMo 3's decoder with 4
layers, 64 wide, vocabulary 256, 64-token windows; a numpy token file of 64 windows made here;
global batch 4 (one process with two CPU devices, or two processes with one each), 8 steps.
The seed table's MaxText row is printed as one JSON line and, where REPLAY_MAXTEXT_SEED names a
file, written there (tools/maxtext-env.sh puts it into its final JSON line).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

maxtext = pytest.importorskip("maxtext", reason="MaxText is not installed here: run tools/maxtext-env.sh "
                              "(a Python 3.12 venv with maxtext[tpu]==0.2.5)")

pytestmark = pytest.mark.slow
STEPS, STOP, PERIOD, WINDOWS, SEQ = 8, 4, 3, 64, 64
CONFIG = Path(maxtext.__file__).parent / "configs" / "base.yml"
OLMO3 = ["hardware=cpu", "dataset_type=olmo_grain", "olmo_apply_ngram_filter=false", f"steps={STEPS}",
         "per_device_batch_size=2", f"max_target_length={SEQ}", "model_name=olmo3-7b", "override_model_config=true",
         "base_num_decoder_layers=4", "sliding_window_size=16", "base_emb_dim=64", "base_num_query_heads=4",
         "base_num_kv_heads=4", "base_mlp_dim=128", "head_dim=16", "vocab_size=256", "attention=dot_product",
         "dtype=float32", "enable_checkpointing=true", f"checkpoint_period={PERIOD}", "async_checkpointing=false",
         "run_name=mt"]
ENV = dict(os.environ, DECOUPLE_GCLOUD="TRUE", JAX_PLATFORMS="cpu")
ONE = dict(ENV, XLA_FLAGS="--xla_force_host_platform_device_count=2")  # the same global batch as two processes


def _tokens(root: Path) -> Path:
    from maxtext.input_pipeline.olmo_data import build_index

    tokens = root / "tokens.npy"
    np.save(tokens, np.random.default_rng(0).integers(1, 256, size=SEQ * WINDOWS, dtype=np.uint32))
    index = root / "index.json"
    build_index([(str(tokens), "tiny")], SEQ, tokenizer="none").save(str(index))
    return index


def _launch(run: Path, out: Path, index: Path, env: dict, *sets: str, stop: tuple = ()) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "replay.maxtext", str(run), *stop, str(CONFIG), *OLMO3, *sets,
                             f"olmo_index_path={index}", f"base_output_directory={out}"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _wait(procs: list) -> None:
    try:
        errs = [p.communicate(timeout=600)[1] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:  # one process failing leaves the other in jax.distributed's shutdown barrier
            p.kill()
        raise
    assert [p.returncode for p in procs] == [0] * len(procs), [e[-3000:] for e in errs]


def _resumed_copy(root: Path, name: str) -> tuple[Path, Path]:
    """The run folder and MaxText's output (its checkpoints) as the stop left them, copied for one resume."""
    run, out = root / name, root / f"out-{name}"
    shutil.copytree(root / "first", run)
    shutil.copytree(root / "out-first", out)
    return run, out


@pytest.fixture(scope="module")
def seed(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("seed")
    index = _tokens(root)
    _wait([_launch(root / "first", root / "out-first", index, dict(ONE), "skip_jax_distributed_system=true",
                   stop=("--stop-at", str(STOP)))])
    one, out_one = _resumed_copy(root, "one")
    _wait([_launch(one, out_one, index, dict(ONE), "skip_jax_distributed_system=true")])
    two, out_two = _resumed_copy(root, "two")
    _wait([_launch(two, out_two, index, dict(ENV, JAX_COORDINATOR_ADDRESS="127.0.0.1", JOB_INDEX="0",
                                             JOB_COMPLETION_INDEX=str(i), PROCESSES_IN_JOB="2", JAX_PROCESS_COUNT="2"))
           for i in range(2)])
    return {"first": root / "first", "maxtext": root / "out-first" / "mt" / "checkpoints", "one": one, "two": two}


def _cli(*args: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "replay.cli.app", *args, "--json"], env=ENV, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode in (0, 1), done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_recording_resumes_the_same_run_from_maxtexts_own_checkpoint(seed):
    # MaxText's checkpoint s holds the state after step s (its optimizer count s + 1, where its loop
    # restarts); replay's checkpoint k the state entering step k. The stop before step 4 leaves MaxText's
    # checkpoints 0 and 3, the run steps 0-3; the resumes continue it at 4, the trace end.
    assert sorted(int(p.name) for p in seed["maxtext"].iterdir()) == [0, PERIOD]
    first = _cli("show", str(seed["first"]))
    assert first["steps"]["end"] == STOP, first["steps"]
    for name, processes in (("one", None), ("two", 2)):
        shown = _cli("show", str(seed[name]))
        assert shown["status"] == "complete" and shown["steps"] == {"start": 0, "end": STEPS, "last": STEPS - 1,
                                                                    "count": STEPS}, shown["steps"]
        assert shown["schema"]["examples_per_step"] == 4, shown["schema"]
        manifest = json.loads((seed[name] / "run.json").read_text())
        resumed = manifest.get("resumed_programs")
        # two processes compile another program (their mesh spans two hosts): kept, and said where it starts
        assert ([(r["step"], r["process_count"]) for r in resumed] if resumed else None) == (
            [(STOP, 2)] if processes else None), resumed
        # the one-process run stored its examples; no process of two holds a whole batch: the store ends at 4
        assert manifest["example_store"].get("until_step") == (STOP if processes else None), manifest["example_store"]


def _refed(audit: dict) -> list[dict]:
    return [{"step": r["step"], "position": p, "first_fed": f["step"]}
            for r in audit["early_repeats"] for p, f in zip(r["positions"], r["first_seen"])]


def test_audit_flags_the_examples_refed_after_the_resume_on_two_processes(seed):
    audit = _cli("audit", str(seed["two"]))
    refed = _refed(audit)
    assert audit["ok"] is False and audit["dataset_size"] == WINDOWS, audit  # the olmo index's instances
    assert refed and all(r["step"] >= STOP and r["first_fed"] < STOP for r in refed), refed
    # process 0 holds the first half of each global batch and re-reads the start of the epoch's shuffle
    assert {r["position"] for r in refed} <= {0, 1}, refed


def test_bisect_of_the_two_resumes_names_the_resume_step_data_and_the_refed_examples(seed):
    report = _cli("bisect", str(seed["two"]), str(seed["one"]))
    assert (report["identical"], report["first_step"], report["cause"]) == (False, STOP, "data"), report
    two = [e for e in report["examples"] if e["run"] == "A" and e["seen_before"]]
    assert two and all(s["step"] < STOP for e in two for s in e["seen_before"]), report["examples"]
    _seed_row(seed, report)


def _seed_row(seed: dict, report: dict) -> None:
    """The seed table's MaxText row: what the two resumes fed again, and what bisect said."""
    two, one = _cli("audit", str(seed["two"])), _cli("audit", str(seed["one"]))
    fed_after = (STEPS - STOP) * 4
    row = {"framework": "maxtext", "processes": "1->2", "steps": STEPS, "resumed_at": STOP,
           "refed_examples": len(_refed(two)), "refed_share": round(len(_refed(two)) / fed_after, 4),
           "refed": _refed(two), "control_1_to_1": {"refed_examples": len(_refed(one)),
                                                    "refed_share": round(len(_refed(one)) / fed_after, 4)},
           "bisect": {"step": report["first_step"], "cause": report["cause"],
                      "examples_fed_before": sum(bool(e["seen_before"]) for e in report["examples"] if e["run"] == "A")}}
    print(json.dumps(row))
    if os.environ.get("REPLAY_MAXTEXT_SEED"):
        Path(os.environ["REPLAY_MAXTEXT_SEED"]).write_text(json.dumps(row))
