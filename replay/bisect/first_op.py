"""The first operation where two runs' steps part: both steps traced to jaxprs, every op's outputs
computed and compared bit for bit, in program order.

Taps and fingerprints name the first differing *tensor* a loop records; this names the first
differing *op*, for any JAX loop (linen, NNX, Equinox, plain), without hooks in the user's
model: the step is what JAX traces, so its jaxpr holds every op the step runs, forward,
backward and update, in program order, each with the user's source line. Each step's jaxpr is
re-emitted as one jitted program that returns every op's outputs (one run per side, not one
dispatch per op; one compile for both when they are one program up to constants, see Cost).
An op whose inputs are equal in both runs but whose outputs are not computes differently (its
parameters or code); one whose inputs differ only because a constant baked into the step
differs (a learning rate, a flag, an array closed over) is named as such; one fed a differing
input of the step (the state, the batch) names that input.

Inner `jit`s are inlined (their ops are named one by one); control flow (`scan`, `while`,
`cond`) and custom-derivative calls are one op each. The programs are not the step's own
compiled program, so their bits need not equal the step's; both runs go through the same
construction, so what differs between them is what their inputs, constants and code make
differ. Cost: one compile of a program the size of the step when the two steps are one program
up to their inputs and literal constants (the same code, or another config value baked in), two
otherwise; every intermediate of one step on the host (about the step's activation memory),
once, for the step bisect found; never proportional to the run's length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

_INLINE = ("pjit", "closed_call", "core_call", "jit")


@dataclass
class _Op:
    primitive: str
    where: str
    inputs: list  # per input: ("arg", i) | ("const", i) | ("lit", value) | ("out", op index, output index)
    n_out: int


def _where(eqn: Any) -> str:
    from jax._src import source_info_util

    info = eqn.source_info
    frame = source_info_util.user_frame(info.traceback) if info is not None else None
    stack = str(info.name_stack) if info is not None else ""
    loc = f"{frame.file_name.rsplit('/', 1)[-1]}:{frame.start_line} ({frame.function_name})" if frame else "?"
    return f"{stack + ' ' if stack else ''}{loc}"


def _bits(x: Any) -> bytes:
    import jax

    if hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    a = np.asarray(x)
    return a.dtype.str.encode() + str(a.shape).encode() + a.tobytes()


def _emit(closed: Any) -> list[_Op]:
    """The ops of `closed`, inner jits inlined, in the order _all_outputs returns their outputs."""
    from jax.extend import core

    ops: list[_Op] = []

    def walk(jaxpr: Any, refs: list, inner_refs_out: list) -> None:
        """Describes the ops of `jaxpr` whose constants, then inputs, are `refs`; appends its outputs' refs."""
        env: dict = dict(zip([*jaxpr.constvars, *jaxpr.invars], refs))

        def ref(v: Any) -> Any:
            return ("lit", v.val) if isinstance(v, core.Literal) else env[v]

        for eqn in jaxpr.eqns:
            ins = [ref(v) for v in eqn.invars]
            if eqn.primitive.name in _INLINE and "jaxpr" in eqn.params:
                sub = eqn.params["jaxpr"]
                sub_consts = [("lit", c) for c in sub.consts]  # compared by value, as literals are
                outs: list = []
                walk(sub.jaxpr, [*sub_consts, *ins], outs)
                for v, r in zip(eqn.outvars, outs):
                    env[v] = r
                continue
            k = len(ops)
            ops.append(_Op(eqn.primitive.name, _where(eqn), ins, len(eqn.outvars)))
            for j, v in enumerate(eqn.outvars):
                env[v] = ("out", k, j)
        inner_refs_out.extend(ref(v) for v in jaxpr.outvars)

    jaxpr = closed.jaxpr
    walk(jaxpr, [("const", i) for i in range(len(jaxpr.constvars))] + [("arg", i) for i in range(len(jaxpr.invars))], [])
    return ops


def _all_outputs(jaxpr: Any) -> tuple[Any, list]:
    """(`jaxpr` with inner jits inlined and every op's outputs as its outputs, in op order; its
    literal inputs in order, as (eqn index, input index, Literal))."""
    from jax._src import core as jcore
    from jax.extend import core

    eqns, outs, literals = [], [], []

    def inline(j: Any, env: dict) -> list:
        def sub(v: Any) -> Any:
            return v if isinstance(v, core.Literal) else env.get(v, v)

        for eqn in j.eqns:
            if eqn.primitive.name in _INLINE and "jaxpr" in eqn.params:
                closed = eqn.params["jaxpr"]
                inner_env = dict(zip(closed.jaxpr.invars, [sub(v) for v in eqn.invars]))
                for cv, c in zip(closed.jaxpr.constvars, closed.consts):
                    inner_env[cv] = core.Literal(c, cv.aval)
                results = inline(closed.jaxpr, inner_env)
                for v, r in zip(eqn.outvars, results):
                    env[v] = r
                continue
            new_outvars = [jcore.Var(v.aval) for v in eqn.outvars]  # dropped outputs too: every one is returned
            for v, nv in zip(eqn.outvars, new_outvars):
                env[v] = nv
            invars = [sub(v) for v in eqn.invars]
            literals.extend((len(eqns), i, v) for i, v in enumerate(invars) if isinstance(v, core.Literal))
            eqns.append(eqn.replace(invars=invars, outvars=new_outvars))
            outs.extend(new_outvars)
        return [sub(v) for v in j.outvars]

    inline(jaxpr, {})
    info = jaxpr.debug_info
    info = info._replace(result_paths=tuple(f"op {i}" for i in range(len(outs)))) if info is not None else None
    return jaxpr.replace(outvars=outs, eqns=eqns, debug_info=info), literals


def _lifted(jaxpr: Any, literals: list, which: list[int]) -> Any:
    """`jaxpr` with the literal inputs `literals[i]`, i in `which`, turned into inputs (first, in
    that order): two steps that differ only in such constants run one program, fed each its own."""
    from jax._src import core as jcore

    if not which:
        return jaxpr
    new = {}
    for i in which:
        at, j, lit = literals[i]
        new[(at, j)] = jcore.Var(lit.aval)
    eqns = [eqn.replace(invars=[new.get((k, j), v) for j, v in enumerate(eqn.invars)]) if any((k, j) in new for j in
            range(len(eqn.invars))) else eqn for k, eqn in enumerate(jaxpr.eqns)]
    info = jaxpr.debug_info
    if info is not None and info.arg_names is not None:
        info = info._replace(arg_names=(*(f"constant {i}" for i in which), *info.arg_names))
    return jaxpr.replace(invars=[*(new[literals[i][:2]] for i in which), *jaxpr.invars], eqns=eqns, debug_info=info)


def _liftable(lit: Any) -> bool:
    import jax

    dtype = getattr(lit.aval, "dtype", None)
    return dtype is not None and not jax.dtypes.issubdtype(dtype, jax.dtypes.extended)


def _literal_value(lit: Any) -> np.ndarray:
    return np.asarray(lit.val, dtype=lit.aval.dtype)


# Every op's outputs are the program's outputs, so XLA's optimizations have little to work on and
# cost most of the compile: measured 7.0 s at the default level, 2.2 s with these, for the
# 415 ops of examples/optax_loop.py's step. Both runs' programs are compiled alike.
_FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


class _Side:
    """One step traced: its jaxpr with every op's outputs, its ops, constants and flat inputs."""

    def __init__(self, step: Callable, args: tuple):
        import jax

        closed = jax.make_jaxpr(step)(*args)
        self.flat = jax.tree.leaves(args)
        self.consts = list(closed.consts)
        self.ops = _emit(closed)
        self.jaxpr, self.literals = _all_outputs(closed.jaxpr)
        self.const_avals = tuple((np.shape(c), str(np.asarray(c).dtype)) for c in self.consts)

    def template(self) -> tuple:
        """What the program is, its literal inputs' values aside (their types are in it)."""
        return str(_lifted(self.jaxpr, self.literals, list(range(len(self.literals))))), self.const_avals

    def values(self, compiled: Any, which: list[int]) -> list:
        """Every op's outputs on the host, from `compiled` (this step's program with the literals
        `which` as its first inputs)."""
        import jax

        lifted = [_literal_value(self.literals[i][2]) for i in which]
        return list(jax.device_get(compiled(*self.consts, *lifted, *self.flat)))

    def compile(self, which: list[int]) -> Any:
        import jax
        from jax._src import core as jcore

        jaxpr, n = _lifted(self.jaxpr, self.literals, which), len(self.consts)
        lifted = [_literal_value(self.literals[i][2]) for i in which]

        def every_op(*values: Any) -> list:
            return jcore.eval_jaxpr(jaxpr, values[:n], *values[n:])

        lowered = jax.jit(every_op).lower(*self.consts, *lifted, *self.flat)
        try:
            return lowered.compile(compiler_options=_FAST_COMPILE)
        except Exception:  # noqa: BLE001 - a backend without these options: its default compile
            return lowered.compile()


def _outputs(a: _Side, b: _Side) -> tuple[list, list]:
    """Every op's outputs of both steps. Steps that are one program up to the values of some
    literal constants (the same code, other data or state, or another config value baked in as a
    literal: a learning rate, a step number) share one compile, the differing constants its inputs
    (an op computes the same bits from a value whether it is baked in or fed); literals equal in
    both stay baked in, as in a step compiled alone."""
    if a.template() == b.template():
        which = [i for i, (x, y) in enumerate(zip(a.literals, b.literals)) if _bits(x[2].val) != _bits(y[2].val)]
        if all(_liftable(a.literals[i][2]) for i in which):
            compiled = a.compile(which)
            return a.values(compiled, which), b.values(compiled, which)
    return a.values(a.compile([]), []), b.values(b.compile([]), [])


def first_differing_op(step_a: Callable, step_b: Callable, args_a: tuple, args_b: tuple) -> dict:
    """{"op", "where", "same_inputs", "reason", "ops_compared", ...} of the first op of
    `step_a(*args_a)` vs `step_b(*args_b)` whose outputs differ bit for bit, or {"op": None}
    when every op agrees. Each step is traced with its own code."""
    import jax

    a, b = _Side(step_a, args_a), _Side(step_b, args_b)
    outs_a, outs_b = _outputs(a, b)
    ops_a, consts_a, flat_a, ops_b, consts_b, flat_b = a.ops, a.consts, a.flat, b.ops, b.consts, b.flat
    at_a = at_b = 0
    for i, (oa, ob) in enumerate(zip(ops_a, ops_b)):
        if oa.primitive != ob.primitive or oa.n_out != ob.n_out:
            return {"op": oa.primitive, "op_b": ob.primitive, "where": oa.where, "where_b": ob.where, "ops_compared": i,
                    "reason": "the two steps run different operations here (different code)"}
        va, vb = outs_a[at_a:at_a + oa.n_out], outs_b[at_b:at_b + ob.n_out]
        at_a, at_b = at_a + oa.n_out, at_b + ob.n_out
        if all(_bits(x) == _bits(y) for x, y in zip(va, vb)):
            continue
        ins_a = [_resolve(r, ops_a, outs_a, consts_a, flat_a) for r in oa.inputs]
        ins_b = [_resolve(r, ops_b, outs_b, consts_b, flat_b) for r in ob.inputs]
        same = len(ins_a) == len(ins_b) and all(_bits(x) == _bits(y) for x, y in zip(ins_a, ins_b))
        paths = [jax.tree_util.keystr(p, simple=True, separator=".") or "input"
                 for p, _ in jax.tree_util.tree_flatten_with_path(args_a)[0]]
        first_input = next((p for p, x, y in zip(paths, flat_a, flat_b) if _bits(x) != _bits(y)), None)
        if same:
            reason = "its inputs are equal in both runs and its outputs are not: the op itself computes differently " \
                     "(its parameters or code)"
        elif first_input is None:
            reason = "the step's inputs are equal; this op is the first fed a constant that differs between the two " \
                     "steps (a value the code or config bakes in, e.g. a learning rate)"
        else:
            reason = f"the step's input {first_input} differs; this is the first op that reads the difference"
        return {"op": oa.primitive, "where": oa.where, "same_inputs": same, "first_differing_input": first_input,
                "shape": list(np.shape(va[0])), "dtype": str(np.asarray(va[0]).dtype), "ops_compared": i + 1,
                "reason": reason}
    if len(ops_a) != len(ops_b):
        return {"op": None, "ops_compared": min(len(ops_a), len(ops_b)),
                "reason": f"the two steps have {len(ops_a)} and {len(ops_b)} operations (different code)"}
    return {"op": None, "ops_compared": len(ops_a), "reason": "every op agrees bit for bit"}


def _resolve(ref: tuple, ops: list[_Op], outs: list, consts: list, flat: list) -> Any:
    kind = ref[0]
    if kind == "lit":
        return ref[1]
    if kind == "arg":
        return flat[ref[1]]
    if kind == "const":
        return consts[ref[1]]
    if kind == "out":
        start = sum(op.n_out for op in ops[:ref[1]])
        return outs[start + ref[2]]
    raise ValueError(f"unknown input reference {ref!r}")
