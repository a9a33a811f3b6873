"""The determinism contract's backend-specific keys (replay/engine/contract.py) and what
replay/record/environment.py records for them. Pure dicts, no training."""

from __future__ import annotations

import types

import pytest

from replay.engine.contract import (BACKEND_KEYS, COMMON_KEYS, GPU_NUMERIC_FLAGS, NOT_RECORDED, contract_keys,
                             environment_differences, evaluate)

VERSIONS = {"jax": "0.10.2", "jaxlib": "0.10.2", "flax": "0.12", "optax": "0.2", "numpy": "2.1"}
RANDOM = {"jax_threefry_partitionable": True, "jax_default_prng_impl": "threefry2x32", "key_impl": "threefry2x32"}
CPU = {"backend": "cpu", "device_kind": "cpu", "device_count": 1, "process_count": 1, "cpu_count": 2,
       "cpu_affinity": 2, "xla_cpu_pool": 2, "cpu_model": "AMD EPYC (AuthenticAMD family 26 model 2)",
       "cpu_isa": ["avx", "avx2", "avx512f", "fma"], "xla_flags": "", "versions": VERSIONS, "random": RANDOM}
GPU = {"backend": "gpu", "device_kind": "NVIDIA H100 80GB HBM3", "device_count": 8, "process_count": 1,
       "cpu_count": 208, "cpu_affinity": 208, "xla_cpu_pool": 208, "cpu_model": "Intel Xeon Platinum 8480+",
       "cpu_isa": ["avx", "avx2", "avx512f", "fma"], "gpu_driver": "550.54.15", "cuda_driver": 12040,
       "cuda_runtime": 12030, "cudnn": 90100, "gpu_libraries": {"jax-cuda12-plugin": "0.10.2"},
       "platform_version": "PJRT C API\ncuda 12030", "xla_flags": "--xla_gpu_enable_latency_hiding_scheduler=true",
       "versions": VERSIONS, "random": RANDOM}
TPU = {"backend": "tpu", "device_kind": "TPU v5 lite", "device_count": 8, "process_count": 2, "cpu_count": 224,
       "libtpu": "0.0.20", "platform_version": "PJRT C API\nTFRT TPU v5 lite\nBuilt on Jul 1 2025 (1751328000) cl/1",
       "libtpu_init_args": "", "xla_flags": "", "versions": VERSIONS, "random": RANDOM}


def keys_of(contract):
    return {k for k, _, _ in contract.differences}


def test_gpu_hosts_with_other_cpus_or_non_numeric_flags_keep_the_bit_promise():
    """The old contract compared cpu_count and all of XLA_FLAGS on every backend: two GPU runs on
    hosts with other vCPU counts were "measured only", and bisect judged them by the noise floor."""
    other_host = {**GPU, "cpu_count": 96, "cpu_affinity": 48, "xla_cpu_pool": 48, "cpu_model": "AMD EPYC 9654",
                  "cpu_isa": ["avx", "avx2"]}
    c = evaluate(GPU, other_host, "p", "p")
    assert c.expect_bits and c.differences == [], c.line
    dumps = {**GPU, "xla_flags": GPU["xla_flags"] + " --xla_dump_to=/tmp/hlo --xla_dump_hlo_as_text"}
    assert evaluate(GPU, dumps, "p", "p").expect_bits
    scheduling = {**GPU, "xla_flags": "--xla_gpu_enable_latency_hiding_scheduler=false"}
    c = evaluate(GPU, scheduling, "p", "p")
    assert c.expect_bits and [k for k, _, _ in c.informational] == ["xla_flags.other"]
    assert "xla_flags.other" in c.line
    # A flag that changes numerics still withdraws the promise, and is named.
    deterministic = {**GPU, "xla_flags": GPU["xla_flags"] + " --xla_gpu_deterministic_ops=true"}
    c = evaluate(GPU, deterministic, "p", "p")
    assert not c.expect_bits and keys_of(c) == {"xla_flags"}
    assert c.differences[0][2] == "--xla_gpu_deterministic_ops=true"  # the numerics flags only, normalised


@pytest.mark.parametrize("key, value", [
    ("cpu_affinity", 1), ("xla_cpu_pool", 8), ("cpu_model", "Intel Xeon Platinum 8480+"),
    ("cpu_isa", ["avx", "avx2", "fma"]),
])
def test_cpu_runs_on_another_cpu_are_measured_only_naming_the_key(key, value):
    c = evaluate(CPU, {**CPU, key: value}, "p", "p")
    assert not c.expect_bits and keys_of(c) == {key}
    assert c.line.startswith("measured only") and key in c.line


@pytest.mark.parametrize("key, value", [
    ("gpu_driver", "535.104.05"), ("cuda_driver", 12020), ("cuda_runtime", 12040), ("cudnn", 8907),
    ("gpu_libraries", {"jax-cuda12-plugin": "0.10.1"}),
])
def test_gpu_runs_with_other_drivers_or_libraries_are_measured_only(key, value):
    c = evaluate(GPU, {**GPU, key: value}, "p", "p")
    assert not c.expect_bits and keys_of(c) == {key} and key in c.line


def test_tpu_compares_the_chip_and_libtpu_not_the_host():
    assert evaluate(TPU, {**TPU, "cpu_count": 96, "xla_flags": "--xla_dump_to=/x"}, "p", "p").expect_bits
    for key, value in (("libtpu", "0.0.21"), ("platform_version", "PJRT C API\nTFRT TPU v5 lite\nBuilt on Aug 1"),
                       ("device_kind", "TPU v6 lite")):
        c = evaluate(TPU, {**TPU, key: value}, "p", "p")
        assert not c.expect_bits and keys_of(c) == {key}


def test_key_lists_per_backend():
    assert COMMON_KEYS == ("backend", "device_kind", "device_count", "process_count")
    assert set(contract_keys("cpu")) == set(COMMON_KEYS) | {"cpu_model", "cpu_isa", "cpu_affinity", "xla_cpu_pool",
                                                            "cpu_count", "xla_flags"}
    assert set(contract_keys("gpu")) == set(COMMON_KEYS) | {"gpu_driver", "cuda_driver", "cuda_runtime", "cudnn",
                                                            "gpu_libraries", "platform_version", "xla_flags"}
    assert set(contract_keys("tpu")) == set(COMMON_KEYS) | {"libtpu", "platform_version"}
    for host_key in ("cpu_count", "cpu_affinity", "cpu_model", "cpu_isa", "xla_cpu_pool"):
        assert host_key not in contract_keys("gpu") and host_key not in contract_keys("tpu")
    assert set(BACKEND_KEYS) == {"cpu", "gpu", "tpu"}
    assert {"xla_gpu_deterministic_ops", "xla_gpu_enable_fast_min_max", "xla_gpu_autotune_level"} <= GPU_NUMERIC_FLAGS
    assert not any("dump" in f for f in GPU_NUMERIC_FLAGS)


def test_environment_differences_is_the_one_list():
    other = {**GPU, "cudnn": 8907, "cpu_count": 4, "xla_flags": "--xla_gpu_autotune_level=0"}
    assert environment_differences(GPU, other) == [
        ("cudnn", 90100, 8907), ("xla_flags", "", "--xla_gpu_autotune_level=0"),
        ("xla_flags.other", "--xla_gpu_enable_latency_hiding_scheduler=true", "")]
    assert environment_differences(GPU, GPU) == []
    assert environment_differences(CPU, GPU)[0] == ("backend", "cpu", "gpu")  # across backends: the common keys
    assert evaluate(CPU, GPU, "p", "p").line.startswith("measured only: recorded on cpu, replayed on gpu")


def test_an_older_recording_keeps_the_promise_and_names_what_it_lacks():
    """A recording from before a key was recorded: reported as not compared, not "measured only"."""
    old = {k: v for k, v in CPU.items() if k not in ("cpu_model", "cpu_isa", "xla_cpu_pool")}
    c = evaluate(old, CPU, "p", "p")
    assert c.expect_bits and c.differences == []
    assert [(k, a) for k, a, _ in c.unchecked] == [("cpu_model", NOT_RECORDED), ("cpu_isa", NOT_RECORDED),
                                                   ("xla_cpu_pool", NOT_RECORDED)]
    assert "not compared: cpu_model (not recorded)" in c.line
    assert c.to_json()["unchecked"][0] == {"key": "cpu_model", "recorded": NOT_RECORDED, "here": CPU["cpu_model"]}
    # A value this machine cannot read is not compared either, and said so.
    c = evaluate(GPU, {**GPU, "cudnn": None}, "p", "p")
    assert c.expect_bits and "cudnn (unknown here)" in c.line
    # What the recording does hold is still compared.
    assert not evaluate(old, {**CPU, "cpu_affinity": 1}, "p", "p").expect_bits


def test_mesh_invariant_counts_still_keep_the_bits():
    four = {**CPU, "device_count": 4, "xla_cpu_pool": 8,
            "xla_flags": "--xla_force_host_platform_device_count=4 --xla_cpu_max_isa=AVX"}
    one = {**four, "device_count": 1, "xla_flags": "--xla_cpu_max_isa=AVX"}
    assert evaluate(four, one, "a", "b", True, (1, 2, 4, 8)).expect_bits
    assert not evaluate(four, {**one, "xla_cpu_pool": 2}, "a", "b", True, (1, 2, 4, 8)).expect_bits  # pool not pinned
    assert not evaluate(four, {**one, "cpu_affinity": 1}, "a", "b", True, (1, 2, 4, 8)).expect_bits


def test_environment_records_the_new_keys_here():
    from replay.record.environment import environment

    env = environment()
    assert env["backend"] == "cpu"  # the test machine
    for key in contract_keys("cpu"):
        assert key in env, key
    assert env["xla_cpu_pool"] >= max(1, env["local_device_count"])
    assert env["cpu_model"], env
    if env["cpu_isa"] is not None:  # Linux: from /proc/cpuinfo
        assert env["cpu_isa"] == sorted(env["cpu_isa"]) and len(env["cpu_flags_sha256"]) == 16
    assert "gpu_driver" not in env and "libtpu" not in env  # nothing GPU or TPU is probed on CPU
    assert evaluate(env, environment(), "p", "p").expect_bits


def test_gpu_description_reads_jaxlib_versions_and_survives_without_them(monkeypatch):
    from jax._src import lib

    from replay.record import environment as envmod

    assert envmod.nvidia_driver("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar 5 2024") \
        == "550.54.15"
    assert envmod.nvidia_driver("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.86.15  Release") \
        == "570.86.15"
    fake = types.SimpleNamespace(cuda_driver_get_version=lambda: 12040, cuda_runtime_get_version=lambda: 12030,
                                 cudnn_get_version=lambda: 90100)
    monkeypatch.setattr(lib, "cuda_versions", fake, raising=False)
    got = envmod.gpu_description(types.SimpleNamespace(compute_capability="9.0"))
    assert (got["cuda_driver"], got["cuda_runtime"], got["cudnn"], got["compute_capability"]) == (12040, 12030,
                                                                                                 90100, "9.0")

    def broken():
        raise RuntimeError("no CUDA device")

    monkeypatch.setattr(lib, "cuda_versions", types.SimpleNamespace(cuda_driver_get_version=broken), raising=False)
    got = envmod.gpu_description(object())
    assert (got["cuda_driver"], got["cuda_runtime"], got["cudnn"], got["compute_capability"]) == (None,) * 4


def test_a_run_resumed_on_another_process_count_is_not_promised_bits_by_its_first_environment():
    from replay.engine.contract import recorded_environment

    same = {"environment": CPU, "resumes": [{"step": 40, "process_count": 1, "device_count": 1}]}
    assert recorded_environment(same) == CPU and evaluate(recorded_environment(same), CPU, "p", "p").expect_bits
    moved = {"environment": CPU, "resumes": [{"step": 80, "process_count": 2, "device_count": 2}]}
    env = recorded_environment(moved)
    assert env["process_count"] == "1, then 2 from step 80" and env["device_count"] == "1, then 2 from step 80"
    contract = evaluate(env, CPU, "p", "p")
    assert not contract.expect_bits and {"process_count", "device_count"} <= keys_of(contract)
    assert evaluate(moved["environment"], CPU, "p", "p").expect_bits  # what the first environment alone promised
