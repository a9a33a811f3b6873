"""Is the donated state written in place? Read from the compiled program, never assumed.

A jit with `donate_argnums` only allows XLA to reuse the input buffers. It does so where the
compiled module's `input_output_alias` pairs a donated parameter with an output, and even then it
copies a parameter first (a `copy` of it in the entry computation) when something still reads
the old value after the new one is written in place: for the train step, a silent second copy
of the whole state (trainer/step.py explains the one case found). `check(compiled)` reads both
from the optimized HLO of the per-device program, for the entry parameters jit recorded under
the donated argument's name ("state"):

    aliased_leaves   donated parameters that input_output_alias pairs with an output
    copied_bytes     bytes of `copy` / `copy-start` instructions in the entry computation whose
                     operand is a donated parameter (per device)
    in_place         all but TOLERANCE of the donated bytes aliased and not copied (the step's
                     scalars, e.g. its counter, may be copied: a few bytes)

A copy hidden inside a fusion (a backend that fuses copies) is not seen in the text; the
runtime witness is (`buffer_pointers` before a step, `runtime_in_place` after it: did every
leaf come back in the very device buffer it went in? bench/accelerator.py asks it of the
accelerator's backend), and so are the memory analysis's temporaries (a copied state shows up
there in full).

It parses text, so it costs what the HLO's size costs (a few MB for a 7B step); nothing here
depends on the run's length.
"""

from __future__ import annotations

import math
import re
from typing import Any

_ALIAS = re.compile(r"\{([0-9, ]*)\}:\s*\((\d+),\s*\{([0-9, ]*)\},\s*(may-alias|must-alias)\)")
# %name = f32[64,32]{1,0} parameter(3), ..., metadata={op_name="state.params['embed']"}
_PARAM = re.compile(r"^\s*%?([\w.\-]+)\s*=\s*(\w+)\[([0-9,]*)\]\S*\s+parameter\((\d+)\)(.*)$", re.M)
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_COPY = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*\w+\[[0-9,]*\]\S*\s+(copy|copy-start)\(([^)]*)\)", re.M)
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
          "s64": 8, "u64": 8, "f64": 8}
TOLERANCE = 0.01  # copied or unaliased share of the donated bytes still called "in place" (scalars)


def _header(hlo: str) -> str:
    """The HloModule line (where input_output_alias is printed)."""
    start = hlo.find("HloModule")
    return hlo[start:hlo.find("\n", start)] if start >= 0 else ""


def _entry(hlo: str) -> str:
    start = hlo.find("\nENTRY")
    if start < 0:
        return ""
    end = hlo.find("\n}", start)
    return hlo[start:end if end >= 0 else len(hlo)]


def aliases(hlo: str) -> dict[int, str]:
    """{parameter number: "may-alias" | "must-alias"} of the parameters aliased with an output
    (whole parameters only: jit flattens its arguments, so none is a tuple)."""
    header = _header(hlo)
    start = header.find("input_output_alias=")
    if start < 0:
        return {}
    return {int(param): kind for _, param, _, kind in _ALIAS.findall(header[start:])}


def parameters(hlo: str) -> dict[int, tuple[str, str, int]]:
    """{parameter number: (HLO name, the argument path jit recorded as op_name, bytes per device)}
    of the entry computation. jit drops unused arguments, so numbers are not leaf indices: the
    op_name ("state.params['embed']['embedding']") says which leaf a parameter is."""
    out = {}
    for name, dtype, dims, num, rest in _PARAM.findall(_entry(hlo)):
        op = _OP_NAME.search(rest)
        size = math.prod(int(d) for d in dims.split(",") if d) * _BYTES.get(dtype, 4)
        out[int(num)] = (name, op.group(1).replace("\\'", "'") if op else "", size)
    return out


def copied_parameters(hlo: str, params: dict[int, tuple[str, str, int]]) -> dict[int, int]:
    """{parameter number: bytes} of the entry computation's copies of `params` (`parameters()` items)."""
    by_name = {name: num for num, (name, _, _) in params.items()}
    out: dict[int, int] = {}
    for _, operands in _COPY.findall(_entry(hlo)):
        operand = operands.split(",")[0].split()[-1].lstrip("%") if operands.strip() else ""
        if operand in by_name:
            num = by_name[operand]
            out[num] = out.get(num, 0) + params[num][2]
    return out


def _is_under(op_name: str, prefix: str) -> bool:
    return op_name == prefix or op_name.startswith((prefix + ".", prefix + "["))


def check(compiled: Any, donated: str = "state") -> dict[str, Any]:
    """Whether the donated argument named `donated` (its Python parameter name, as jit records
    it) of `compiled` (a jax.stages.Compiled, or its optimized HLO text) is written in place.
    in_place: every donated parameter aliased with an output and none copied, but for at most
    TOLERANCE of its bytes (the step's scalars: a copy of a few bytes changes nothing)."""
    hlo = compiled if isinstance(compiled, str) else compiled.as_text()
    params = {num: p for num, p in parameters(hlo).items() if _is_under(p[1], donated)}
    aliased = aliases(hlo)
    copies = copied_parameters(hlo, params)
    unaliased = sorted(num for num in params if num not in aliased)
    total = sum(size for _, _, size in params.values())
    unaliased_bytes = sum(params[num][2] for num in unaliased)
    copied = sum(copies.values())
    return {
        "donated_leaves": len(params),  # those the program reads (jit drops unused ones)
        "donated_bytes": int(total),
        "aliased_leaves": len(params) - len(unaliased),
        "unaliased_bytes": int(unaliased_bytes),
        "copied_bytes": int(copied),
        "unaliased": [params[num][1] for num in unaliased][:10],
        "copied": [params[num][1] for num in sorted(copies, key=copies.get, reverse=True)][:10],
        "in_place": bool(params) and unaliased_bytes + copied <= TOLERANCE * total,
    }


def buffer_pointers(tree: Any) -> list[tuple[tuple[int, ...], int]]:
    """(device buffer addresses of its addressable shards, bytes) of every array leaf of `tree`."""
    import jax

    out = []
    for leaf in jax.tree.leaves(tree):
        shards = getattr(leaf, "addressable_shards", None)
        if not shards:
            continue
        out.append((tuple(s.data.unsafe_buffer_pointer() for s in shards), int(leaf.nbytes)))
    return out


def runtime_in_place(before: list[tuple[tuple[int, ...], int]], after: list[tuple[tuple[int, ...], int]]) -> dict:
    """Which leaves of a state came back in the very buffers they went in (buffer_pointers of the
    state before a donating step and of the state it returned, leaf for leaf): the backend's own
    word on the copy, where the HLO text can miss one (a copy fused away into another op)."""
    total = sum(n for _, n in before)
    same = sum(n for (pa, n), (pb, _) in zip(before, after) if pa == pb)
    return {"leaves": len(before), "leaves_in_place": sum(pa == pb for (pa, _), (pb, _) in zip(before, after)),
            "bytes": total, "bytes_in_place": same, "in_place": bool(total) and same >= (1 - TOLERANCE) * total}
