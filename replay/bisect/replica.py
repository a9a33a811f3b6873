"""Bisect's hardware verdict: two runs that part in one replica's results only.

When both traces hold per-replica fingerprints (check.replicas=true, mesh-invariant mode) and,
at the first step where they differ, the microbatch gradients that differ were all computed by
one device, the cause is not software or data (those change every replica's work, or the state
all of them start from): it is a hardware-like fault on that device at that step, in one of the
two runs. `replay verify` on each run says which one and whether the chip is still bad.

Reads one record of each run (the first differing step): O(1) in the run's length.
"""

from __future__ import annotations

from replay.contract import config_of


def hardware_fault(run_a, run_b, step: int | None) -> dict | None:
    """{"device", "step", "microbatches", "layers", "line"} or None (not a one-replica difference)."""
    from trainer.sdc import layer_groups, owner, replica_name
    from trainer.config import from_dict

    if step is None:
        return None
    cfg_a, cfg_b = config_of(run_a.manifest), config_of(run_b.manifest)
    mesh_a, mesh_b = cfg_a.get("mesh", {}), cfg_b.get("mesh", {})
    if not (mesh_a.get("mesh_invariant") and mesh_b.get("mesh_invariant")):
        return None
    m = int(mesh_a.get("n_microbatches", 0))
    n = int(run_a.manifest.get("mesh", {}).get("devices", 0))
    if m != int(mesh_b.get("n_microbatches", -1)) or n != int(run_b.manifest.get("mesh", {}).get("devices", -1)) or n < 1:
        return None  # another layout: the replicas were computed by other devices
    layers = [g for g, _ in layer_groups(from_dict(run_a.manifest["config"]))]
    rec_a, rec_b = run_a.trace.read(step), run_b.trace.read(step)
    names_a, names_b = run_a.schema.tensor_names, run_b.schema.tensor_names
    first = replica_name(0, layers[0], m)
    if rec_a.fingerprints is None or rec_b.fingerprints is None or first not in names_a or first not in names_b:
        return None
    ia, ib = {x: i for i, x in enumerate(names_a)}, {x: i for i, x in enumerate(names_b)}
    differing: dict[int, list[str]] = {}
    for mb in range(m):
        for g in layers:
            name = replica_name(mb, g, m)
            if rec_a.fingerprints[ia[name]] != rec_b.fingerprints[ib[name]]:
                differing.setdefault(mb, []).append(g)
    devices = {owner(mb, n, m) for mb in differing}
    if len(devices) != 1:
        return None
    device = devices.pop()
    return {"device": device, "step": step, "microbatches": sorted(differing),
            "layers": sorted({g for gs in differing.values() for g in gs}, key=layers.index),
            "line": f"hardware-like fault on device {device} at step {step} (differs in one replica's results only: "
                    f"microbatch {', '.join(map(str, sorted(differing)))}); not a software or data cause; "
                    "`replay verify` on each run says which run and whether the chip is still bad"}
