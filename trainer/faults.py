"""Named faults that reproduce real bug classes, so users can check the tool catches them.

`replay train --inject NAME@STEP` (repeatable) applies a fault from step STEP on and records
it in the manifest ("faults"), so a replay of the faulty run reproduces it bit for bit and a
bisect against a clean run names it. Each fault mimics a bug seen in real training stacks:

    data-repeat        after a resume onto another host count, the sampler computes its
                       position modulo a per-host window that no longer matches the data: from
                       step S on it cycles over the REPEAT_WINDOW batches fed just before S.
                       Already-seen examples come back while the model still remembers them,
                       and the training loss looks better than it is
    dropout-key-reuse  the dropout key stops advancing: from step S every step reuses step S-1's
    layer-bf16         from step S the middle block computes in bfloat16 (params stay float32)
    skip-opt-restore   at step S the optimizer state is re-initialised, as when a resume
                       restores the parameters but forgets the optimizer state
    bitflip            before step S one bit of one parameter flips (bit 20 of element [0, 0] of
                       the middle block's mlp.up kernel), as silent data corruption would
    bad-batch          step S only: the examples at positions 3, 7, 11, ... of the global batch
                       (every fourth, `bad_positions`; 4 of a batch of 16, one per device on 4
                       devices) are swapped for degenerate ones, token 0 (a NUL byte) repeated,
                       as a loader reading a zero-filled region of a token file would feed; the
                       recorded example hashes are those of the rows really fed
    weight-decay       from step S on, the update decays the weight matrices with WD_FAULT_EXTRA
                       more weight decay than the config says, as a resume that read its
                       optimizer settings from another config would: the state entering S, the
                       forward pass, the loss and the gradients of S are the clean run's, its
                       update is not (applied after the step's program, at the learning rate
                       the update used, so the step's own metrics are the clean run's too and
                       the first recorded difference of a step-level trace is the loss at S+1)

Silent data corruption (mesh-invariant mode only; the flip happens inside one device's share of
the step, on a microbatch gradient it computes, before any reduction: trainer/sdc.py):

    sdc@S:device=D[,tensor=NAME][,elem=E][,bit=B]
                       transient: at step S only, device D's first microbatch gradient of parameter
                       NAME (default: the middle block's mlp.up.kernel) has bit B (default 20) of its
                       flat element E (default 0) flipped, once; a re-execution does not repeat it
    sdc-chip[@S]:device=D[,p=P][,tensor=NAME][,elem=E][,bit=B]
                       persistent: from step S (default 1) on, at each step with probability P
                       (default 1), every microbatch gradient device D computes has that bit
                       flipped. Whether a step is hit is a pure function of (root seed, step,
                       device) drawn from the stream "sdc-chip/D", so the bad chip misbehaves
                       the same way whenever it computes that step, in training, in a replay and
                       in `replay verify` (which re-runs work on other devices)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from replay.errors import InputError
from trainer import data, model
from trainer.config import Config

FAULTS = ("data-repeat", "dropout-key-reuse", "layer-bf16", "skip-opt-restore", "bitflip", "bad-batch",
          "weight-decay", "sdc", "sdc-chip")
SDC_FAULTS = ("sdc", "sdc-chip")
BITFLIP_BIT = 20
REPEAT_WINDOW = 8  # data-repeat: how many recent batches the broken sampler cycles over
WD_FAULT_EXTRA = 0.5  # weight-decay: decay added to the config's (AdamW decoupled: p -= lr * extra * p)
BAD_TOKEN = 0  # bad-batch: the token a degenerate example repeats (a NUL byte with the byte tokenizer)


class FaultError(ValueError, InputError):
    """A malformed --inject; one line for users."""


@dataclass(frozen=True)
class Fault:
    name: str  # one of FAULTS
    step: int  # the first step it affects

    def __str__(self) -> str:
        return f"{self.name}@{self.step}"


@dataclass(frozen=True)
class SdcFault(Fault):
    """A simulated silent data corruption inside device `device`'s work (trainer/sdc.py)."""

    device: int = 0
    tensor: str = ""  # the parameter whose microbatch gradient is hit; "" = bitflip_param(cfg)
    elem: int = 0  # flat element index in that gradient
    bit: int = BITFLIP_BIT
    p: float = 1.0  # sdc-chip: the chance that a step is hit

    @property
    def persistent(self) -> bool:
        return self.name == "sdc-chip"

    def __str__(self) -> str:
        opts = [f"device={self.device}"] + ([f"p={self.p!r}"] if self.persistent and self.p != 1.0 else [])
        opts += [f"tensor={self.tensor}"] * bool(self.tensor) + [f"elem={self.elem}"] * bool(self.elem)
        opts += [f"bit={self.bit}"] if self.bit != BITFLIP_BIT else []
        return f"{self.name}@{self.step}:{','.join(opts)}"


def _parse_sdc(spec: str) -> SdcFault:
    head, _, opts = spec.partition(":")
    name, sep, step = head.partition("@")
    usage = (f"--inject {spec!r}: expected sdc@STEP:device=D or sdc-chip[@STEP]:device=D, optionally "
             "followed by ,p=P (sdc-chip) ,tensor=PARAM ,elem=E ,bit=B")
    kw: dict = {}
    for item in filter(None, opts.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in ("device", "tensor", "elem", "bit", "p") or (key == "p" and name == "sdc"):
            raise FaultError(usage)
        try:
            kw[key] = value if key == "tensor" else float(value) if key == "p" else int(value)
        except ValueError:
            raise FaultError(f"--inject {spec!r}: {key}={value!r} is not a number") from None
    if "device" not in kw or (name == "sdc" and not sep):
        raise FaultError(usage)
    try:
        at = int(step) if sep else 1
    except ValueError:
        raise FaultError(f"--inject {spec!r}: STEP must be an integer") from None
    if at < 1:
        raise FaultError(f"--inject {spec!r}: STEP must be >= 1 (a fault needs a clean step before it)")
    if kw["device"] < 0 or not 0 <= kw.get("bit", 0) < 32 or kw.get("elem", 0) < 0 or not 0 < kw.get("p", 1.0) <= 1:
        raise FaultError(f"--inject {spec!r}: need device >= 0, 0 <= bit < 32, elem >= 0 and 0 < p <= 1")
    return SdcFault(name, at, **kw)


def parse(spec: str) -> Fault:
    if spec.partition(":")[0].partition("@")[0] in SDC_FAULTS:
        return _parse_sdc(spec)
    name, sep, step = spec.partition("@")
    if not sep or name not in FAULTS:
        raise FaultError(f"--inject {spec!r}: expected NAME@STEP with NAME one of {', '.join(FAULTS)}")
    try:
        at = int(step)
    except ValueError:
        raise FaultError(f"--inject {spec!r}: STEP must be an integer") from None
    if at < 1:
        raise FaultError(f"--inject {spec!r}: STEP must be >= 1 (a fault needs a clean step before it)")
    if name == "data-repeat" and at < REPEAT_WINDOW:
        raise FaultError(f"--inject {spec!r}: data-repeat cycles over the {REPEAT_WINDOW} batches before STEP, "
                         f"so STEP must be >= {REPEAT_WINDOW}")
    return Fault(name, at)


def bitflip_param(cfg: Config) -> str:
    return f"{model.block_names(cfg.model)[cfg.model.n_layers // 2]}.mlp.up.kernel"


def bad_positions(global_batch: int) -> list[int]:
    """The global batch positions bad-batch replaces: every fourth from 3 (the last one if B < 4)."""
    return list(range(3, global_batch, 4)) or [global_batch - 1]


def with_bad_examples(tokens_BxL1: np.ndarray, positions_B: list[int] | range, global_batch: int) -> np.ndarray:
    """`tokens_BxL1` (the rows at global positions `positions_B`) with the bad-batch rows swapped in."""
    bad = set(bad_positions(global_batch))
    rows = np.array(tokens_BxL1, np.int32, copy=True)
    for i, pos in enumerate(positions_B):
        if pos in bad:
            rows[i] = BAD_TOKEN
    return rows


class FaultPlan:
    """What the faults of a run do at each step. An empty plan changes nothing."""

    def __init__(self, faults: list[Fault] | tuple[Fault, ...], cfg: Config):
        self.faults = tuple(faults)
        self.cfg = cfg
        self._at = {f.name: f.step for f in self.faults if f.name not in SDC_FAULTS}
        self.sdc = tuple(f for f in self.faults if isinstance(f, SdcFault))
        self._sdc_cfg = None
        if self.sdc:
            from trainer import sdc

            sdc.check_faults(self.sdc, cfg, has_bf16="layer-bf16" in self._at)

    def __bool__(self) -> bool:
        return bool(self.faults)

    def to_manifest(self) -> list[str]:
        return [str(f) for f in self.faults]

    @classmethod
    def from_manifest(cls, specs: list[str] | None, cfg: Config) -> "FaultPlan":
        return cls([parse(s) for s in specs or []], cfg)

    def active(self, name: str, step: int) -> bool:
        return name in self._at and step >= self._at[name]

    def batch_step(self, step: int) -> int:
        """The step whose batch the (faulty) sampler feeds at `step`."""
        if self.active("data-repeat", step):
            s = self._at["data-repeat"]
            return s - REPEAT_WINDOW + (step - s) % REPEAT_WINDOW
        return step

    def alter_batch(self, batch: data.Batch, step: int, local: slice) -> data.Batch:
        """The batch fed at `step`; `batch` is this process's rows `local` of the global batch.
        bad-batch swaps rows at step S; the hashes are recomputed from the rows really fed."""
        if self._at.get("bad-batch") != step:
            return batch
        tokens = np.concatenate([batch.inputs_BxL[:, :1], batch.targets_BxL], axis=1)
        positions = range(local.start, local.start + tokens.shape[0])
        rows = with_bad_examples(tokens, positions, self.cfg.data.global_batch_size).astype(batch.inputs_BxL.dtype)
        return data.Batch(np.ascontiguousarray(rows[:, :-1]), np.ascontiguousarray(rows[:, 1:]),
                          data.example_hashes(rows), batch.ids)

    def model_cfg(self, step: int) -> Config | None:
        """A config for the faulty program from this step on, or None for the run's own."""
        if self.sdc and step >= min(f.step for f in self.sdc):
            if self._sdc_cfg is None:  # built once: it derives every fault's step keys
                from trainer import sdc

                self._sdc_cfg = sdc.faulty_config(self.cfg, self.sdc)
            return self._sdc_cfg
        if self.active("layer-bf16", step):
            return dataclasses.replace(self.cfg, model=dataclasses.replace(self.cfg.model, bf16_block=self.cfg.model.n_layers // 2))
        return None

    def before(self, state, step: int, init_opt_state):
        """The state fed to `step` (faults that corrupt state act here)."""
        if self._at.get("bitflip") == step:
            path = bitflip_param(self.cfg).split(".")
            params = jax.tree.map(lambda x: x, state.params)  # shallow copy of the nested dicts
            node = params
            for part in path[:-1]:
                node[part] = dict(node[part])
                node = node[part]
            node[path[-1]] = _flip(node[path[-1]])
            state = state._replace(params=params)
        if self._at.get("skip-opt-restore") == step:
            state = state._replace(opt_state=init_opt_state(state.params))
        if self.active("dropout-key-reuse", step):
            # The key of a step is fold_in(base key, state.step): holding the counter reuses it.
            state = state._replace(step=jnp.asarray(self._at["dropout-key-reuse"] - 1, jnp.int32))
        return state

    def after(self, state, step: int):
        if self.active("dropout-key-reuse", step):
            state = state._replace(step=jnp.asarray(step + 1, jnp.int32))
        if self.active("weight-decay", step):
            from trainer.optim import applied_lr

            state = state._replace(params=_decay(state.params, applied_lr(state.opt_state), WD_FAULT_EXTRA))
        return state


@jax.jit
def _decay(params, lr: jax.Array, extra: float):
    # As trainer/optim.py's mask: weight decay skips 1-D parameters (norm scales).
    return jax.tree.map(lambda p: p - (lr * extra).astype(p.dtype) * p if p.ndim > 1 else p, params)


@jax.jit
def _flip(x: jax.Array) -> jax.Array:
    bits = jax.lax.bitcast_convert_type(x[0, 0], jnp.uint32) ^ jnp.uint32(1 << BITFLIP_BIT)
    return x.at[0, 0].set(jax.lax.bitcast_convert_type(bits, x.dtype))
