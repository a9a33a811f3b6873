"""Bisect's hardware verdict: two runs that part in one replica's results only.

When both traces hold per-replica fingerprints (check.replicas=true, mesh-invariant mode) and,
at the first step where they differ, the microbatch gradients that differ were all computed by
one device, the cause is not software or data (those change every replica's work, or the state
all of them start from): it is a hardware-like fault on that device at that step, in one of the
two runs. `replay verify` on each run says which one and whether the chip is still bad.

The in-training re-run check (check.rerun_every=N, trainer/sdc.py) is shown too: for each run that
has it, the first re-run at or after the first differing step (the first that could see a fault
there). When only one run's re-run disagreed and it names a bad chip, and the replica fingerprints
gave no verdict (a run without check.replicas), that chip is the hardware verdict.

Reads one record of each run at the first differing step and at most CHECK_READS records of each
run after it: O(1) in the run's length.
"""

from __future__ import annotations

from replay.engine.contract import config_of


def hardware_fault(run_a, run_b, step: int | None) -> dict | None:
    """{"device", "step", "microbatches", "layers", "line"} or None (not a one-replica difference)."""
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
    # Imported only for a mesh-invariant pair: replay.verify imports JAX, which a plain bisect never needs
    from replay.verify.classify import owner
    from replay.verify.names import replica_layers, replica_name

    names_a, names_b = run_a.schema.tensor_names, run_b.schema.tensor_names
    layers = replica_layers(names_a, m)  # read from the recorded names: no model needed to decode them
    ia, ib = {x: i for i, x in enumerate(names_a)}, {x: i for i, x in enumerate(names_b)}
    if not layers or any(replica_name(mb, g, m) not in ia or replica_name(mb, g, m) not in ib
                         for mb in range(m) for g in layers):
        return None  # not both recording every microbatch's replicas of the same layers
    rec_a, rec_b = run_a.trace.read(step), run_b.trace.read(step)
    if rec_a.fingerprints is None or rec_b.fingerprints is None:
        return None
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


CHECK_READS = 4  # re-run steps tried after the first difference (trace.layer_every may have skipped some)


def rerun_checks(run_a, run_b, step: int | None) -> dict[str, dict]:
    """{"A"/"B": replay.verify.checks.describe's dict} of the first re-run at or after `step` in
    each run that has the in-training check; a run without one (or none recorded that late) is left out."""
    everys = {name: int((config_of(run.manifest).get("check") or {}).get("rerun_every") or 0)
              for name, run in (("A", run_a), ("B", run_b))}
    if step is None or not any(everys.values()):
        return {}
    from replay.verify import checks  # only for a run with the check: replay.verify imports JAX

    out = {}
    for name, run in (("A", run_a), ("B", run_b)):
        every = everys[name]
        if not every or not checks.check_tensors(run.schema):
            continue
        k = -(-step // every) * every
        for _ in range(CHECK_READS):
            if k not in run.trace:
                break
            found = checks.describe(run.manifest, run.schema, run.trace.read(k))
            if found is not None and found["checked"]:
                out[name] = found
                break
            k += every
    return out


def check_fault(checks: dict[str, dict], step: int | None) -> dict | None:
    """bisect's hardware verdict from the re-run checks (`rerun_checks`): one run's re-run named one
    bad chip and the other run's did not disagree. None otherwise (a transient the re-run cannot
    place, or both runs disagreeing: `replay verify` on each)."""
    found = {name: d for name, d in checks.items() if d["microbatches"]}
    if step is None or len(found) != 1:
        return None
    (name, d), = found.items()
    if len(d["bad_devices"]) != 1:
        return None
    device = d["bad_devices"][0]
    return {"device": device, "step": step, "microbatches": d["microbatches"], "layers": [], "run": name,
            "checked_step": d["step"],
            "line": f"hardware-like fault on device {device}: run {name}'s in-training re-run at step {d['step']} "
                    f"found it computing wrongly (a bad chip); the runs first differ at step {step}; not a software "
                    f"or data cause; `replay verify` on run {name} says since when"}
