"""`make(config)` checked while recording, so its bugs surface here and not at replay elsewhere.

At the first step of a new run (replay/record/run_start.py `start`, once the step's input
shapes are known) replay calls the entry point with the recorded config, as every replay will,
and checks that the `replay.Loop` it returns can rebuild this step: the Loop's state has the
tree, shapes and dtypes of the state the loop actually feeds (checkpoints are restored onto
it; for an NNX step, `Loop(nnx_step=...)`, the Variables of its nodes), and its `batch_at(first
step)` has the structure, shapes and dtypes of the batch fed. A
mismatch, or an exception inside `make`, is one RecordError line naming the user's function
and the first differing leaf.

Cost, once per run: one call of `make(config)`, an abstract evaluation of the Loop's state
(`jax.eval_shape` of `init`: nothing computed, nothing compiled) and one `batch_at` call. No
program is lowered or compiled: the step itself is not compared (a replay compares its program
hash, and an NNX module's mode, train or eval, is part of it), and a Loop fed by `data=` is not
pulled a batch (a fresh iterator can be costly to start). Shardings are not compared. The entry point is checked when given as a function, or as
"module:function" of a module this process has already imported.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

from replay.record.errors import RecordError
from replay.record.loop import Loop


def _resolve(entrypoint: str | Callable) -> Callable | None:
    if callable(entrypoint):
        return entrypoint
    module, _, attr = str(entrypoint).partition(":")
    fn = getattr(sys.modules.get(module), attr, None)  # never imports: the user named it, replay did not load it
    return fn if callable(fn) else None


def _name(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', getattr(fn, '__name__', 'make'))}"


def _brief(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}{': ' + text[:300] if text else ''}"


def check_entrypoint(entrypoint: str | Callable, config: Any, program: Any, first_step: int) -> None:
    """Raises RecordError when `entrypoint(config)` cannot rebuild the step `program` was compiled for."""
    make = _resolve(entrypoint)
    if make is None:
        return
    name = _name(make)
    where = f"replay.init(entrypoint={name})"
    try:
        loop = make(config)
    except RecordError as e:
        raise RecordError(f"{where}: {name}(config) raised: {e}") from None
    except Exception as e:  # noqa: BLE001 - the user's code: named, with its message
        raise RecordError(f"{where}: {name}(config) with the recorded config raised {_brief(e)}; every replay calls "
                          "it with this config to rebuild the loop, so fix it now") from e
    if not isinstance(loop, Loop):
        raise RecordError(f"{where}: {name}(config) returned {type(loop).__name__}, not a replay.Loop")
    state, batch = program.abstract
    try:
        theirs = loop.state_shapes()
    except Exception as e:  # noqa: BLE001
        raise RecordError(f"{where}: the state of {name}(config)'s Loop cannot be built: {_brief(e)}") from e
    mismatch = _first_difference(theirs, state)
    if mismatch:
        raise RecordError(f"{where}: the state {name}(config)'s Loop builds differs from the state this loop feeds "
                          f"its step: {mismatch}; replay restores checkpoints onto the Loop's state, so make it build "
                          "the same one")
    if loop.batch_at is not None:
        try:
            theirs = _specs(loop.batch_at(first_step))
        except Exception as e:  # noqa: BLE001
            raise RecordError(f"{where}: {name}(config)'s batch_at({first_step}) raised {_brief(e)}") from e
        mismatch = _first_difference(theirs, batch)
        if mismatch:
            raise RecordError(f"{where}: {name}(config)'s batch_at({first_step}) differs from the batch this loop "
                              f"feeds step {first_step}: {mismatch}; replay feeds batch_at(k), so make it return the "
                              "same batches")


def _specs(tree: Any) -> Any:
    import jax

    from replay.record.program import spec

    return jax.tree.map(spec, tree)


def _first_difference(theirs: Any, ours: Any) -> str | None:
    """The first leaf (in tree order) where the Loop's tree differs from the fed one, said in words."""
    import jax

    def flat(tree: Any) -> dict:
        return {jax.tree_util.keystr(p, simple=True, separator="."): x
                for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}

    a, b = flat(theirs), flat(ours)
    for path in list(b) + [p for p in a if p not in b]:
        if path not in a:
            return f"leaf {path or '(root)'} is fed but the Loop's has none"
        if path not in b:
            return f"the Loop's has leaf {path or '(root)'}, which is not fed"
        x, y = a[path], b[path]
        if tuple(x.shape) != tuple(y.shape) or str(x.dtype) != str(y.dtype):
            return f"leaf {path or '(root)'} is {_shape(x)} there, {_shape(y)} here"
    if jax.tree.structure(theirs) != jax.tree.structure(ours):
        return "the same leaves in another container structure"
    return None


def _shape(x: Any) -> str:
    return f"{x.dtype}[{', '.join(str(d) for d in x.shape)}]"
