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
input of the step (the state, the batch) names that input: the op's own operands, traced through
the jaxpr ("differing_operands"), so a matmul is never said to read a parameter it does not. An op
inside a loop body names the differing step inputs the loop is fed.

Inner calls (`jit`, `remat`, `custom_jvp`/`custom_vjp` bodies: the step is evaluated, not
differentiated) are inlined and their ops named one by one; the search descends into the branch
of a `cond` (`lax.cond`, `lax.switch`, optax.MultiSteps' accumulation) that both runs took, and
names the cond itself when they took different branches (replay/bisect/op_program.py). A `scan`
or `while` is one op of the program; when it differs, both runs' bodies are run from its inputs
one iteration at a time to the first differing iteration, which is searched as a step of its
own (replay/bisect/op_loops.py; "inside" names each enclosing cond and loop, with the branch or
iteration). A cond or loop this cannot take apart (effects in a branch, a body that does not run
alone) is named as one op, as before. An op's location names the user's innermost line and the
library's (`linen_lm.py:146 (<lambda>), called from optax/_src/transform.py:1004 (...)`).
The programs are not the step's own compiled program, so their bits need not equal the step's;
both runs go through the same construction, so what differs between them is what their inputs,
constants and code make differ. Cost: one compile of a program the size of the step (a cond's
branches each once, as in the step) when the two steps are one program up to their inputs and
literal constants (the same code, or another config value baked in, in a cond's branch too), two
otherwise, plus, for a differing loop, its body compiled alone and as an every-op program (a
body's size each) and one dispatch per iteration up to the first differing one; every
intermediate of one step on the host (about the step's activation memory; a
cond's untaken branches as zeros of their ops' shapes), once, for the step bisect found; never
proportional to the run's length.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from replay.bisect.op_loops import search_loop
from replay.bisect.op_program import Op, trace


def _bits(x: Any) -> bytes:
    import jax

    if hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    a = np.asarray(x)
    return a.dtype.str.encode() + str(a.shape).encode() + a.tobytes()

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
        self.ops, self.top, self.jaxpr, self.literals = trace(closed)
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
    when every op agrees. Each step is traced with its own code. An op inside a `cond` is named
    with the conds it is in ("inside": each one's location and the branch both runs took)."""
    import jax

    a, b = _Side(step_a, args_a), _Side(step_b, args_b)
    outs = _outputs(a, b)
    paths = [jax.tree_util.keystr(p, simple=True, separator=".") or "input"
             for p, _ in jax.tree_util.tree_flatten_with_path(args_a)[0]]
    first_input = next((p for p, x, y in zip(paths, a.flat, b.flat) if _bits(x) != _bits(y)), None)
    search = _Search(a, b, outs, first_input, paths)
    found = search.level(a.top, b.top, [])
    if found is not None:
        return found
    if len(a.top) != len(b.top):
        return {"op": None, "ops_compared": search.compared,
                "reason": f"the two steps have {len(a.top)} and {len(b.top)} operations (different code)"}
    return {"op": None, "ops_compared": search.compared, "reason": "every op agrees bit for bit"}


class _Search:
    """Both steps' ops walked in program order, into the branch of each cond both runs took."""

    def __init__(self, a: _Side, b: _Side, outs: tuple[list, list], first_input: str | None, paths: list[str]):
        self.a, self.b, self.outs, self.first_input, self.compared = a, b, outs, first_input, 0
        self.paths = paths  # the step's flattened inputs, as named in reports

    def value(self, side: int, ref: tuple) -> Any:
        s = (self.a, self.b)[side]
        return _resolve(ref, s.ops, self.outs[side], s.consts, s.flat)

    def level(self, top_a: list[int], top_b: list[int], inside: list) -> dict | None:
        for ka, kb in zip(top_a, top_b):
            oa, ob = self.a.ops[ka], self.b.ops[kb]
            self.compared += 1
            if oa.primitive != ob.primitive or oa.n_out != ob.n_out:
                return {"op": oa.primitive, "op_b": ob.primitive, "where": oa.where, "where_b": ob.where,
                        "ops_compared": self.compared, "inside": inside,
                        "reason": "the two steps run different operations here (different code)"}
            va = self.outs[0][oa.offset:oa.offset + oa.n_out]
            vb = self.outs[1][ob.offset:ob.offset + ob.n_out]
            if all(_bits(x) == _bits(y) for x, y in zip(va, vb)):
                continue
            if oa.branches is not None and ob.branches is not None:
                ia, ib = (_branch(self.value(s, o.inputs[0]), len(o.branches)) for s, o in ((0, oa), (1, ob)))
                if ia == ib:
                    where = {"op": "cond", "where": oa.where, "branch": ia, "of": len(oa.branches)}
                    found = self.level(oa.branches[ia], ob.branches[ib], [*inside, where])
                    if found is not None:
                        return found
                else:
                    return self.named(oa, ob, va, inside, f"the two runs take different branches of this cond "
                                      f"(A branch {ia}, B branch {ib} of {len(oa.branches)}): ")
            if oa.loop is not None and ob.loop is not None:
                ins = ([self.value(0, r) for r in oa.inputs], [self.value(1, r) for r in ob.inputs])
                try:
                    inner, t, length = search_loop(oa.loop, oa.primitive, ins, ob.loop,
                                                   lambda x, y: _bits(x) == _bits(y))
                except Exception:  # noqa: BLE001 - a loop its body cannot be run alone from: named as one op
                    inner = None
                if inner is not None and inner.get("op") is not None:
                    return self.within(inner, oa, ob, inside, {"op": oa.primitive, "where": oa.where, "iteration": t,
                                                           "of": length})
            return self.named(oa, ob, va, inside, "")

    def reason(self, same: bool, read: str | None = None, others: int = 0) -> str:
        """Why the op differs; `read`: the differing step input among its own operands (None: only
        constants among them differ), `others`: how many more of its operands are differing inputs."""
        if same:
            return "its inputs are equal in both runs and its outputs are not: the op itself computes differently " \
                   "(its parameters or code)"
        if read is None:
            return "the step's inputs it reads are equal; this op is the first fed a constant that differs between " \
                   "the two steps (a value the code or config bakes in, e.g. a learning rate)"
        more = f" (and {others} more of its operands)" if others else ""
        return f"it reads the step's input {read}{more}, which differs; this is the first op that reads a difference"

    def operands(self, oa: Op, ob: Op, ins_a: list | None = None, ins_b: list | None = None) -> list[dict]:
        """The op's operands that differ between the runs, each with where it comes from: a step
        input (its path), a constant, or an earlier op's output (an op inside a cond or loop whose
        own outputs differ only there). Traced through the jaxpr, so these are what the op reads.
        ins_a, ins_b: the operands' values where the caller has them already."""
        ins_a = [self.value(0, r) for r in oa.inputs] if ins_a is None else ins_a
        ins_b = [self.value(1, r) for r in ob.inputs] if ins_b is None else ins_b
        found = []
        for i, (ra, xa, xb) in enumerate(zip(oa.inputs, ins_a, ins_b)):
            if _bits(xa) == _bits(xb):
                continue
            if ra[0] == "arg":
                found.append({"operand": i, "input": self.paths[ra[1]]})
            elif ra[0] == "out":
                made = self.a.ops[ra[1]]
                found.append({"operand": i, "input": None, "from_op": f"{made.primitive} at {made.where}"})
            else:
                found.append({"operand": i, "input": None, "constant": True})
        return found

    def within(self, inner: dict, loop: Op, loop_b: Op, inside: list, entry: dict) -> dict:
        """`inner` (found in a loop body searched as a step) as an op of this step."""
        inner["where"] += _inside([entry, *reversed(inside)])
        inner["inside"] = [*inside, entry, *inner.get("inside", [])]
        inner["ops_compared"] += self.compared
        if "same_inputs" in inner:  # the body's inputs are the loop's: what differs there is the step's
            # The body read a differing value of the loop's carry or operands: name the step inputs the
            # loop itself is fed that differ (its operands, traced through the jaxpr).
            fed = [o["input"] for o in self.operands(loop, loop_b) if o["input"] is not None]
            read = (fed[0] if fed else self.first_input) if inner.get("first_differing_input") is not None else None
            inner["first_differing_input"], inner["reason"] = read, self.reason(inner["same_inputs"], read)
        return inner

    def named(self, oa: Op, ob: Op, va: list, inside: list, why: str) -> dict:
        ins_a = [self.value(0, r) for r in oa.inputs]
        ins_b = [self.value(1, r) for r in ob.inputs]
        same = len(ins_a) == len(ins_b) and all(_bits(x) == _bits(y) for x, y in zip(ins_a, ins_b))
        operands = [] if same else self.operands(oa, ob, ins_a, ins_b)
        read = [o["input"] for o in operands if o["input"] is not None]
        reason = self.reason(same, read[0] if read else None, len(read) - 1)
        where = oa.where + _inside(reversed(inside))
        return {"op": oa.primitive, "where": where, "user_frame": oa.frames.get("user"),
                "library_frame": oa.frames.get("library"), "inside": inside, "same_inputs": same,
                "first_differing_input": read[0] if read else None, "differing_operands": operands,
                "shape": list(np.shape(va[0])),
                "dtype": str(np.asarray(va[0]).dtype), "ops_compared": self.compared, "reason": why + reason}


def _inside(entries: Any) -> str:
    """", inside cond at WHERE (branch 1 of 2), inside scan at WHERE (iteration 3 of 8)", innermost first."""
    text = ""
    for c in entries:
        at = (f"branch {c['branch']} of {c['of']}" if "branch" in c else
              f"iteration {c['iteration']}" + (f" of {c['of']}" if c.get("of") is not None else ""))
        text += f", inside {c['op']} at {c['where']} ({at})"
    return text


def _branch(index: Any, n: int) -> int:
    return int(np.clip(int(np.asarray(index)), 0, n - 1))  # lax.cond clamps its index so


def _resolve(ref: tuple, ops: list[Op], outs: list, consts: list, flat: list) -> Any:
    kind = ref[0]
    if kind == "lit":
        return ref[1]
    if kind == "arg":
        return flat[ref[1]]
    if kind == "const":
        return consts[ref[1]]
    if kind == "out":
        return outs[ops[ref[1]].offset + ref[2]]
    raise ValueError(f"unknown input reference {ref!r}")
