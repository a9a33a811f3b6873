"""`replay plan`: compile the train step for N virtual devices from abstract shapes."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from trainer.cli import plan as plan_cli
from replay.cli.app import app
from trainer.presets import get_preset
from trainer.model import flops_per_token, param_count
from trainer.config import apply_overrides
from trainer.plan import option_overrides, plan_env


def invoke(*args: str):
    return CliRunner().invoke(app, list(args), env={"REPLAY_DEBUG": None})


def assert_one_line_error(result, code: int, *words: str) -> str:
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert all(w in lines[-1] for w in words), lines[-1]
    return lines[-1]


def test_plan_env_sets_device_count_and_keeps_other_flags():
    env = plan_env(16, {"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false --xla_force_host_platform_device_count=2",
                        "PATH": "/bin"})
    assert env["XLA_FLAGS"].split() == ["--xla_cpu_multi_thread_eigen=false",
                                        "--xla_force_host_platform_device_count=16"]
    assert env["JAX_PLATFORMS"] == "cpu" and env["PATH"] == "/bin"
    assert plan_env(4, {})["XLA_FLAGS"] == "--xla_force_host_platform_device_count=4"


@pytest.fixture(scope="module")
def tiny_plan():
    """`replay plan --preset tiny --devices 4 --device-kind h100 --json` (mesh 2 x 2), run once:
    (result, report)."""
    result = invoke("plan", "--preset", "tiny", "--devices", "4", "--set", "mesh.data=2", "--set", "mesh.fsdp=2",
                    "--device-kind", "h100", "--json")
    assert result.exit_code == 0, result.stderr
    return result, json.loads(result.stdout)


@pytest.mark.slow
def test_plan_tiny_on_4_devices_json(tiny_plan):
    result, r = tiny_plan
    cfg = get_preset("tiny")
    assert r["preset"] == "tiny" and r["devices"] == 4 and r["backend"] == "cpu"
    assert r["mesh"] == {"data": 2, "fsdp": 2} and r["trace_level"] == "step"
    assert r["params"] == param_count(cfg)
    b = r["bytes"]
    assert b["params_total"] == 4 * param_count(cfg)  # float32
    # fsdp=2 halves every tiny parameter (each has an even axis), moments likewise (+ scalars)
    assert b["params_per_device"] * 2 == b["params_total"]
    assert b["optimizer_total"] // 2 <= b["optimizer_per_device"] < b["optimizer_total"] // 2 + 1024
    assert r["tokens_per_step"] == cfg.data.global_batch_size * cfg.model.seq_len
    assert r["flops_per_step"] == flops_per_token(cfg) * r["tokens_per_step"]
    mem = r["memory_per_device"]
    # the donated state comes back in place; the arguments hold at least this device's state
    assert mem["argument"] >= b["params_per_device"] + b["optimizer_per_device"]
    assert mem["alias"] > 0 and mem["temp"] > 0
    assert mem["total"] == mem["argument"] + mem["output"] - mem["alias"] + mem["temp"]
    assert mem["total"] < 64 * 2**20  # a 140k-parameter model: sensible, not absurd
    assert r["seconds"]["compile"] > 0
    assert "compiled in" in result.stderr  # progress relayed from the child
    # XLA's count for the program, for all 4 devices: the same order as the model's 6N + attention
    assert r["xla_flops_per_step"] == 4 * r["xla_flops_per_device"]
    assert 0.3 < r["xla_flops_per_step"] / r["flops_per_step"] < 3, (r["xla_flops_per_step"], r["flops_per_step"])
    d = r["donation"]  # read from the compiled HLO (tests/trainer/test_donation.py: the check can fail)
    assert d["in_place"] and d["aliased_leaves"] == d["donated_leaves"] > 0
    assert d["donated_bytes"] == mem["alias"]  # every donated byte comes back in place, per device
    assert r["fit"] == {"device_kind": "h100", "hbm_bytes": 80 * 10**9, "total_per_device": mem["total"],
                        "fits": True, "share": round(mem["total"] / (80 * 10**9), 4)}
    assert r["model"]["d_model"] == cfg.model.d_model and r["mesh_invariant"] is None
    assert r["gradient_state_per_device"] is None  # mesh-invariant mode only


@pytest.mark.slow
def test_plan_table_output(tiny_plan, capsys):
    _, report = tiny_plan
    plan_cli.render(report)  # what `replay plan` prints without --json
    out = capsys.readouterr().out
    for words in ("tiny", "4 (virtual cpu devices; mesh data=2 x fsdp=2)", "memory: temporaries",
                  "params per device", "FLOPs per step", "XLA FLOPs per step", "compile",
                  "written in place (no copy)", "fits h100 (80 GB HBM)"):
        assert words in out, out


def test_unknown_preset_exit_2_one_line():
    line = assert_one_line_error(invoke("plan", "--preset", "olmo-99b", "--devices", "4"), 2, "olmo-99b", "tiny")
    assert "valid presets" in line


def test_unknown_override_exit_2_one_line():
    assert_one_line_error(invoke("plan", "--preset", "tiny", "--devices", "4", "--set", "model.width=3"), 2,
                          "model.width")


def test_fit_against_device_memory():
    from trainer.plan import DEVICE_HBM, fit

    assert DEVICE_HBM == {"tpu-v5p": 95e9, "tpu-v6e": 32e9, "h100": 80e9, "h200": 141e9}
    assert fit(95 * 10**9, "tpu-v5p")["fits"] and not fit(95 * 10**9 + 1, "tpu-v5p")["fits"]
    assert fit(None, "h200")["fits"] is None


@pytest.mark.slow
def test_table_says_when_the_state_is_copied_or_does_not_fit(tiny_plan, capsys):
    _, report = tiny_plan
    bad = {**report, "donation": {**report["donation"], "in_place": False, "copied_bytes": 2**20},
           "fit": {**report["fit"], "fits": False, "share": 1.5}}
    plan_cli.render(bad)
    out = capsys.readouterr().out
    assert "NOT in place" in out and "does NOT fit h100" in out and "written in place" not in out


def test_unknown_device_kind_or_level_exit_2_one_line():
    assert_one_line_error(invoke("plan", "--preset", "tiny", "--devices", "4", "--device-kind", "tpu-v4"), 2,
                          "--device-kind tpu-v4", "tpu-v5p", "h200")
    assert_one_line_error(invoke("plan", "--preset", "tiny", "--devices", "4", "--level", "all"), 2,
                          "--level all", "layer")


def test_zero_devices_exit_2():
    assert_one_line_error(invoke("plan", "--preset", "tiny", "--devices", "0"), 2, "--devices 0")


@pytest.mark.slow
def test_device_count_the_batch_cannot_use_exit_2():
    batch = get_preset("tiny").data.global_batch_size
    assert batch % 3
    assert_one_line_error(invoke("plan", "--preset", "tiny", "--devices", "3"), 2,
                          f"global_batch_size={batch}", "3 devices")
    assert_one_line_error(invoke("plan", "--preset", "tiny", "--devices", "4", "--set", "mesh.fsdp=3"), 2,
                          "mesh.fsdp=3", "4 devices")


def test_model_option_flags_are_config_overrides():
    from trainer.plan import option_overrides

    assert option_overrides() == []
    assert option_overrides("full", True, "bf16") == ["model.remat=full", "model.scan_layers=true",
                                                       "model.dtype=bfloat16", "model.param_dtype=float32"]
    assert option_overrides(precision="fp32") == ["model.dtype=float32", "model.param_dtype=float32"]


def test_unknown_remat_or_precision_exit_2_one_line():
    assert_one_line_error(invoke("plan", "--preset", "tiny", "--devices", "2", "--remat", "half"), 2, "--remat", "dots")
    assert_one_line_error(invoke("plan", "--preset", "tiny", "--devices", "2", "--precision", "fp8"), 2,
                          "--precision", "bf16")


@pytest.mark.slow
def test_plan_with_remat_scan_and_bf16_compiles_and_reports_them():
    # tests/trainer/test_model_options.py's every-option set, on one device at level layer: the
    # program that file and test_model_options_replay.py's run compile, so in a whole suite run the
    # child's compile is the session's compilation cache's (tests/conftest.py; the device-count flag
    # is not in its key). The multi-device mesh is tiny_plan's.
    from tests.trainer.test_model_options import BASE, SLIDING, _cfg

    sets = BASE + ["model.attention=fused", "optimizer.microbatches=2"] + SLIDING
    assert apply_overrides(get_preset("tiny"), option_overrides("dots", True, "bf16") + sets) == _cfg("all+bf16")
    result = invoke("plan", "--preset", "tiny", "--devices", "1", "--level", "layer", "--remat", "dots", "--scan",
                    "--precision", "bf16", *(a for kv in sets for a in ("--set", kv)), "--json")
    assert result.exit_code == 0, result.stderr
    r = json.loads(result.stdout)
    m = r["model"]
    assert (m["remat"], m["scan_layers"], m["dtype"], m["param_dtype"], m["attention"]) == \
        ("dots", True, "bfloat16", "float32", "fused")
    assert r["precision"] == {"compute": "bfloat16", "params": "float32", "optimizer": ["float32"]}
    assert r["donation"]["in_place"] and r["params"] == param_count(_cfg("all+bf16"))


@pytest.mark.slow
def test_plan_table_shows_the_gradient_state_of_a_mesh_invariant_plan(tiny_plan, capsys):
    """The row for trainer/gradient_memory.py's figures (bench/invariant_memory.py plans real
    mesh-invariant steps; tests/trainer/test_invariant_scatter.py checks the figures)."""
    _, report = tiny_plan
    state = {"accumulators": 3 * 2**20, "reduced": 2**20, "total": 4 * 2**20, "in_gradients": 0.625,
             "microbatch_steps": 8}
    plan_cli.render(dict(report, mesh_invariant={"n_microbatches": 64}, gradient_state_per_device=state))
    out = " ".join(capsys.readouterr().out.split())
    assert "gradient state" in out and "4.00 MiB (0.625 gradients: 3.00 MiB kept across 8" in out, out
    assert "1.00 MiB reduced shard" in out, out
