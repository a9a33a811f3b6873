"""Recorded tensor names inside a pytree: a name is the path of a leaf, its keys joined by dots
("block_00.attn.q.kernel"), as the trainer names its parameters and gradients and as
`tree_leaves` (replay/engine/recompute.py) names a replay.init run's state. No JAX import.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def get_path(tree: Any, name: str) -> Any:
    """The leaf (or subtree) of `tree` at the dotted path `name`: a mapping by its key, a list or
    tuple by its index, anything else (a dataclass, a NamedTuple, a flax struct) by attribute.
    KeyError / IndexError / AttributeError when the tree has no such path."""
    for part in name.split("."):
        if isinstance(tree, Mapping):
            tree = tree[part]
        elif isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields") and part.isdigit():
            tree = tree[int(part)]
        else:
            tree = getattr(tree, part)
    return tree
