"""The names replay.maxtext's forward taps give MaxText's sown module outputs (replay/maxtext/forward_taps.py)
and their OLMo-core names (replay/maxtext/olmo_core_names.py). Pure functions on a dict shaped as MaxText's
popped NNX intermediates: no MaxText needed, so this runs in the default suite."""

from __future__ import annotations

import numpy as np

from replay.maxtext.forward_taps import sown
from replay.maxtext.olmo_core_names import olmo_core_name


def _intermediates() -> dict:
    v = lambda i: np.full((2,), i, np.float32)  # noqa: E731 - the value says the call it came from
    layer = {"attention": {"query": {"replay_000003": (v(3),)}, "query_norm": {"replay_000004": (v(4),)},
                           "rotary_embedding": {"replay_000005": (v(5),), "replay_000006": (v(6),)},
                           "out": {"replay_000007": (v(7),)}},
             "post_mlp_layer_norm": {"replay_000008": (v(8),)}, "activation_mean": (v(-1),)}
    return {"decoder": {"layers_0": layer, "logits_dense": {"replay_000009": (v(9),)}},
            "token_embedder": {"replay_000002": (v(2),)}}


def test_sown_outputs_come_in_call_order_and_a_module_called_twice_is_q_then_k():
    got = sown(_intermediates())
    assert [n for n, _ in got] == ["token_embedder", "decoder.layers_0.attention.query",
                                   "decoder.layers_0.attention.query_norm",
                                   "decoder.layers_0.attention.rotary_embedding.q",
                                   "decoder.layers_0.attention.rotary_embedding.k", "decoder.layers_0.attention.out",
                                   "decoder.layers_0.post_mlp_layer_norm", "decoder.logits_dense"]
    assert [int(x[0]) for _, x in got] == [2, 3, 4, 5, 6, 7, 8, 9]  # MaxText's own sows (activation_mean) left out


def test_olmo_core_names():
    names = [olmo_core_name(n) for n, _ in sown(_intermediates())]
    assert names == ["embeddings", "blocks.0.attention.w_q", "blocks.0.attention.q_norm", "blocks.0.attention.rope.q",
                     "blocks.0.attention.rope.k", "blocks.0.attention.w_out", "blocks.0.feed_forward_norm",
                     "lm_head.w_out"]
    assert olmo_core_name("decoder.layers_12.mlp.wi_1") == "blocks.12.feed_forward.w3"
    assert olmo_core_name("decoder.layers_0.something_else") == "decoder.layers_0.something_else"  # unmapped: kept
