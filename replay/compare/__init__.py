"""Checkpoint agreement: `replay compare A B --eval`.

Evaluates both runs' checkpoints at early, middle and late steps on the same held-out rows
(heldout.py), each run with its own framework's code (sides.py: the JAX trainer, or the torch
reference), and judges each step's eval-loss difference against the float32 noise floor measured
on the pair's own weights (floor.py). JAX vs JAX, torch vs JAX and torch vs torch. Two runs of a
JAX loop no plugin gives a PyTorch reference for are evaluated with the loop's own `evaluate` on
its `eval_batches`, the floor measured by moving their weights one ulp (jaxloop.py).

    report = compare_eval("runs/ref", "runs/port")           # steps: early, middle, late
    report.agree, report.rows[0].difference, report.to_json()

Cost at a million steps: opening the runs reads headers only; the held-out search is one trace-
index lookup a segment (heldout.py); per evaluated step, each checkpoint restored once and four
forward passes over the held-out rows (each framework's float32, the reference's float32 and
float64 for the floor). Nothing grows with the run's length but the checkpoint listing.
"""

from __future__ import annotations

import math

from replay.compare.errors import CompareInputError
from replay.compare.floor import tolerance
from replay.compare.heldout import held_out_rows
from replay.compare.report import EvalComparison, EvalRow, listing, pick_steps
from replay.compare.sides import open_side

DEFAULT_EXAMPLES = 64

__all__ = ["CompareInputError", "EvalComparison", "EvalRow", "compare_eval", "pick_steps"]


def compare_eval(path_a, path_b, *, steps: list[int] | None = None, examples: int | None = None,
                 on_step=None) -> EvalComparison:
    """Evaluates both runs at `steps` (default early/middle/late of their common checkpoints) on
    `examples` held-out rows (default DEFAULT_EXAMPLES; a JAX loop's are its eval_batches)."""
    from replay.compare.jaxloop import LoopSide, check_same_state, compare_loops

    a, b = open_side(path_a), open_side(path_b)
    loops = [isinstance(s, LoopSide) for s in (a, b)]
    if any(loops) and not all(loops):
        other, loop = (a, b) if loops[1] else (b, a)
        raise CompareInputError(f"{other.path} is compared through a PyTorch reference of its model and {loop.path} "
                                "(a JAX loop's run) has none; compare --eval compares two runs of one loop, or runs a "
                                "plugin's reference covers")
    if all(loops):
        if examples is not None:
            raise CompareInputError(f"--examples {examples}: a JAX loop's held-out examples are the ones its "
                                    "eval_batches() gives; drop --examples")
        check_same_state(a, b)
    elif _shape(a.cfg.model) != _shape(b.cfg.model):
        raise CompareInputError(f"{a.path} and {b.path} are different models (sizes differ); compare --eval compares "
                                "two runs of the same model")
    common = sorted(set(a.steps()) & set(b.steps()))
    if not common:
        raise CompareInputError(f"{a.path} (checkpoints {listing(a.steps())}) and {b.path} (checkpoints "
                                f"{listing(b.steps())}) have no checkpoint step in common; save checkpoints at the "
                                "same steps in both runs")
    chosen = pick_steps(common, steps)
    if all(loops):
        return compare_loops(a, b, chosen, on_step)
    examples = DEFAULT_EXAMPLES if examples is None else examples
    if examples < 1:
        raise CompareInputError(f"--examples {examples}: evaluate at least one example")
    rows, skipped = held_out_rows([a, b], examples, before_step=max(chosen))
    out = EvalComparison(str(a.path), str(b.path), a.framework, b.framework, len(rows), skipped)
    for k in chosen:
        la, lb = a.eval(k, rows).astype("float64"), b.eval(k, rows).astype("float64")
        ea, eb = a.rounding_error(k, rows), b.rounding_error(k, rows)
        mean_a, mean_b = float(la.mean()), float(lb.mean())
        if not (math.isfinite(mean_a) and math.isfinite(mean_b)):
            tol = 0.0
        else:
            tol = tolerance(ea, eb, mean_a)
        row = EvalRow(k, mean_a, mean_b, mean_b - mean_a, tol, ea, eb)
        out.rows.append(row)
        if on_step is not None:
            on_step(row)
    return out


def _shape(m) -> tuple:
    return (m.vocab_size, m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.d_ff, m.seq_len, m.tied_embeddings)
