"""Forward taps inside MaxText's model: every layer's output, at the op level, recorded as `forward` tensors.

The patch point has two halves, both applied by `tap_forward()` (the launcher's `--tap-forward`, and the
replay's `make()` when the run recorded with it, as `--tap-grads` is):

1. The output of each call of MaxText's building blocks (DenseGeneral: q/k/v/o projections, gate/up/down,
   the logits head; RMSNorm: QK-norm (OLMo 3's GlobalRMSNorm through it) and the branch norms; RotaryEmbedding: the rotary
   of the queries, then of the keys; AttentionOp: the heads' attention output before the o projection;
   Embed: the token embedding) is sown as an NNX `Intermediate` named
   `replay_NNNNNN`, NNNNNN the call's order in this process: only while replay traces a recorded step
   (`replay.tap` collecting), so MaxText run alone, or its ahead-of-time compile, is untouched.
2. MaxText's `train_step` pops the sown intermediates inside its loss function (inside `jax.value_and_grad`,
   where a tap cannot leave) and hands them to `record_activation_metrics` at its top level when
   `record_internal_nn_metrics` is on (the launcher turns it on: MaxText then also logs its activ_* scalars).
   There each sown value is tapped (`replay.tap`) under its module's name, in call order (forward order).

Names: MaxText's module path (`decoder.layers_0.attention.query`; the rotary's two calls `.q` and `.k`), or
with `names="olmo_core"` the OLMo-core module path of the same tensor (replay/maxtext/olmo_core_names.py),
so a MaxText OLMo 3 run and an OLMo-core run pair tensor by tensor in `replay bisect`. Decoder layers must
be unscanned (`scan_layers=false`): a scanned stack sows one stacked value per module, not one per layer.
Layout: MaxText's own (q/k/v as [B, S, heads, head_dim]); a distance sketch reads the elements in row-major
order, so [B, S, H, D] and OLMo-core's [B, S, H * D] are the same tensor.
"""

from __future__ import annotations

import itertools
from typing import Any

import replay

PREFIX = "replay_"
ARGV = ("record_internal_nn_metrics=true",)  # what the top-level half needs MaxText to call
_order = itertools.count()


def _collecting() -> bool:
    from replay.record.taps import is_collecting

    return is_collecting()


def _sowing(original: Any) -> Any:
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        if _collecting():
            from flax import nnx

            value = out[0] if isinstance(out, tuple) else out
            self.sow(nnx.Intermediate, f"{PREFIX}{next(_order):06d}", value)
        return out

    call.replay_sows = True  # type: ignore[attr-defined]
    return call


def _classes() -> list[Any]:
    from maxtext.layers import attention_op, embeddings, linears, normalizations

    # Not GlobalRMSNorm: it calls RMSNorm's __call__ on the heads flattened (one sown value, [B, S, H * D]).
    return [linears.DenseGeneral, normalizations.RMSNorm, embeddings.RotaryEmbedding, embeddings.Embed,
            attention_op.AttentionOp]


def sown(intermediates: Any) -> list[tuple[str, Any]]:
    """(module path, value) of every sown output in call order; a module called twice (the rotary, on the
    queries then the keys) gives `.q` and `.k` (`.1`, `.2`, ... beyond two calls)."""
    import jax

    found: list[tuple[int, str, Any]] = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(intermediates)[0]:
        keys = [str(getattr(p, "key", getattr(p, "idx", getattr(p, "name", p)))) for p in path]
        at = next((i for i, k in enumerate(keys) if k.startswith(PREFIX)), None)
        if at is None:
            continue
        found.append((int(keys[at][len(PREFIX):]), ".".join(keys[:at]), leaf))
    found.sort(key=lambda x: x[0])
    calls: dict[str, int] = {}
    for _, module, _ in found:
        calls[module] = calls.get(module, 0) + 1
    seen: dict[str, int] = {}
    out = []
    for _, module, leaf in found:
        i = seen[module] = seen.get(module, -1) + 1
        suffix = "" if calls[module] == 1 else (".q", ".k")[i] if calls[module] == 2 else f".{i}"
        out.append((module + suffix, leaf))
    return out


def tap_sown(intermediates: Any, names: str = "maxtext") -> None:
    """Each sown output tapped as a forward tensor, named as `names` says ("maxtext" or "olmo_core")."""
    rename = None
    if names == "olmo_core":
        from replay.maxtext.olmo_core_names import olmo_core_name as rename
    for name, value in sown(intermediates):
        replay.tap(value, rename(name) if rename else name, kind="forward")


def tap_forward(names: str = "maxtext") -> None:
    """From now on in this process MaxText's module outputs are tapped inside a recorded step (see above)."""
    from maxtext.trainers.pre_train import train

    if names not in ("maxtext", "olmo_core"):
        raise ValueError(f"forward tap names must be maxtext or olmo_core, not {names!r}")
    for cls in _classes():
        if not getattr(cls.__call__, "replay_sows", False) and "__call__" in vars(cls):
            cls.__call__ = _sowing(cls.__call__)
    patched = train.record_activation_metrics
    if getattr(patched, "replay_names", None) == names:
        return
    # The naming is this wrapper's own (not a module-level setting read while tracing): asking for the
    # other naming wraps MaxText's function afresh.
    original = getattr(patched, "replay_original", patched)

    def record_activation_metrics(metrics: Any, intermediate_outputs: Any, config: Any) -> Any:
        if _collecting():
            tap_sown(intermediate_outputs, names)
        return original(metrics, intermediate_outputs, config)

    record_activation_metrics.replay_names = names  # type: ignore[attr-defined]
    record_activation_metrics.replay_original = original  # type: ignore[attr-defined]
    train.record_activation_metrics = record_activation_metrics
