"""Which line of the determinism contract a replay on this machine falls under.

    same backend, device kind, software, program and the backend's numerics keys (below)
        -> bit-exact expected
    a different device or host count, in mesh-invariant mode, at a count measured to agree
        -> bit-exact expected (mesh-invariant)
    anything else on the same backend -> measured only: distances reported, bits not promised
    another backend (CPU vs GPU vs TPU) -> measured only: XLA's matmul precision and
        reduction order differ by backend, so the contract never promises bits there

What can change a step's bits depends on the backend, so each compares its own keys
(replay/record/environment.py records them all), besides backend, device kind, device and process
count, the package versions and the PRNG settings:

    cpu: cpu_model, cpu_isa, cpu_affinity, xla_cpu_pool, cpu_count, xla_flags. XLA:CPU's code
         follows the ISA (vector width, FMA) and Eigen blocks matmuls by the model's caches and
         splits them over the intra-op pool, whose size follows the affinity (trainer/invariant.py).
    gpu: gpu_driver, cuda_driver, cuda_runtime, cudnn, gpu_libraries, platform_version and the
         XLA flags in GPU_NUMERIC_FLAGS. The host CPU and its count do not enter a GPU kernel.
    tpu: libtpu, platform_version (the libtpu build).

`environment_differences` is the one comparison: `evaluate` (replay run, spike, bundles) and
bisect's manifest diff both use it.

XLA flags: on CPU every flag counts but those that only dump, log, time out or profile
(NON_NUMERIC_FLAG) and the virtual-device-count flag (device_count covers it). On GPU only
GPU_NUMERIC_FLAGS count: a difference in any other flag is listed as "xla_flags.other", not known
to change numerics, and keeps the promise. The list is taken from the flags' own descriptions in
XLA's xla/debug_options_flags.cc (jaxlib 0.10.2; `XLA_FLAGS=--help` prints them) and JAX's "GPU
performance tips" page: flags that choose float semantics or determinism, the kernel a dot,
convolution or attention runs (each sums in its own order), or how all-reduces are combined and
decomposed (which changes NCCL's algorithm and so the summation order). Everything else there
(dumps, scheduling, streams, command buffers, memory) moves work in time, not bits.

A key that cannot be checked -- absent from a recording made before it was recorded ("not
recorded"), or None where this machine cannot read it -- is reported in `Contract.unchecked`
and in the contract line, and does not by itself withdraw the promise. Withdrawing it would
turn every older run into "measured only", and for bisect "measured only" means judging a
difference against the noise floor, where a real but small divergence can pass as noise (exit
0). Keeping it means a mismatch is called a real divergence, which the report qualifies by
naming the keys that could not be compared: the bits are always compared, so nothing
unverified is ever called bit-exact.

A replay under "measured only" that does not match bit for bit is not a failure of the tool:
the report gives the distances and says why bits were not expected.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

VERSION_KEYS = ("jax", "jaxlib", "flax", "optax", "numpy")
RANDOM_KEYS = ("jax_threefry_partitionable", "jax_default_prng_impl", "key_impl")
COMMON_KEYS = ("backend", "device_kind", "device_count", "process_count")
BACKEND_KEYS: dict[str, tuple[str, ...]] = {
    "cpu": ("cpu_model", "cpu_isa", "cpu_affinity", "xla_cpu_pool", "cpu_count", "xla_flags"),
    "gpu": ("gpu_driver", "cuda_driver", "cuda_runtime", "cudnn", "gpu_libraries", "platform_version", "xla_flags"),
    "tpu": ("libtpu", "platform_version"),
}
UNKNOWN_BACKEND_KEYS = ("platform_version", "xla_flags")  # a PJRT plugin this table does not know
# Compared and reported, never a reason to withdraw the promise: not known to change numerics.
INFORMATIONAL_KEYS: dict[str, tuple[str, ...]] = {"gpu": ("xla_flags.other",),
                                                   "tpu": ("xla_flags.other", "libtpu_init_args")}
NOT_RECORDED = "not recorded"  # the value shown for a key a recording predates

GPU_NUMERIC_FLAGS = frozenset({
    # float semantics and determinism
    "xla_gpu_deterministic_ops", "xla_gpu_exclude_nondeterministic_ops", "xla_gpu_enable_scatter_determinism_expander",
    "xla_gpu_enable_fast_min_max", "xla_gpu_ftz", "xla_allow_excess_precision", "xla_enable_fast_math",
    "xla_gpu_default_to_alg_dot_bf16_bf16_f32", "xla_gpu_enable_reassociation_for_converted_ar",
    # which kernel a dot, convolution or attention runs
    "xla_gpu_autotune_level", "xla_gpu_autotune_gemm_rtol", "xla_gpu_enable_cublaslt", "xla_gpu_cublas_fallback",
    "xla_gpu_enable_triton_gemm", "xla_gpu_triton_gemm_any", "xla_gpu_enable_triton_gemm_int4",
    "xla_gpu_cudnn_gemm_fusion_level", "xla_gpu_experimental_force_split_k", "xla_gpu_override_gemm_autotuner",
    "xla_gpu_gemm_autotuner_override_file", "xla_gpu_load_autotune_results_from", "xla_gpu_gemm_rewrite_size_threshold",
    "xla_gpu_strict_conv_algorithm_picker", "xla_gpu_algorithm_denylist_path", "xla_gpu_use_runtime_fusion",
    "xla_gpu_experimental_autotune_backends", "xla_gpu_experimental_enable_fusion_autotuner",
    "xla_gpu_exhaustive_tiling_search", "xla_gpu_enable_cudnn_fmha", "xla_gpu_enable_cudnn_layer_norm",
    "xla_gpu_fused_attention_use_cudnn_rng", "xla_gpu_dot_merger_threshold_mb",
    # how cross-device sums are combined and decomposed
    "xla_gpu_all_reduce_combine_threshold_bytes", "xla_gpu_reduce_scatter_combine_threshold_bytes",
    "xla_gpu_all_reduce_blueconnect_num_devices_per_host", "xla_gpu_unsupported_use_all_reduce_one_shot_kernel",
    "xla_gpu_unsupported_enable_all_reduce_decomposer", "xla_gpu_collectives_implementation",
    # which passes run at all
    "xla_disable_hlo_passes", "xla_disable_all_hlo_passes", "xla_enable_hlo_passes_only",
    "xla_backend_optimization_level", "xla_llvm_disable_expensive_passes",
})
NON_NUMERIC_FLAG = re.compile(r"dump|_logs?(?:_|$)|logging|timeout|profil|debug_info|line_info|cache_dir|print_|xprof|"
                              r"graph_addresses|detect_cycles")
COUNT_FLAG = "xla_force_host_platform_device_count"  # layout, compared as device_count
_FLAG = re.compile(r"--([A-Za-z0-9_]+)(?:=(\S*))?")


def contract_keys(backend: str | None) -> tuple[str, ...]:
    """The environment keys whose difference withdraws the bit promise on `backend`."""
    return COMMON_KEYS + BACKEND_KEYS.get(backend or "", UNKNOWN_BACKEND_KEYS)


def _flags(raw: str | None) -> dict[str, str]:
    """XLA_FLAGS as {name: value}; a later flag overrides an earlier one, as in XLA."""
    return {name: "true" if value is None else value for name, value in _FLAG.findall(raw or "")} if raw else {}


def split_xla_flags(raw: str | None, backend: str | None) -> tuple[str, str]:
    """(flags that can change numerics on `backend`, other flags), each normalised and sorted."""
    numeric, other = [], []
    for name, value in sorted(_flags(raw).items()):
        if name == COUNT_FLAG or NON_NUMERIC_FLAG.search(name):
            continue
        # TPU numerics are set through LIBTPU_INIT_ARGS; an unknown backend is compared in full.
        counts = name in GPU_NUMERIC_FLAGS if backend == "gpu" else backend != "tpu"
        (numeric if counts else other).append(f"--{name}={value}")
    return " ".join(numeric), " ".join(other)


def _value(env: dict, key: str, backend: str | None):
    if key in ("xla_flags", "xla_flags.other"):
        if "xla_flags" not in env:
            return NOT_RECORDED
        return split_xla_flags(env["xla_flags"], backend)[key == "xla_flags.other"]
    return env.get(key, NOT_RECORDED)


def _unknown(value) -> bool:
    return value is None or value == NOT_RECORDED


def environment_differences(recorded_env: dict, here_env: dict) -> list[tuple[str, object, object]]:
    """(key, recorded, here) for every contract key of the recording's backend that differs,
    the informational ones last. Versions and PRNG settings are compared by `evaluate`."""
    backend = recorded_env.get("backend")
    keys = COMMON_KEYS if backend != here_env.get("backend") else \
        contract_keys(backend) + INFORMATIONAL_KEYS.get(backend or "", ())
    out = []
    for key in keys:
        a, b = _value(recorded_env, key, backend), _value(here_env, key, backend)
        if a != b:
            out.append((key, a, b))
    return out


@dataclass
class Contract:
    expect_bits: bool  # whether the contract promises bit-identical results here
    line: str  # the contract line that applies, in words
    differences: list[tuple[str, object, object]] = field(default_factory=list)  # (key, recorded, here)
    fatal: list[str] = field(default_factory=list)  # differences that make the replay meaningless
    unchecked: list[tuple[str, object, object]] = field(default_factory=list)  # keys one side cannot tell
    informational: list[tuple[str, object, object]] = field(default_factory=list)  # differ, not numerics

    def to_json(self) -> dict:
        def rows(items):
            return [{"key": k, "recorded": a, "here": b} for k, a, b in items]

        return {"expect_bits": self.expect_bits, "line": self.line, "differences": rows(self.differences),
                "fatal": self.fatal, "unchecked": rows(self.unchecked), "informational": rows(self.informational)}


def _why_unchecked(recorded, here) -> str:
    if recorded == NOT_RECORDED:
        return "not recorded"
    return "unknown on both" if _unknown(recorded) and _unknown(here) else \
        "unknown in the recording" if _unknown(recorded) else "unknown here"


def _qualifiers(unchecked, informational) -> str:
    words = []
    if unchecked:
        words.append("not compared: " + ", ".join(f"{k} ({_why_unchecked(a, b)})" for k, a, b in unchecked))
    if informational:
        words.append("differ, not known to change numerics: " + ", ".join(k for k, _, _ in informational))
    return "".join(f"; {w}" for w in words)


def evaluate(recorded_env: dict, here_env: dict, recorded_program: str | None, here_program: str | None,
             mesh_invariant: bool = False, invariant_counts: tuple[int, ...] = (),
             program_reason: str | None = None) -> Contract:
    """program_reason: why the program hashes differ where the caller knows (the state's layout,
    replay/record/state_layout.py), named beside program_hash in the line."""
    backend = recorded_env.get("backend")
    info_keys = set(INFORMATIONAL_KEYS.get(backend or "", ()))
    diffs, unchecked, informational = [], [], []
    for key, a, b in environment_differences(recorded_env, here_env):
        (informational if key in info_keys else unchecked if _unknown(a) or _unknown(b) else diffs).append((key, a, b))
    if backend == here_env.get("backend"):  # a key neither side could read is not checked either
        for key in contract_keys(backend):
            a, b = _value(recorded_env, key, backend), _value(here_env, key, backend)
            if _unknown(a) and _unknown(b) and a == b:
                unchecked.append((key, a, b))
    rv, hv = recorded_env.get("versions", {}), here_env.get("versions", {})
    for key in VERSION_KEYS:
        if rv.get(key) != hv.get(key):
            diffs.append((f"versions.{key}", rv.get(key), hv.get(key)))
    fatal = []
    rr, hr = recorded_env.get("random", {}), here_env.get("random", {})
    for key in RANDOM_KEYS:
        if rr.get(key) != hr.get(key):
            diffs.append((f"random.{key}", rr.get(key), hr.get(key)))
            hint = f"; replay with {key.upper()}={rr.get(key)} in the environment" if key.startswith("jax_") else ""
            fatal.append(f"{key} differs ({rr.get(key)} recorded, {hr.get(key)} here): random values would differ{hint}")
    if recorded_program and here_program and recorded_program != here_program:
        diffs.append(("program_hash", recorded_program[:16], here_program[:16]))
    keys = {k for k, _, _ in diffs}
    if "backend" in keys:
        line = (f"measured only: recorded on {recorded_env.get('backend')}, replayed on {here_env.get('backend')}; "
                "the contract does not promise bits across backends")
        return Contract(False, line, diffs, fatal, [], informational)
    more = _qualifiers(unchecked, informational)
    if not diffs:
        return Contract(True, "bit-exact expected: same backend, devices, software and program" + more,
                        diffs, fatal, unchecked, informational)
    # Mesh-invariant mode (trainer/invariant.py): a different device or process count keeps the
    # bits when both counts are in the run's measured set and nothing else differs.
    layout = {"device_count", "process_count", "program_hash"}
    count, recorded_count = here_env.get("device_count"), recorded_env.get("device_count")
    if mesh_invariant and keys <= layout and count in invariant_counts and recorded_count in invariant_counts:
        counts = ", ".join(map(str, invariant_counts))
        return Contract(True, f"bit-exact expected: mesh-invariant mode, recorded on {recorded_count} and replayed on "
                              f"{count} devices, both measured to agree ({counts})" + more,
                        diffs, fatal, unchecked, informational)
    # The process count is named with its values: a cross-process reduction rounds otherwise than one
    # process's, so that alone withdraws the bits, and the reader needs the count to replay on.
    values = {k: (a, b) for k, a, b in diffs}
    what = ", ".join(f"{k} (recorded {values[k][0]}, here {values[k][1]})" if k == "process_count" else
                     f"{k} ({program_reason})" if k == "program_hash" and program_reason else k
                     for k in sorted(keys))
    return Contract(False, f"measured only: {what} differ from the recording; distances are reported" + more,
                    diffs, fatal, unchecked, informational)


def config_of(manifest: dict) -> dict:
    """The run's recorded config as a dict: a loop recorded with `config=None` (or any non-dict
    config) has no trainer sections, which every lookup below must survive."""
    config = manifest.get("config")
    return config if isinstance(config, dict) else {}


def recorded_environment(manifest: dict) -> dict:
    """The environment a run's steps were recorded in. A run resumed on another process or device
    count (manifest "resumes": step, process_count, device_count) was recorded in several: its
    counts then read "1, then 2 from step 80", which no machine matches, so no replay of it is
    promised bits on the strength of the first environment alone."""
    env = dict(manifest.get("environment") or {})
    for key in ("process_count", "device_count"):
        history = [(0, env.get(key))]
        for r in manifest.get("resumes") or []:
            if isinstance(r, dict) and r.get(key) != history[-1][1]:
                history.append((r.get("step"), r.get(key)))
        if len(history) > 1:
            env[key] = ", then ".join([str(history[0][1])] + [f"{v} from step {s}" for s, v in history[1:]])
    return env
