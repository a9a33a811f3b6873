"""The noise floor of a cross-framework pair: how far two correct implementations drift apart.

MEASURED, not assumed (bench/cross_noise.py reproduces it): the trainer's tiny preset (fp32,
dropout 0, 16 x 32 tokens, AdamW, warmup 5, cosine to step 20) trained 100 steps by the JAX
trainer and by transformers' OLMo 3 through trainer/reference_train.py, from the same weights on
the same batches, on this machine's CPU (XLA:CPU vs torch 2.13 CPU), 2026-12-01; and the same
JAX config on 8 virtual devices (another reduction order) against the same torch run. The
distances: the torch run's recorded sketches against the JAX run replayed and sketched. The
largest relative distance each kind of field reached over steps 0..99, and the envelope fitted
to it (value over steps 0..4, then growth per step):

    kind      1 device: max (step 0..4, growth)    8 devices: max (step 0..4, growth)
    forward   2.6e-6 (7.5e-7, 1.9e-8)               2.5e-6 (7.7e-7, 1.8e-8)
    loss      3.5e-7 (2.5e-7, 1.2e-9)               3.5e-7 (1.7e-7, 2.5e-9)
    backward  6.1e-6 (1.7e-6, 2.1e-7)               6.0e-6 (1.6e-6, 1.7e-7)
    update    2.2e-6 (1.3e-7, 2.1e-8)               2.2e-6 (1.3e-7, 2.1e-8)
    state     4.6e-7 (9.6e-8, 4.0e-9)               4.7e-7 (9.4e-8, 4.6e-9)

(the largest: forward block_00.attn, backward the QK-norm scales' gradients, update the
embedding). The device count changes nothing measurable next to the framework. The floor of a
field at step k is FACTOR x (BASE[kind] + GROWTH[kind] x k): the envelope (the worse of the two
device counts, rounded up) times a margin: the clean 100-step pairs reach 0.095 of it at most
(1 device: block_00.attn at step 97; 8 devices: state/params at step 14). Rounding differences
grow as training amplifies them, so the floor grows with the step; past 100 steps it is
extrapolated linearly (an assumption: measure longer pairs with
bench/cross_noise.py and replace this table). A port bug is far above it: RMSNorm epsilon 1e-5
instead of 1e-6 moves block_00.attn by 0.65 (relative) at step 0, ~8e4 x the floor.

From traces alone (a JAX run recorded with trace.sketches), the JAX side's sketch is summed in
float32 on device, which adds its own rounding, ~1e-7 relative (measured: state/params 1.9e-7
where the replay path says 2.0e-8): the 40-step demo pair reaches 0.19 x the floor that way,
0.12 x by replay (2026-12-01); both far from the margin of 10.
"""

from __future__ import annotations

FACTOR = 10.0  # margin over the largest distance measured between correct implementations
MIN_FLOOR = 1e-7  # about one float32 ULP relative: no floor is finer
# (distance at step 0, growth per step) of the measured envelope, per causal kind
BASE = {"state": 1e-7, "forward": 8e-7, "loss": 3e-7, "backward": 2e-6, "update": 1.5e-7}
GROWTH = {"state": 5e-9, "forward": 2e-8, "loss": 3e-9, "backward": 2.5e-7, "update": 2.5e-8}


def floor_for(name: str, kind: str, step: int) -> float:
    """The relative distance above which `name` (of causal `kind`) at `step` is not rounding noise."""
    base = BASE.get(kind, max(BASE.values()))
    growth = GROWTH.get(kind, max(GROWTH.values()))
    return FACTOR * max(MIN_FLOOR, base + growth * max(0, int(step)))
