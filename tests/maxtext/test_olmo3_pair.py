"""MaxText's OLMo 3 against OLMo-core's OLMo 3 (issue 33, part 3c), through tools/olmo3_pair.py.

One tiny config (OLMo-core's olmo3_1M: 4 layers, 12 wide, vocabulary 512, windows [8, 8, 8, full]),
OLMo-core's initial weights converted through the HF layout by MaxText's own converter, the same 16-token
rows in the same order (OLMo-core reads MaxText's olmo_grain order unshuffled), the clean pair 64 steps (the
first epoch) and the runs with a port difference 4, each side
recorded by its own integration (replay.maxtext, ReplayCallback). Both frameworks are needed and they
live in two venvs: these tests run in the MaxText venv (tools/maxtext-env.sh) and run the OLMo-core
side with the interpreter REPLAY_OLMO_CORE_PYTHON names (default: the first `python3`/`python` on PATH
that imports torch and olmo_core); they skip where either is missing.

Both sides record every op-level output of the model with distance sketches: MaxText's through its
forward taps named as OLMo-core's modules (replay/maxtext/forward_taps.py, olmo_core_names.py), OLMo-core's
as each leaf module's output (its rotary through two identity taps, tools/olmo3_pair.py rope_taps), so
`replay bisect` compares 59 tensors a step from the traces alone and the first one above the noise floor
names the step, the layer (blocks.I) and the op inside it.

The floor is the pair's own (replay/bisect/cross_floor.py OLMO3_PAIR, chosen because one run is MaxText's
and the other OLMo-core's), measured by bench/cross_noise_pair.py on five other data seeds: this pair's
clean runs part much faster than the trainer pair the default table was measured on (constant LR 1e-3,
12 wide, random tokens), so under that table this clean pair is a false alarm from step 1 (a test below).
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

pytest.importorskip("maxtext", reason="MaxText is not installed here: run tools/maxtext-env.sh "
                    "(a Python 3.12 venv with maxtext[tpu]==0.2.5)")

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
TOOL = str(REPO / "tools" / "olmo3_pair.py")
# replay from this checkout in every subprocess: the OLMo-core side's interpreter may have torch and
# olmo_core without replay installed (or with another checkout's).
ENV = dict(os.environ, DECOUPLE_GCLOUD="TRUE", JAX_PLATFORMS="cpu",
           PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
STEPS, BUG_STEPS = 64, 4
MARGIN = 0.2  # the pair's largest distance / its floor, measured: 0.099 (the loss at step 0)


def _olmo_core_python() -> str | None:
    named = os.environ.get("REPLAY_OLMO_CORE_PYTHON")
    candidates = [named] if named else [shutil.which("python3"), shutil.which("python")]
    for exe in filter(None, candidates):
        if subprocess.run([exe, "-c", "import torch, olmo_core, replay.torch.olmo_core"], env=ENV,
                          capture_output=True).returncode == 0:
            return exe
    return None


def _done(procs: list[subprocess.Popen]) -> None:
    outs = [p.communicate(timeout=900) for p in procs]
    assert [p.returncode for p in procs] == [0] * len(procs), [err[-3000:] for _, err in outs]


def _start(exe: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([exe, TOOL, *args], cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Path:
    torch_py = _olmo_core_python()
    if torch_py is None:
        pytest.skip("no interpreter with torch and olmo_core: set REPLAY_OLMO_CORE_PYTHON (e.g. the default venv's)")
    root = tmp_path_factory.mktemp("olmo3_pair")
    _done([_start(torch_py, "prepare", str(root))])
    _done([_start(sys.executable, "convert", str(root))])
    # The MaxText runs and the OLMo-core runs side by side (each mostly one core).
    # The clean pair runs the whole first epoch; a port difference shows at step 0 or 1, so those runs
    # stop at BUG_STEPS (a bisect compares the steps both runs hold).
    mt = [_start(sys.executable, "maxtext", str(root), "mt_clean", f"--steps={STEPS}"),
          _start(sys.executable, "maxtext", str(root), "mt_rope", f"--steps={BUG_STEPS}", "rope_max_timescale=10000")]
    _done([_start(torch_py, "olmo-core", str(root), "oc_clean", f"--steps={STEPS}"),
           _start(torch_py, "olmo-core", str(root), "oc_adam", f"--steps={BUG_STEPS}", "--keep-adam-count")])
    _done([_start(torch_py, "olmo-core", str(root), "oc_qk_eps", f"--steps={BUG_STEPS}", "--qk-norm-eps=1e-5"),
           _start(torch_py, "olmo-core", str(root), "oc_no_rope_taps", f"--steps={BUG_STEPS}", "--no-rope-taps")])
    # Rounding-level twins of two OLMo-core runs (one ULP on each parameter's first element): `--floor twin:PATH`
    _done([_start(torch_py, "olmo-core", str(root), "oc_twin", f"--steps={STEPS}", "--twin"),
           _start(torch_py, "olmo-core", str(root), "oc_adam_twin", f"--steps={BUG_STEPS}", "--keep-adam-count", "--twin")])
    _done(mt)
    return root


def _bisect(root: Path, a: str, b: str, *extra: str) -> tuple[int, dict]:
    done = subprocess.run([sys.executable, "-m", "replay.cli.app", "bisect", str(root / a), str(root / b),
                           "--json", *extra], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.stdout.strip(), done.stderr[-2000:]
    return done.returncode, json.loads(done.stdout.strip().splitlines()[-1])


def test_the_same_weights_and_rows_give_the_same_step_0_loss_within_a_few_ulps(pair):
    from traces import Run

    mt, oc = Run.open(pair / "mt_clean"), Run.open(pair / "oc_clean")
    assert (mt.trace.end, oc.trace.end) == (STEPS, STEPS)  # the whole first epoch
    loss = [np.float32(r.trace.read(0).metrics_dict(r.schema)["loss"]) for r in (mt, oc)]
    # 0-3 float32 ULPs apart over six data seeds (bench/cross_noise_pair.py's pairs; this one 3): one reduction
    # order against another. A port difference moves it by far more (the RoPE-theta run: see below).
    assert abs(int(loss[0].view(np.int32)) - int(loss[1].view(np.int32))) <= 4, loss
    for k in range(STEPS):  # MaxText's batch and OLMo-core's rows hash alike, example by example
        assert np.array_equal(mt.trace.read(k).example_hashes, oc.trace.read(k).example_hashes), k


# Each layer's ops in forward order, as both runs record them (OLMo-core's module paths).
OPS = ["attention.w_q", "attention.w_k", "attention.w_v", "attention.q_norm", "attention.k_norm", "attention.rope.q",
       "attention.rope.k", "attention.backend", "attention.w_out", "attention_norm", "feed_forward.w1",
       "feed_forward.w3", "feed_forward.w2", "feed_forward_norm"]
COMPARED = ["embeddings", *(f"blocks.{i}.{op}" for i in range(4) for op in OPS), "lm_head.norm", "lm_head.w_out", "loss"]


def test_the_clean_pair_is_within_the_noise_floor_at_every_step(pair):
    code, report = _bisect(pair, "mt_clean", "oc_clean")
    assert code == 0 and report["within_noise"], report
    assert report["inputs"]["data"]["equal"] and report["steps"] == [0, STEPS] and report["source"] == "traces"
    assert report["names"] == COMPARED, report["names"]  # every op of every layer, from the traces' sketches
    assert len(report["examined"]) == STEPS and report["max_ratio_within"] < MARGIN, report
    assert all(set(d) == set(COMPARED) for d in report["distances"].values()), report["distances"]
    assert report["floor_table"]["name"] == "olmo3-pair", report["floor_table"]  # chosen by the runs' frameworks


def test_the_trainer_pairs_floor_would_call_the_clean_pair_different(pair):
    # Why the pair has its own table: the same 64 steps judged by the trainer vs transformers' envelope are a
    # false alarm (this pair's rounding grows faster), at a forward op after step 0 (measured: step 1,
    # blocks.1.attention.w_q, 8.4 x).
    code, report = _bisect(pair, "mt_clean", "oc_clean", "--floor", "trainer")
    assert code == 1 and report["floor_table"]["name"] == "trainer", report
    assert report["cause"] == "forward" and report["first_step"] >= 1 and report["ratio"] > 1, report


def test_rope_theta_left_at_maxtexts_default_is_named_at_step_0_block_0_rotary(pair):
    # rope_max_timescale 10000 (MaxText's base.yml) instead of OLMo 3's 500000: a port difference. The
    # projections and QK-norm before it stay within the floor; the rotary of the queries is the first op above.
    code, report = _bisect(pair, "mt_rope", "oc_clean")
    assert code == 1 and report["inputs"]["data"]["equal"], report
    assert (report["first_step"], report["cause"], report["first_layer"]) == (0, "forward", "blocks.0.attention.rope.q")
    assert report["ratio"] > 1000, report  # measured: 7.9e3 x (the floor at step 0: 7.2e-6)
    assert report["floor"]["blocks.0.attention.k_norm"] >= report["distances"]["0"]["blocks.0.attention.k_norm"]


def test_a_qk_norm_epsilon_set_on_the_olmo_core_side_is_named_at_step_0_block_0_qk_norm(pair):
    # OLMo-core's qk_norm eps 1e-5 (its config) against MaxText's 1e-6: the q projection is within the floor
    code, report = _bisect(pair, "mt_clean", "oc_qk_eps")
    assert code == 1 and report["inputs"]["data"]["equal"], report
    assert (report["first_step"], report["cause"], report["first_layer"]) == (0, "forward", "blocks.0.attention.q_norm")
    assert report["ratio"] > 1000, report  # measured: 8.0e4 x


def test_without_the_rotary_recorded_the_op_is_not_named(pair):
    # Negative control: the OLMo-core run recorded without its rotary taps, the same RoPE difference is
    # first seen after the rotary (the attention's output), which is why the taps exist.
    code, report = _bisect(pair, "mt_rope", "oc_no_rope_taps")
    assert code == 1 and (report["first_step"], report["first_layer"]) == (0, "blocks.0.attention.backend"), report
    assert not any(".rope." in n for n in report["names"]), report["names"]


def test_olmo_cores_first_adamw_step_is_within_the_pairs_floor_and_found_under_the_trainers(pair):
    # Without the tool's reset OLMo-core's Trainer starts AdamW at count 1 (its state materialized by a
    # zero-gradient step): the first update is 0.735 x optax's. Parameters are not compared across the two
    # (no parameter name map yet), so it shows at step 1, in the first op that reads an updated weight:
    # embeddings, 6.6e-3 relative. The pair's own floor is wide from step 1 on (0.23 at step 1: clean pairs of
    # it part that fast, replay/bisect/cross_floor.py), so it is within it: a known limit, shown here.
    code, report = _bisect(pair, "mt_clean", "oc_adam")
    assert code == 0 and report["floor_table"]["name"] == "olmo3-pair", report
    assert report["steps"] == [0, BUG_STEPS] and report["distances"]["1"]["embeddings"] > 1e-3, report
    # The trainer pair's tighter table names it, 807 x (the clean pair's own step 1 is 8.4 x that table, in
    # blocks.1.attention.w_q: after the embeddings in causal order).
    code, report = _bisect(pair, "mt_clean", "oc_adam", "--floor", "trainer")
    assert code == 1 and (report["first_step"], report["cause"], report["first_layer"]) == (1, "forward", "embeddings")
    assert report["ratio"] > 100, report  # measured: 807 x


def test_a_twin_of_the_olmo_core_side_is_a_floor_that_passes_the_clean_pair_and_names_the_adamw_step(pair):
    # --floor twin:PATH (replay/bisect/twin_floor.py): the OLMo-core run again, one ULP on the first element of
    # every parameter; 10 x its distance to its side, per step and kind, is the floor (never under the table's
    # step 0). The clean pair stays within it for 64 steps (measured: 0.20 x at most, the loss at step 61).
    twin = str(pair / "oc_twin")
    code, report = _bisect(pair, "mt_clean", "oc_clean", "--floor", f"twin:{twin}")
    assert code == 0 and report["within_noise"] and report["max_ratio_within"] < 0.5, report
    assert report["floor_table"]["name"] == f"twin:{twin}" and report["steps"] == [0, STEPS]
    # The AdamW counter run against its own twin: named at step 1 in the embeddings, where olmo3-pair's table
    # lets it pass (the test above). Measured 8.9 x, not more: the twin itself is 7.4e-5 off its side at step 1
    # (AdamW's first update is about +-lr an element, and rounding flips the sign where a gradient is near 0).
    code, report = _bisect(pair, "mt_clean", "oc_adam", "--floor", f"twin:{pair / 'oc_adam_twin'}")
    assert code == 1 and (report["first_step"], report["cause"], report["first_layer"]) == (1, "forward", "embeddings")
    assert report["ratio"] > 3, report
