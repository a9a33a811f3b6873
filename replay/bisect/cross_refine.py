"""The op inside the layer: once the cross-framework scan (replay/bisect/cross.py) has the first
step and the first forward layer above the noise floor, that step's forward is run again on
both sides with every point inside the layer's block captured, and the first point in forward
order above the floor is named (q/k/v projection, QK-norm, rotary, softmax, merged heads, o
projection, gate/up, SwiGLU, down, the branch norms, the residual sum). Nothing more is recorded
per step: this costs one replay, at bisect time.

- JAX side: the run replayed to the state entering the step (its newest checkpoint at or before
  it, then its steps), the forward recomputed with the block's intermediates through the loop's
  `recompute_step` capability (`intermediates(block)`, replay/engine/recompute.py).
- torch side: the run's reference model from the plugin hook `torch_reference(run)` (the one
  `replay compare --eval` uses; the trainer's is trainer/replay_reference.py) and its optional
  capability `fine_forward(model, step, block) -> {point: array in the JAX side's layout}` (with
  `op_text(point)` for the report). Weights: the torch run's own checkpoint entering the step when
  it saved one, checked against what the run recorded at that step (the re-run's layer outputs
  against the recorded sketches, within the floor, or nothing is named); else the JAX side's
  parameters at the step (the scan found the state within the floor there), said in a note.
- distance: the exact relative distance of the two full tensors (traces.sketch), judged against
  the step's forward floor (replay/bisect/cross_floor.py). Measured on the clean demo pair
  (2026-12-05, this machine's CPU): every point of block_00 and block_01 at steps 0..7 (torch
  checkpoints at even steps, the JAX weights at odd ones) within 0.089 of it, as the layer level
  (0.095); the port bugs' ops 7e3 x (SwiGLU swapped) to 1.7e5 x (heads merged) above it.
- the attention probabilities, when they are the first point: a key one side gives weight
  exactly 0 and the other does not reads as the mask; the same zeros, as the softmax's scale.

A layer outside any block (embed, final_norm, logits) is its own op. When the torch run cannot be
re-run (no plugin knows it, no capability, no replay of the JAX run), one note says why and the
answer stays the layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from replay.bisect.cross_floor import TRAINER, Floor
from replay.errors import ReplayUnavailable, user_error_code
from traces import Run
from traces.sketch import exact_relative_distance, relative_distance, sketch

HOOK = "torch_reference"
CAPABILITY = "fine_forward"


@dataclass
class OpFinding:
    name: str | None = None  # the first point above the floor, or the layer itself outside a block
    text: str | None = None  # what it computes, in words
    ratio: float | None = None  # its distance / floor
    diagnosis: str | None = None  # the probabilities' reading: "mask" or "softmax scale"
    points: dict[str, list[float]] = field(default_factory=dict)  # point -> [distance, floor], forward order
    weights: str | None = None  # where the torch side's weights came from

    def to_json(self) -> dict:
        return {"name": self.name, "text": self.text, "ratio": self.ratio, "diagnosis": self.diagnosis,
                "weights": self.weights, "points": self.points}


def _text(ref: Any, name: str) -> str:
    fn = getattr(ref, "op_text", None)
    return fn(name) if fn is not None else name


def block_of(layer: str, forward_names: list[str]) -> str | None:
    """The block a layer-level name lies in: the forward name it extends ("block_00.attn" in
    "block_00"); None for a layer outside any block, and for a block's own output."""
    inside = [b for b in forward_names if layer.startswith(b + ".")]
    return max(inside, key=len) if inside else None


def refine_op(torch_run: Run, jax_run: Run, step: int, layer: str, notes: list[str],
              floor: Floor = TRAINER) -> OpFinding | None:
    """The op inside `layer` at `step` (its first forward field above the floor), or None with a note."""
    from replay import plugins

    forward = [n for n, k in jax_run.schema.tensors if k == "forward"]
    block = block_of(layer, forward) or (layer if any(n.startswith(layer + ".") for n in forward) else None)
    try:
        ref = plugins.first_answer(HOOK, torch_run)
    except Exception as e:  # a plugin that knows the run and cannot read it: a note, as below
        if user_error_code(e) is None:
            raise
        notes.append(f"the op inside {layer} is not named: {str(e).splitlines()[0]}")
        return None
    if block is None:  # embed, final_norm, logits: a layer that is one op (as the run's reference names it)
        return OpFinding(name=layer, text=_text(ref, layer)) if ref is not None else None
    if ref is None or getattr(ref, CAPABILITY, None) is None:
        notes.append(f"{torch_run.path}: cannot re-run its step {step} with the points inside {layer} captured (no "
                     f"installed replay plugin gives its reference model with {CAPABILITY}); the answer stays the layer")
        return None
    try:
        return _refine(ref, torch_run, jax_run, step, block, notes, floor)
    except Exception as e:  # a user error (a damaged checkpoint, no replay): a note; a bug propagates
        if user_error_code(e) is None:
            raise
        notes.append(f"the op inside {layer} is not named: {str(e).splitlines()[0]}")
        return None


def _refine(ref: Any, torch_run: Run, jax_run: Run, step: int, block: str, notes: list[str],
            floor: Floor = TRAINER) -> OpFinding | None:
    import jax

    from replay.engine.recompute import CAPABILITY as RECOMPUTE, _Side, recomputes
    from replay.engine.replayer import Replayer

    r = Replayer("JAX", jax_run)
    if not recomputes(r):
        raise ReplayUnavailable(f"{jax_run.path}: its loop does not provide {RECOMPUTE}(state, step), so its "
                                f"step {step} cannot be recomputed with {block}'s intermediates")
    _, state = r.state_at(step)
    side = _Side(r, state, step)
    model, weights = _torch_model(ref, torch_run, step, side)
    theirs = ref.fine_forward(model, step, block)
    ours = side.rc.intermediates(block)
    finding = OpFinding(weights=weights)
    if weights.startswith("torch") and not _faithful(torch_run, step, theirs, notes, floor):
        return None
    unseen: list[str] = []  # points since the last compared one that one side does not show
    for name in side.rc.intermediate_names(block):
        if name not in theirs or name not in ours:
            unseen.append(name)  # the scores before softmax; the probabilities of a fused attention
            continue
        a, b = np.asarray(theirs[name]), np.asarray(jax.device_get(ours[name]))
        if a.shape != b.shape:
            notes.append(f"{name}: the reference shows it as {list(a.shape)}, the JAX run as {list(b.shape)}: skipped")
            continue
        d, f = exact_relative_distance(a, b), floor.at("forward", step)
        finding.points[name] = [d, f]
        if finding.name is None and not d <= f:  # NaN is above
            finding.name, finding.text, finding.ratio = name, _text(ref, name), (d / f if f > 0 else float("inf"))
            if name.endswith(".probs"):
                finding.diagnosis = "mask" if not np.array_equal(a == 0, b == 0) else "softmax scale"
            if unseen:
                notes.append(f"{', '.join(unseen)} (between the last point within the floor and {name}) is shown by "
                             "one side only: the difference may begin there")
        elif finding.name is None:
            unseen = []
    if finding.name is None:
        notes.append(f"re-running step {step}, no point inside {block} is above the floor "
                     f"({len(finding.points)} compared): the answer stays the layer")
    return finding


def _torch_model(ref: Any, torch_run: Run, step: int, side: Any) -> tuple[Any, str]:
    """The reference with the weights entering `step`: the torch run's checkpoint there, else the JAX side's."""
    from replay.engine.protocol import local_run
    from replay.torch import checkpoint

    model = ref.model()
    path = local_run(torch_run).path  # torch checkpoints are read as files: a remote run's local copy
    if step in checkpoint.steps(path):
        checkpoint.load(path, step, model)
        return model, f"torch checkpoint {step}"
    ref.load(model, ref.weights(side.raw))
    return model, f"the JAX run's parameters at step {step} (the torch run saved no checkpoint there)"


def _faithful(torch_run: Run, step: int, theirs: dict[str, Any], notes: list[str], floor: Floor = TRAINER) -> bool:
    """Whether the re-run's layer-level outputs are the ones the torch run recorded at `step`
    (sketch distance within the floor; nothing to check without sketches)."""
    schema = torch_run.schema
    rec = torch_run.trace.read(step)
    if not schema.sketch_width or rec.sketches is None:
        return True
    index = {n: i for i, n in enumerate(schema.tensor_names)}
    for name in (n for n in theirs if n in index):
        s, norm = sketch(theirs[name], schema.sketch_width)
        i = index[name]
        d = float(relative_distance(rec.sketches[i], rec.norms[i], s, norm))
        if not d <= floor.at("forward", step):
            notes.append(f"{torch_run.path}: re-running its step {step} from its checkpoint does not give the {name} "
                         f"it recorded (relative distance {d:.3g}): the op inside the layer is not named")
            return False
    return True
