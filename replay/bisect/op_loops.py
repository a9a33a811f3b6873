"""Inside a `scan` or `while` whose outputs differ between two runs: the first iteration whose
outputs differ, and the first op of the loop body that differs at that iteration.

The step's every-op program (replay/bisect/op_program.py) holds a loop as one op: keeping every
iteration's intermediates would cost the loop's length times its body's. Instead, once the loop
is found to differ, both runs' bodies are run from the loop's inputs one iteration at a time
(one jitted body, shared when both runs' bodies are the same program; one dispatch an iteration,
up to the first differing one), and that iteration is searched as a step of its own
(first_op.first_differing_op on the body, its carry and slices as inputs): one more compile of a
body-sized program. A while loop whose runs stop at different iterations is searched in its
condition; one that agrees for MAX_ITERATIONS iterations is named as the loop itself.
"""

from __future__ import annotations

from typing import Any, Callable

MAX_ITERATIONS = 100_000


def _closed(jaxpr: Any) -> Any:
    """A loop body with its constants: a ClosedJaxpr before jax 0.12, a Jaxpr (which holds its
    constants itself) since."""
    from jax._src import core as jcore

    closed = getattr(jcore, "ClosedJaxpr", None)
    return jaxpr if closed is None or isinstance(jaxpr, closed) else closed(jaxpr, [])


def _fn(closed: Any) -> Callable:
    from jax._src import core as jcore

    return jcore.jaxpr_as_fun(_closed(closed))


def _scan_layout(params: dict) -> tuple[int, int, int]:
    """(constants, carries, length) of a scan's operands: named counts before jax 0.11, the leaf
    counts of its flat input trees (consts, carry, xs) since."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"], params["length"]
    consts, carry, _ = params["ft_in"].unpack()  # a FlatTree: iterating it gives its leaves
    return len(list(consts)), len(list(carry)), params["length"]


def _jitted(closed_a: Any, closed_b: Any, same: Callable[[Any, Any], bool]) -> tuple[Callable, Callable]:
    """Both runs' bodies jitted: one jit (one compile) when they are the same program."""
    import jax

    closed_a, closed_b = _closed(closed_a), _closed(closed_b)
    fa = jax.jit(_fn(closed_a))
    if str(getattr(closed_a, "jaxpr", closed_a)) == str(getattr(closed_b, "jaxpr", closed_b)) and len(closed_a.consts) == len(closed_b.consts) and all(
            same(x, y) for x, y in zip(closed_a.consts, closed_b.consts)):
        return fa, fa
    return fa, jax.jit(_fn(closed_b))


def search_loop(params: dict, primitive: str, ins: tuple[list, list], params_b: dict,
                same: Callable[[Any, Any], bool]) -> tuple[dict | None, int | None, int | None]:
    """(the first differing op inside the loop as first_differing_op reports it, or None; the
    iteration, in execution order; the loop's length when known). `ins`: each run's operands."""
    from replay.bisect.first_op import first_differing_op

    if primitive == "scan":
        return _scan(params, params_b, ins, same, first_differing_op)
    return _while(params, params_b, ins, same, first_differing_op)


def _scan(pa: dict, pb: dict, ins: tuple[list, list], same: Callable, search: Callable) -> tuple:
    nc, nk, length = _scan_layout(pa)
    if (nc, nk, length) != _scan_layout(pb):
        return None, None, length
    body_a, body_b = _jitted(pa["jaxpr"], pb["jaxpr"], same)
    (ca, ka, xa), (cb, kb, xb) = ((v[:nc], v[nc:nc + nk], v[nc + nk:]) for v in ins)
    for t in range(length):
        i = length - 1 - t if pa["reverse"] else t
        args_a = (*ca, *ka, *(x[i] for x in xa))
        args_b = (*cb, *kb, *(x[i] for x in xb))
        out_a, out_b = body_a(*args_a), body_b(*args_b)
        if not all(same(x, y) for x, y in zip(out_a, out_b)):
            return search(_fn(pa["jaxpr"]), _fn(pb["jaxpr"]), args_a, args_b), t, length
        ka, kb = out_a[:nk], out_b[:nk]
    return None, None, length


def _while(pa: dict, pb: dict, ins: tuple[list, list], same: Callable, search: Callable) -> tuple:
    import jax

    ncc, nbc = pa["cond_nconsts"], pa["body_nconsts"]
    if (ncc, nbc) != (pb["cond_nconsts"], pb["body_nconsts"]):
        return None, None, None
    cond_a, cond_b = _jitted(pa["cond_jaxpr"], pb["cond_jaxpr"], same)
    body_a, body_b = _jitted(pa["body_jaxpr"], pb["body_jaxpr"], same)
    (cca, bca, ka), (ccb, bcb, kb) = ((v[:ncc], v[ncc:ncc + nbc], v[ncc + nbc:]) for v in ins)
    for t in range(MAX_ITERATIONS):
        go_a, go_b = (bool(jax.device_get(c[0])) for c in (cond_a(*cca, *ka), cond_b(*ccb, *kb)))
        if go_a != go_b:  # the carries agree here: the condition itself reads what differs
            return search(_fn(pa["cond_jaxpr"]), _fn(pb["cond_jaxpr"]), (*cca, *ka), (*ccb, *kb)), t, None
        if not go_a:
            return None, None, t
        out_a, out_b = body_a(*bca, *ka), body_b(*bcb, *kb)
        if not all(same(x, y) for x, y in zip(out_a, out_b)):
            return search(_fn(pa["body_jaxpr"]), _fn(pb["body_jaxpr"]), (*bca, *ka), (*bcb, *kb)), t, None
        ka, kb = out_a, out_b
    return None, None, None
