"""Which line of the determinism contract a replay on this machine falls under.

    same backend, device kind, software, device/process/CPU count, XLA flags, program
        -> bit-exact expected
    a different device or host count, in mesh-invariant mode, at a count measured to agree
        -> bit-exact expected (mesh-invariant)
    anything else on the same backend -> measured only: distances reported, bits not promised
    another backend (CPU vs GPU vs TPU) -> measured only: XLA's matmul precision and
        reduction order differ by backend, so the contract never promises bits there

A replay under "measured only" that does not match bit for bit is not a failure of the tool:
the report gives the distances and says why bits were not expected.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# Environment keys whose difference can change the bits a step computes.
BIT_KEYS = ("backend", "device_kind", "device_count", "process_count", "cpu_count", "xla_flags")
VERSION_KEYS = ("jax", "jaxlib", "flax", "optax", "numpy")
RANDOM_KEYS = ("jax_threefry_partitionable", "jax_default_prng_impl", "key_impl")


_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S*")


def _flags_except_count(flags: str | None) -> str:
    """XLA_FLAGS without the virtual-device-count flag, normalised (flag order kept)."""
    return " ".join(_COUNT_FLAG.sub("", flags or "").split())


@dataclass
class Contract:
    expect_bits: bool  # whether the contract promises bit-identical results here
    line: str  # the contract line that applies, in words
    differences: list[tuple[str, object, object]] = field(default_factory=list)  # (key, recorded, here)
    fatal: list[str] = field(default_factory=list)  # differences that make the replay meaningless

    def to_json(self) -> dict:
        return {"expect_bits": self.expect_bits, "line": self.line,
                "differences": [{"key": k, "recorded": a, "here": b} for k, a, b in self.differences],
                "fatal": self.fatal}


def evaluate(recorded_env: dict, here_env: dict, recorded_program: str | None, here_program: str | None,
             mesh_invariant: bool = False, invariant_counts: tuple[int, ...] = ()) -> Contract:
    diffs: list[tuple[str, object, object]] = []
    for key in BIT_KEYS:
        if recorded_env.get(key) != here_env.get(key):
            diffs.append((key, recorded_env.get(key), here_env.get(key)))
    rv, hv = recorded_env.get("versions", {}), here_env.get("versions", {})
    for key in VERSION_KEYS:
        if rv.get(key) != hv.get(key):
            diffs.append((f"versions.{key}", rv.get(key), hv.get(key)))
    fatal = []
    rr, hr = recorded_env.get("random", {}), here_env.get("random", {})
    for key in RANDOM_KEYS:
        if rr.get(key) != hr.get(key):
            diffs.append((f"random.{key}", rr.get(key), hr.get(key)))
            fatal.append(f"{key} differs ({rr.get(key)} recorded, {hr.get(key)} here): random values would differ")
    if recorded_program and here_program and recorded_program != here_program:
        diffs.append(("program_hash", recorded_program[:16], here_program[:16]))
    keys = {k for k, _, _ in diffs}
    if "backend" in keys:
        line = (f"measured only: recorded on {recorded_env.get('backend')}, replayed on {here_env.get('backend')}; "
                "the contract does not promise bits across backends")
        return Contract(False, line, diffs, fatal)
    if not diffs:
        return Contract(True, "bit-exact expected: same backend, devices, software and program", diffs, fatal)
    # Mesh-invariant mode (trainer/invariant.py): a different device count keeps the bits when both
    # counts are in the run's measured set and nothing else differs but the device-count flag.
    layout = {"device_count", "process_count", "program_hash"}
    if _flags_except_count(recorded_env.get("xla_flags")) == _flags_except_count(here_env.get("xla_flags")):
        layout.add("xla_flags")
    count, recorded_count = here_env.get("device_count"), recorded_env.get("device_count")
    if mesh_invariant and keys <= layout and count in invariant_counts and recorded_count in invariant_counts:
        counts = ", ".join(map(str, invariant_counts))
        return Contract(True, f"bit-exact expected: mesh-invariant mode, recorded on {recorded_count} and replayed on "
                              f"{count} devices, both measured to agree ({counts})", diffs, fatal)
    what = ", ".join(sorted(keys))
    return Contract(False, f"measured only: {what} differ from the recording; distances are reported", diffs, fatal)
