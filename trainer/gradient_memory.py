"""The gradient memory one device keeps in mesh-invariant mode, read from the traced train step.

What a mesh-invariant step holds of the gradient between microbatches, per device, is the carry of
its microbatch scan (trainer/invariant.py: the Counter's partial sums, shards of G / n when the
microbatches are strided, whole partial sums when consecutive) and, after the scan, the reduced
gradient as it leaves the shard_map (this device's shard of rows, or the leaf whole where the
device count does not divide its rows). Both are read here from the program itself (the step's
jaxpr: the scan equation's carry and the shard_map body's outputs, per-device shapes), not from a
formula, so a change of the reduction shows up in them.

Not counted: one microbatch's backward (each leaf's gradient is whole once, a few at a time, and
its all_to_all shards; the activations), which is the same program on every device count and
is in XLA's temporaries (trainer/plan.py memory_per_device.temp). G here is the parameters'
bytes (the gradient has the parameters' dtype).

Cost: a walk over the step's equations, once per plan; nothing depends on a run's length.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def _bytes(avals) -> int:
    return sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in avals)


def _find_shard_map(jaxpr) -> Any | None:
    """The first shard_map equation in `jaxpr` or the jaxprs it calls (depth first)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "shard_map":
            return eqn
        for value in eqn.params.values():
            inner = getattr(value, "jaxpr", value)  # ClosedJaxpr -> Jaxpr
            if hasattr(inner, "eqns"):
                found = _find_shard_map(inner)
                if found is not None:
                    return found
    return None


def gradient_state(closed_jaxpr: Any, n_param_leaves: int, gradient_bytes: int) -> dict[str, Any] | None:
    """{"accumulators", "reduced", "total" (bytes per device), "in_gradients" (total / G),
    "microbatch_steps"} of a mesh-invariant step's jaxpr; None when it has no shard_map (a step
    that is not mesh-invariant). `n_param_leaves`: the parameter tree's leaf count (the gradient
    is the shard_map's last outputs); `gradient_bytes`: G."""
    eqn = _find_shard_map(closed_jaxpr.jaxpr)
    if eqn is None:
        return None
    body = eqn.params["jaxpr"]
    body = getattr(body, "jaxpr", body)
    reduced = _bytes(v.aval for v in body.outvars[-n_param_leaves:])
    scans = [e for e in body.eqns if e.primitive.name == "scan"]  # the first is the microbatch scan
    carry, steps = 0, None
    if scans:
        scan = scans[0]
        carry = _bytes(v.aval for v in scan.outvars[:scan.params["num_carry"]])
        steps = int(scan.params["length"])
    total = carry + reduced
    return {"accumulators": carry, "reduced": reduced, "total": total,
            "in_gradients": round(total / gradient_bytes, 4), "microbatch_steps": steps}
