"""The names people know for recorded tensors, in tables for people (the raw names stay in
`--json` and in the trace).

A `replay.init` run names a tensor by its pytree path: an in-place NNX step's state is the tuple
of its graph nodes' Variables, so its leaves read `state/0.conv.kernel.value` and
`update/1.opt_state.0.mu.conv.kernel.value`. Shown: `state/model.conv.kernel` and
`update/optimizer.opt_state.0.mu.conv.kernel`: a leaf's `.value` (an NNX Variable's payload, in
every path) is dropped, and the node's index becomes the name recorded for it in run.json's
`state_names` (replay/record/nnx_step.py: an nnx.Optimizer is "optimizer", the first other
module "model", further ones their class name). Cost: a string edit per name shown.
"""

from __future__ import annotations

from typing import Callable

STATE_NAMES_KEY = "state_names"  # run.json: {"0": "model", "1": "optimizer"} for an in-place NNX step's nodes


def namer(manifest: dict) -> Callable[[str], str]:
    """The display name of each raw tensor name of runs with this manifest."""
    labels = manifest.get(STATE_NAMES_KEY)
    labels = {str(k): str(v) for k, v in labels.items()} if isinstance(labels, dict) else {}

    def name(raw: str) -> str:
        if not isinstance(raw, str):
            return raw
        prefix, sep, path = raw.partition("/")
        if not sep:
            return raw
        parts = [p for p in path.split(".") if p != "value"] or [path]
        if prefix in ("state", "update") and parts[0] in labels:
            parts[0] = labels[parts[0]]
        return f"{prefix}/{'.'.join(parts)}"

    return name


def node_labels(nodes: tuple) -> dict[str, str]:
    """{index: label} of an in-place NNX step's state nodes (their order in the recorded state)."""
    labels, taken = {}, set()
    for i, node in enumerate(nodes):
        kind = type(node).__name__
        label = ("optimizer" if "Optimizer" in kind else "model" if "model" not in taken else kind.lower())
        if label in taken:
            label = f"{label}_{i}"
        taken.add(label)
        labels[str(i)] = label
    return labels
