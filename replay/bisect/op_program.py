"""A step's jaxpr as the list of ops first_op.py compares, and one jaxpr that returns every op's
outputs (replay/bisect/first_op.py's program).

Inner calls (`jit`, `closed_call`, `remat`, `custom_jvp_call`, `custom_vjp_call`) are inlined:
the step is evaluated, not differentiated, so a custom-derivative call computes its primal body
and its ops are named one by one. A `cond` is rewritten to return, besides its results, the
outputs of every op of every branch (each branch fills the other branches' slots with zeros, so
at most the cond's ops' outputs once per branch are held); which branch ran is read from its
index afterwards, so the search descends into the branch each run took. Literals inside a
branch become inputs of the cond, so two steps that differ only in a constant baked into a
branch (a learning-rate schedule inside optax.MultiSteps' cond) are still one program, the
constant one of its inputs. `scan` and `while` stay one op each here (their bodies run many
times, and holding every iteration's intermediates is what the cost promise rules out); a loop
that differs is searched afterwards, iteration by iteration (replay/bisect/op_loops.py).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import Any

_INLINE = ("pjit", "closed_call", "core_call", "jit", "custom_jvp_call", "custom_vjp_call", "remat2", "checkpoint")


@dataclass
class Op:
    primitive: str
    where: str
    inputs: list  # per input: ("arg", i) | ("const", i) | ("lit", value) | ("out", op index, output index)
    n_out: int
    frames: dict = field(default_factory=dict)  # "user" and "library": the op's innermost frames of each
    branches: list | None = None  # a cond's op indices per branch (None: one op)
    loop: dict | None = None  # a scan's or while's params (its body, its operands' layout)
    offset: int = 0  # where its outputs start among the program's outputs
    width: int = 0  # its outputs and those of every op inside it


_STDLIB = os.path.dirname(os.__file__) + os.sep
_LIBRARY_ROOTS = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep, _STDLIB)  # replay, stdlib


def _site(path: str) -> str | None:
    """`path` below its site-packages folder (optax/_src/schedule.py), or None."""
    for marker in ("site-packages" + os.sep, "dist-packages" + os.sep):
        if marker in path:
            return path.rsplit(marker, 1)[1]
    return None


def _library(path: str) -> str | None:
    """`path` as a library names it (optax/_src/schedule.py), or None for the user's own file."""
    site = _site(path)
    if site is not None:
        return site
    for root in _LIBRARY_ROOTS:
        if path.startswith(root):
            return os.path.relpath(path, os.path.dirname(root.rstrip(os.sep)))
    return None


@functools.lru_cache(maxsize=None)  # called for every frame of every op; a program has few distinct files
def _jax_internal(path: str) -> bool:
    """jax's own files and the standard library's. Not jax's `user_frames` filter: that one drops every
    file under the interpreter's stdlib folder, site-packages included when the packages are installed
    into the interpreter itself rather than a virtual environment (optax's frames then vanish)."""
    import jax

    if path.startswith(os.path.dirname(os.path.abspath(jax.__file__)) + os.sep):
        return True
    return path.startswith(_STDLIB) and _site(path) is None


def _frames(traceback: Any) -> list:
    """The traceback's frames, innermost first, without jax's own and the standard library's."""
    from jax._src import source_info_util

    code, lasti = traceback.raw_frames()
    return [source_info_util.raw_frame_to_frame(c, i) for c, i in zip(code, lasti)
            if not _jax_internal(c.co_filename)]


def _where(eqn: Any) -> tuple[str, dict]:
    """The op's location: its innermost frame in the user's files and its innermost library frame
    (optax, flax, replay; jax's own frames skipped), e.g. "linen_lm.py:120 (<lambda>), called from
    optax/_src/transform.py:88 (update_fn)" for a schedule the user wrote that optax calls."""
    info = eqn.source_info
    frames = _frames(info.traceback) if info is not None and info.traceback else []
    user = next((i for i, f in enumerate(frames) if _library(f.file_name) is None), None)
    lib = next((i for i, f in enumerate(frames) if _library(f.file_name) is not None), None)

    def loc(i: int, name: str) -> str:
        f = frames[i]
        return f"{name}:{f.start_line} ({f.function_name})"

    found = {}
    if user is not None:
        found["user"] = loc(user, frames[user].file_name.rsplit(os.sep, 1)[-1])
    if lib is not None:
        found["library"] = loc(lib, _library(frames[lib].file_name))
    stack = str(info.name_stack) if info is not None else ""
    text = found.get("user") or found.get("library") or "?"
    if "user" in found and "library" in found:
        text += f", {'in' if lib < user else 'called from'} {found['library']}"
    return f"{stack + ' ' if stack else ''}{text}", found


def _inner(eqn: Any) -> tuple[Any, list] | None:
    if eqn.primitive.name not in _INLINE:
        return None
    sub = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    if sub is None:
        return None
    return (sub.jaxpr, list(sub.consts)) if hasattr(sub, "consts") else (sub, [])


def _extended(aval: Any) -> bool:
    import jax

    dtype = getattr(aval, "dtype", None)
    return dtype is None or jax.dtypes.issubdtype(dtype, jax.dtypes.extended)


class Level:
    """One jaxpr being flattened: its eqns, every op's outputs in order, and its literal inputs,
    recorded as (eqn index, input index, Literal) at the top level and made inputs in a branch."""

    def __init__(self, ops: list[Op], hoist: bool):
        self.ops, self.hoist = ops, hoist
        self.eqns: list = []
        self.outs: list = []
        self.literals: list = []
        self.hoisted: list = []  # a branch's (Var, Literal) taken as inputs instead
        self.top: list[int] = []  # the indices of this level's own ops

    def append(self, eqn: Any) -> None:
        from jax._src import core as jcore
        from jax.extend import core

        invars = list(eqn.invars)
        for i, v in enumerate(invars):
            if not isinstance(v, core.Literal):
                continue
            if not self.hoist:
                self.literals.append((len(self.eqns), i, v))
            elif not _extended(v.aval):
                invars[i] = jcore.Var(v.aval)
                self.hoisted.append((invars[i], v))
        self.eqns.append(eqn.replace(invars=invars) if self.hoist else eqn)
        self.outs.extend(eqn.outvars)


def flatten(jaxpr: Any, var_env: dict, ref_env: dict, level: Level) -> tuple[list, list]:
    """Appends the ops of `jaxpr` (its constants and inputs bound in both envs) to `level`; returns
    its outputs as new vars and as refs."""
    from jax._src import core as jcore
    from jax.extend import core

    def sub(v: Any) -> Any:
        return v if isinstance(v, core.Literal) else var_env[v]

    def ref(v: Any) -> Any:
        return ("lit", v.val) if isinstance(v, core.Literal) else ref_env[v]

    for eqn in jaxpr.eqns:
        inner = _inner(eqn)
        if inner is not None:
            ij, consts = inner
            ve = {cv: core.Literal(c, cv.aval) for cv, c in zip(ij.constvars, consts)}
            re = {cv: ("lit", c) for cv, c in zip(ij.constvars, consts)}  # compared by value, as literals are
            ve.update(zip(ij.invars, [sub(v) for v in eqn.invars]))
            re.update(zip(ij.invars, [ref(v) for v in eqn.invars]))
            outs, refs = flatten(ij, ve, re, level)
            var_env.update(zip(eqn.outvars, outs))
            ref_env.update(zip(eqn.outvars, refs))
            continue
        k = len(level.ops)
        where, frames = _where(eqn)
        op = Op(eqn.primitive.name, where, [ref(v) for v in eqn.invars], len(eqn.outvars), frames,
                loop=dict(eqn.params) if eqn.primitive.name in ("scan", "while") else None)
        level.ops.append(op)
        level.top.append(k)
        invars = [sub(v) for v in eqn.invars]
        new = None
        if eqn.primitive.name == "cond":
            try:
                new = _cond(eqn, invars, op, level.ops)
            except Exception:  # noqa: BLE001 - a cond this cannot rewrite (effects, say) stays one op, as before
                new = None
        if new is None:  # dropped outputs too get a var: every one is returned
            new = eqn.replace(invars=invars, outvars=[jcore.Var(v.aval) for v in eqn.outvars])
        level.append(new)
        var_env.update(zip(eqn.outvars, new.outvars))
        ref_env.update((v, ("out", k, j)) for j, v in enumerate(eqn.outvars))
    return [sub(v) for v in jaxpr.outvars], [ref(v) for v in jaxpr.outvars]


def _cond(eqn: Any, invars: list, op: Op, ops: list[Op]) -> Any:
    """`eqn` (a cond) rewritten to return its results, then every op's outputs of branch 0, of
    branch 1, ...; None (it stays one op) when a branch holds a value that has no zero (a PRNG key)."""
    import jax
    import jax.numpy as jnp
    from jax._src import core as jcore
    from jax.extend import core

    branches, operand_refs = eqn.params["branches"], op.inputs[1:]
    levels = []
    for br in branches:
        lv = Level(ops, hoist=True)
        new_in = [jcore.Var(v.aval) for v in br.jaxpr.invars]
        ve = {cv: core.Literal(c, cv.aval) for cv, c in zip(br.jaxpr.constvars, br.consts)}
        re = {cv: ("lit", c) for cv, c in zip(br.jaxpr.constvars, br.consts)}
        ve.update(zip(br.jaxpr.invars, new_in))
        re.update(zip(br.jaxpr.invars, operand_refs))
        outs, _ = flatten(br.jaxpr, ve, re, lv)
        levels.append((lv, new_in, outs))
    if any(_extended(v.aval) for lv, _, _ in levels for v in lv.outs):
        return None
    lits = [lit for lv, _, _ in levels for _, lit in lv.hoisted]
    n_operands = len(invars) - 1

    def branch(i: int) -> Any:
        lv, new_in, outs = levels[i]
        start = sum(len(levels[j][0].hoisted) for j in range(i))
        body = jcore.Jaxpr([], [*new_in, *(v for v, _ in lv.hoisted)], [*outs, *lv.outs], lv.eqns,
                           jcore.join_effects(*(e.effects for e in lv.eqns)),
                           branches[i].jaxpr.debug_info.with_unknown_names())

        def run(*args: Any) -> list:
            mine = args[n_operands + start:n_operands + start + len(lv.hoisted)]
            values = jcore.eval_jaxpr(body, [], *args[:n_operands], *mine)
            result = list(values[:len(outs)])
            for j, (other, _, _) in enumerate(levels):
                result += values[len(outs):] if j == i else [jnp.zeros(v.aval.shape, v.aval.dtype) for v in other.outs]
            return result

        avals = [v.aval for v in invars[1:]] + [lit.aval for lit in lits]
        return jax.make_jaxpr(run)(*(jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in avals))

    extra = [jcore.Var(v.aval) for lv, _, _ in levels for v in lv.outs]
    new = eqn.replace(invars=[*invars, *lits], outvars=[*(jcore.Var(v.aval) for v in eqn.outvars), *extra],
                      params={**eqn.params, "branches": tuple(branch(i) for i in range(len(levels)))})
    op.branches = [lv.top for lv, _, _ in levels]
    return new


def place(ops: list[Op], indices: list[int], start: int) -> int:
    """Sets each op's offset and width (a cond's branches' ops follow its results); returns the end."""
    for k in indices:
        op = ops[k]
        op.offset, at = start, start + op.n_out
        for branch in op.branches or []:
            at = place(ops, branch, at)
        op.width, start = at - start, at
    return start


def trace(closed: Any) -> tuple[list[Op], list[int], Any, list]:
    """(ops, the top-level ops' indices, `closed.jaxpr` returning every op's outputs in op order,
    its literal inputs as (eqn index, input index, Literal))."""
    jaxpr = closed.jaxpr
    ops: list[Op] = []
    top = Level(ops, hoist=False)
    env = {v: v for v in [*jaxpr.constvars, *jaxpr.invars]}
    refs = {**{v: ("const", i) for i, v in enumerate(jaxpr.constvars)},
            **{v: ("arg", i) for i, v in enumerate(jaxpr.invars)}}
    flatten(jaxpr, env, refs, top)
    place(ops, top.top, 0)
    info = jaxpr.debug_info
    info = info._replace(result_paths=tuple(f"op {i}" for i in range(len(top.outs)))) if info is not None else None
    return ops, top.top, jaxpr.replace(outvars=top.outs, eqns=top.eqns, debug_info=info), top.literals
