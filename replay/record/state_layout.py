"""The state's layout as recorded: each leaf's sharding in words, so that a replay compiled for
another layout says which leaf moved instead of only "the program differs".

run.json "state_layout" ({leaf path: "P('data',) over data=4" | "one device" | "unplaced"}) is
written with the first step of a `run.step` run (replay/record/run.py), from the state the step was
compiled for. A with-code replay whose program hash differs compares it with the layout its own
program was compiled for (replay/cli/replaying.py), and the contract line names the first leaf
whose layout differs (replay/engine/contract.py `evaluate(program_reason=)`). Runs recorded
before this key, and exported replays (the recorded program itself), are not compared.

Cost: one line per state leaf in run.json, written once; a replay compares them once.
"""

from __future__ import annotations

from typing import Any

KEY = "state_layout"


def _words(sharding: Any) -> str:
    import jax

    if sharding is None:
        return "unplaced"
    if isinstance(sharding, jax.sharding.NamedSharding):
        mesh = ", ".join(f"{name}={size}" for name, size in sharding.mesh.shape.items())
        return f"{sharding.spec} over {mesh}"
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return "one device"
    return type(sharding).__name__


def describe(tree: Any) -> dict[str, str]:
    """{leaf path: its sharding in words} of a pytree of arrays or ShapeDtypeStructs."""
    import jax

    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(path, simple=True, separator="/"): _words(getattr(leaf, "sharding", None))
            for path, leaf in flat}


def first_difference(recorded: Any, here: dict[str, str] | None) -> str | None:
    """"the state's layout differs: LEAF recorded A, here B" for the first leaf (in the recorded
    order) whose layout differs, or None when they agree or either side is unknown."""
    if not isinstance(recorded, dict) or not here:
        return None
    for leaf, was in recorded.items():
        now = here.get(leaf)
        if now is not None and now != was:
            more = sum(1 for k, v in recorded.items() if here.get(k) not in (None, v)) - 1
            others = f" (and {more} more leaves)" if more > 0 else ""
            return f"the state's layout differs: {leaf} recorded {was}, here {now}{others}"
    return None
