"""What this machine is, for the run manifest and for the replay engine's contract check.

Everything here can change the bits a step computes (see JAX-NOTES: XLA:CPU results depend
on its thread-pool size, which follows the CPU and device count), so all of it is recorded.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
from importlib import metadata

import jax

from trainer import rng

PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy")


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def environment() -> dict:
    devices = jax.devices()
    return {
        "versions": {name: _version(name) for name in PACKAGES} | {"python": platform.python_version()},
        "backend": jax.default_backend(),
        "device_kind": devices[0].device_kind,
        "device_count": len(devices),
        "local_device_count": jax.local_device_count(),
        "process_count": jax.process_count(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "random": rng.random_settings(),
        "argv": sys.argv[1:],
    }


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
