"""The noise floor of a cross-framework pair: how far two correct implementations drift apart.

A floor is a measured envelope per causal kind of field, FACTOR x (BASE[kind] + GROWTH[kind] x step):
rounding differences grow as training amplifies them, so the floor grows with the step. Each pair of
frameworks drifts at its own rate, so each has its own table, measured on clean pairs of it; `choose`
picks the table for two runs (`replay bisect --floor NAME|FILE`, default: the pair's own where one was
measured, else the trainer's).

TRAINER (the default), MEASURED by bench/cross_noise.py: the trainer's tiny preset (fp32, dropout 0,
16 x 32 tokens, AdamW, warmup 5, cosine to step 20) trained 100 steps by the JAX trainer and by
transformers' OLMo 3 through trainer/reference_train.py, from the same weights on the same batches, on
this machine's CPU (XLA:CPU vs torch 2.13 CPU), 2026-12-01; and the same JAX config on 8 virtual devices
(another reduction order) against the same torch run. The distances: the torch run's recorded sketches
against the JAX run replayed and sketched. The largest relative distance each kind of field reached over
steps 0..99, and the envelope fitted to it (value over steps 0..4, then growth per step):

    kind      1 device: max (step 0..4, growth)    8 devices: max (step 0..4, growth)
    forward   2.6e-6 (7.5e-7, 1.9e-8)               2.5e-6 (7.7e-7, 1.8e-8)
    loss      3.5e-7 (2.5e-7, 1.2e-9)               3.5e-7 (1.7e-7, 2.5e-9)
    backward  6.1e-6 (1.7e-6, 2.1e-7)               6.0e-6 (1.6e-6, 1.7e-7)
    update    2.2e-6 (1.3e-7, 2.1e-8)               2.2e-6 (1.3e-7, 2.1e-8)
    state     4.6e-7 (9.6e-8, 4.0e-9)               4.7e-7 (9.4e-8, 4.6e-9)

(the largest: forward block_00.attn, backward the QK-norm scales' gradients, update the
embedding). The device count changes nothing measurable next to the framework. The table is the
envelope (the worse of the two device counts, rounded up) times FACTOR 10: the clean 100-step pairs
reach 0.095 of it at most (1 device: block_00.attn at step 97; 8 devices: state/params at step 14).
Past 100 steps it is extrapolated linearly (an assumption: measure longer pairs with
bench/cross_noise.py and replace this table). A port bug is far above it: RMSNorm epsilon 1e-5
instead of 1e-6 moves block_00.attn by 0.65 (relative) at step 0, ~8e4 x the floor.

From traces alone (a JAX run recorded with trace.sketches), the JAX side's sketch is summed in
float32 on device, which adds its own rounding, ~1e-7 relative (measured: state/params 1.9e-7
where the replay path says 2.0e-8): the 40-step demo pair reaches 0.19 x the floor that way,
0.12 x by replay (2026-12-01); both far from the margin of 10.

OLMO3_PAIR, MEASURED by bench/cross_noise_pair.py (2026-12-06, this machine's CPU, Intel Xeon): MaxText
0.2.5's OLMo 3 against OLMo-core 3.0.0's (tools/olmo3_pair.py: 4 layers, 12 wide, constant LR 1e-3,
AdamW, uniformly random tokens), the same weights and rows, 64 steps (the first epoch), both traces'
sketches, six data seeds. Forward ops and the loss are what this pair compares. Per seed, the largest
forward distance (op, step) and the growth fitted to it (base: step 0, the same weights on the same rows,
before any update, 5.2e-7..7.2e-7 in every seed; growth: the largest (d(k) - base) / k):

    seed   forward max (op, step)                    growth   loss max (growth)
    1      2.8e-4 (blocks.2.attention.k_norm, 61)     4.8e-6   3.8e-7 (6.6e-9)
    2      4.8e-3 (blocks.2.attention.k_norm, 62)     7.8e-5   2.7e-6 (1.5e-7)
    3      9.4e-3 (blocks.1.feed_forward_norm, 63)    1.5e-4   1.2e-5 (1.9e-7)
    4      1.1e-3 (blocks.2.attention.k_norm, 55)     2.0e-5   3.1e-7 (2.3e-7)
    5      1.4    (blocks.3.feed_forward.w3, 62)      2.3e-2   2.9e-3 (4.6e-5)
    0      2.3e-3 (blocks.1.attention.rope.q, 63)     8.1e-5   1.5e-6 (1.9e-8)   held out: the tests' pair

This pair's rounding is amplified far faster than the trainer pair's, and unevenly. The model learns
nothing from random tokens (the loss stays at ln 512); a likely mechanism, not isolated: AdamW turns
each nearly cancelled gradient into a full-size step whose sign rounding can decide. In one seed of six
(5) the two runs part completely after step 39 (distance 7.9e-2, then 1.4; the loss 2.9e-3 apart) with
nothing but rounding between them. The table is the envelope over seeds 1-5 (base 7.2e-7 forward,
2.3e-7 loss; growth 2.3e-2 forward, 4.6e-5 loss: seed 5's) times FACTOR 10. The held-out seed 0 (the
tests' pair) reaches 0.099 of it (the loss at step 0); under TRAINER it is a false alarm at step 1
(8.4 x, blocks.1.attention.w_q; 109.7 x by step 63). What it costs: from step 1 on the floor is wide
(0.23 forward, 4.6e-4 loss at step 1): OLMo-core's AdamW counter bug (6.6e-3 at step 1, embeddings;
0.87 x the floor at most) is within it, found only under --floor trainer (807 x). At step 0 it is as
tight as TRAINER's: the RoPE-theta and QK-norm-epsilon port bugs stay 7.9e3 x and 8.0e4 x above it
(tests/maxtext/test_olmo3_pair.py). Measured on random tokens only (tokens from a first-order Markov
chain, tried by hand and not kept, drift no slower: one of six seeds reached 0.56), and 64 steps only:
linear beyond.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MIN_FLOOR = 1e-7  # about one float32 ULP relative: no floor is finer


@dataclass(frozen=True)
class Floor:
    """A measured noise envelope: FACTOR x (BASE[kind] + GROWTH[kind] x step), never under MIN_FLOOR."""

    name: str
    base: dict = field(hash=False)  # causal kind -> the envelope's start (trainer: steps 0..4; pair: step 0)
    growth: dict = field(hash=False)  # causal kind -> growth per step
    factor: float = 10.0  # margin over the largest distance measured between correct implementations
    measured_on: str = ""

    def at(self, kind: str, step: int) -> float:
        """The relative distance above which a field of causal `kind` at `step` is not rounding noise."""
        base = self.base.get(kind, max(self.base.values()))
        growth = self.growth.get(kind, max(self.growth.values()))
        return self.factor * max(MIN_FLOOR, base + growth * max(0, int(step)))


TRAINER = Floor("trainer", base={"state": 1e-7, "forward": 8e-7, "loss": 3e-7, "backward": 2e-6, "update": 1.5e-7},
                growth={"state": 5e-9, "forward": 2e-8, "loss": 3e-9, "backward": 2.5e-7, "update": 2.5e-8},
                measured_on="the trainer (tiny) vs transformers' OLMo 3, 100 steps, 1 and 8 devices "
                            "(bench/cross_noise.py)")
FACTOR, BASE, GROWTH = TRAINER.factor, TRAINER.base, TRAINER.growth  # the default table's, by their old names
# bench/cross_noise_pair.py, fitted over data seeds 1-5 (seed 0, the tests' pair, held out); see above
OLMO3_PAIR = Floor("olmo3-pair", base={"forward": 7.2e-7, "loss": 2.3e-7}, growth={"forward": 2.3e-2, "loss": 4.6e-5},
                   measured_on="MaxText's OLMo 3 vs OLMo-core's (tools/olmo3_pair.py), 64 steps, data seeds 1-5 "
                               "(bench/cross_noise_pair.py)")
FLOORS = {f.name: f for f in (TRAINER, OLMO3_PAIR)}
AUTO = "auto"


def is_maxtext_olmo_core(manifest_a: dict, manifest_b: dict) -> bool:
    """One run recorded by replay.maxtext, the other by replay.torch's OLMo-core callback."""
    loops = {"maxtext" if m.get("loop") == "maxtext" else "olmo_core" if m.get("olmo_core") else None
             for m in (manifest_a, manifest_b)}
    return loops == {"maxtext", "olmo_core"}


def choose(spec: str | None, manifest_a: dict, manifest_b: dict) -> Floor:
    """The floor `--floor SPEC` names: a table's name, a JSON file (Floor's fields, e.g. what
    bench/cross_noise_pair.py prints as "floor_file"), or auto (None): the pair's own table where
    one was measured for the two runs' frameworks (MaxText vs OLMo-core), else the trainer's."""
    from replay.errors import UserError

    if spec is None or spec == AUTO:
        return OLMO3_PAIR if is_maxtext_olmo_core(manifest_a, manifest_b) else TRAINER
    if spec in FLOORS:
        return FLOORS[spec]
    import json
    from pathlib import Path

    path = Path(spec)
    if not path.is_file():
        raise UserError(f"--floor {spec}: neither a floor's name ({', '.join([AUTO, *FLOORS])}) nor a file")
    try:
        got = json.loads(path.read_text())
        base, growth = ({str(k): float(v) for k, v in got[key].items()} for key in ("base", "growth"))
        floor = Floor(str(got.get("name", path.stem)), base, growth, float(got.get("factor", 10.0)),
                      str(got.get("measured_on", str(path))))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise UserError(f"--floor {spec}: not a floor file (JSON with \"base\" and \"growth\": kind -> number; "
                        f"{type(e).__name__}: {e})") from None
    if not base or set(base) != set(growth) or floor.factor <= 0 or min([*base.values(), *growth.values()]) < 0:
        raise UserError(f"--floor {spec}: \"base\" and \"growth\" must name the same kinds, numbers >= 0, and "
                        "\"factor\" must be > 0")
    return floor
