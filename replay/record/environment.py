"""What this machine is, for the run manifest and for the replay engine's contract check.

Everything here can change the bits a step computes, so all of it is recorded; which of it
`replay.engine.contract` compares depends on the backend. XLA:CPU results depend on the CPU (its ISA
decides vector widths and FMA; Eigen blocks a matmul by the caches of the model) and on the
intra-op pool size, which is max(PJRT_NPROC or the schedulable CPUs, local devices)
(trainer/invariant.py pins it). On GPU the driver, CUDA runtime, cuDNN and the libraries the plugin
loads choose the kernels. On TPU the chip and the libtpu build do.

It runs at every train start and every replay, so it only reads a few small /proc files and
asks jaxlib for versions it already has; every probe is guarded and gives None when it fails.
Its cost does not depend on the run: nothing here grows with the step count.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import sys
from importlib import metadata

import jax
from jax._src import xla_bridge

PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy")
# Packages whose code or libraries run a GPU step: the JAX plugin, cuBLAS, cuDNN, NCCL (all-reduce
# algorithms). Only those installed are recorded.
GPU_PACKAGES = ("jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin", "jax-cuda13-pjrt",
                "jax-rocm60-plugin", "jax-rocm60-pjrt", "nvidia-cublas-cu12", "nvidia-cublas",
                "nvidia-cudnn-cu12", "nvidia-cudnn-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu13")
TPU_PACKAGES = ("libtpu", "libtpu-nightly")
# ISA extensions that change what XLA:CPU (LLVM) can emit, hence rounding: vector width, FMA,
# bf16/fp16/int8 dot instructions. x86 names as /proc/cpuinfo "flags", Arm as "Features".
NUMERIC_ISA = frozenset({
    "sse4_1", "sse4_2", "avx", "avx2", "fma", "fma4", "f16c", "avx512f", "avx512dq", "avx512bw", "avx512vl",
    "avx512cd", "avx512ifma", "avx512vbmi", "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni",
    "avx_vnni_int8", "avx_ne_convert", "amx_tile", "amx_bf16", "amx_int8", "amx_fp16", "amx_complex",
    "asimd", "asimdhp", "fphp", "asimddp", "asimdfhm", "fcma", "sve", "sve2", "svebf16", "bf16", "i8mm", "sme",
})


POOL_THREAD_NAME = "tf_XLAEigen"  # how XLA:CPU's intra-op pool threads are named (Linux comm)


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _first_cpuinfo_block() -> dict[str, str]:
    """The first processor's "key: value" lines of /proc/cpuinfo ({} where there is none).
    Only the first block is read: every core of one machine reports the same model and ISA."""
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    if info:
                        break
                    continue
                key, _, value = line.partition(":")
                info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return info


def cpu_description() -> dict:
    """cpu_model, cpu_isa (the numerics-relevant extensions, sorted) and cpu_flags_sha256 (16 hex
    of every flag, sorted: for telling machines apart, not compared, since kernel mitigation
    flags differ between hosts of one model)."""
    info = _first_cpuinfo_block()
    model = info.get("model name") or info.get("Hardware") or info.get("cpu model")
    if model and "cpu family" in info:
        model = f"{model} ({info.get('vendor_id', '?')} family {info['cpu family']} model {info.get('model', '?')})"
    elif not model and "CPU implementer" in info:  # Arm: no model name, an implementer and a part number
        model = f"Arm implementer {info['CPU implementer']} part {info.get('CPU part', '?')}"
    model = model or platform.processor() or None
    flags = (info.get("flags") or info.get("Features") or "").split()
    return {
        "cpu_model": model,
        "cpu_isa": sorted(NUMERIC_ISA.intersection(flags)) if flags else None,
        "cpu_flags_sha256": hashlib.sha256(" ".join(sorted(flags)).encode()).hexdigest()[:16] if flags else None,
    }


def pool_threads() -> int | None:
    """Threads in this process's XLA:CPU intra-op pool, or None when it cannot be known
    (no backend started yet, or no /proc to count threads in)."""
    if not xla_bridge.backends_are_initialized():
        return None
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    n = 0
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                n += f.read().strip() == POOL_THREAD_NAME
        except OSError:
            continue
    return n or None


def cpu_pool_size(local_devices: int, affinity: int | None) -> int | None:
    """Threads in XLA:CPU's intra-op pool: counted where /proc shows them, else computed the way
    XLA sizes it (max(PJRT_NPROC or the schedulable CPUs, local devices))."""
    try:
        counted = pool_threads()
    except Exception:  # noqa: BLE001 -- a probe: any failure means "could not count"
        counted = None
    if counted:
        return counted
    nproc = os.environ.get("PJRT_NPROC", "")
    base = int(nproc) if nproc.isdigit() else (affinity or os.cpu_count())
    return max(base, local_devices) if base else None


def nvidia_driver(text: str) -> str | None:
    """The driver release in /proc/driver/nvidia/version's first line, e.g. "550.54.15"."""
    match = re.search(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)", text)
    return match.group(1) if match else None


def _nvidia_driver() -> str | None:
    try:
        with open("/proc/driver/nvidia/version") as f:
            return nvidia_driver(f.readline())
    except OSError:
        return None


def gpu_description(device) -> dict:
    out: dict = {"gpu_driver": _nvidia_driver(), "cuda_driver": None, "cuda_runtime": None, "cudnn": None,
                 "compute_capability": getattr(device, "compute_capability", None),
                 "gpu_libraries": {n: v for n in GPU_PACKAGES if (v := _version(n))}}
    try:
        from jax._src.lib import cuda_versions  # the CUDA plugin's _versions module, None without one
    except Exception:  # noqa: BLE001
        cuda_versions = None
    for key, probe in (("cuda_driver", "cuda_driver_get_version"), ("cuda_runtime", "cuda_runtime_get_version"),
                       ("cudnn", "cudnn_get_version")):
        try:
            out[key] = int(getattr(cuda_versions, probe)())
        except Exception:  # noqa: BLE001 -- no plugin, no GPU visible, or an older plugin
            pass
    return out


def tpu_description() -> dict:
    return {"libtpu": next((v for n in TPU_PACKAGES if (v := _version(n))), None),
            "libtpu_init_args": os.environ.get("LIBTPU_INIT_ARGS", "")}


def _platform_version(device) -> str | None:
    """The PJRT plugin's own version text (for TPU: the libtpu build date and changelist)."""
    try:
        return str(device.client.platform_version)
    except Exception:  # noqa: BLE001
        return None


def random_settings() -> dict:
    """JAX settings that change random values; recorded in the manifest, checked on replay."""
    return {
        "jax_threefry_partitionable": bool(jax.config.jax_threefry_partitionable),
        "jax_default_prng_impl": str(jax.config.jax_default_prng_impl),
        "key_impl": "threefry2x32",
    }


def environment() -> dict:
    devices = jax.devices()  # starts the backend first: the pool is counted after it exists
    backend = jax.default_backend()
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    env = {
        "versions": {name: _version(name) for name in PACKAGES} | {"python": platform.python_version()},
        "backend": backend,
        "device_kind": devices[0].device_kind,
        "device_count": len(devices),
        "local_device_count": jax.local_device_count(),
        "process_count": jax.process_count(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": affinity,
        "xla_cpu_pool": cpu_pool_size(jax.local_device_count(), affinity),
        **cpu_description(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "platform": platform.platform(),
        "platform_version": _platform_version(devices[0]),
        "machine": platform.machine(),
        "random": random_settings(),
        "argv": sys.argv[1:],
    }
    if backend == "gpu":
        env.update(gpu_description(devices[0]))
    elif backend == "tpu":
        env.update(tpu_description())
    return env


def program_hash(lowered) -> str:
    """sha256 of the lowered train step's StableHLO text, without source locations."""
    return hashlib.sha256(lowered.as_text(debug_info=False).encode()).hexdigest()


# Peak dense bf16 FLOP/s per device, for MFU. CPUs have no meaningful peak: MFU is not shown.
PEAK_FLOPS = {
    "TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v5p": 459e12, "TPU v6 lite": 918e12,
    "NVIDIA A100-SXM4-80GB": 312e12, "NVIDIA A100-SXM4-40GB": 312e12, "NVIDIA H100 80GB HBM3": 989e12,
    "NVIDIA H100": 989e12, "NVIDIA H200": 989e12,
}


def peak_flops(device_kind: str) -> float | None:
    return PEAK_FLOPS.get(device_kind)
