"""MaxText's OLMo 3 module paths -> OLMo-core's, for the tensors replay/maxtext/forward_taps.py taps.

The same tensor in both models (MaxText's `model_name=olmo3-*` decoder, unscanned, and OLMo-core's
`TransformerConfig.olmo3_*` with its reordered-norm blocks), so a MaxText run records its activations under
the names OLMo-core's run records (replay.torch: each leaf module's output by its module path):

    MaxText                                        OLMo-core
    token_embedder                                 embeddings
    decoder.layers_I.attention.query|key|value     blocks.I.attention.w_q|w_k|w_v
    decoder.layers_I.attention.query_norm|key_norm blocks.I.attention.q_norm|k_norm   (over all heads)
    decoder.layers_I.attention.rotary_embedding.q|k blocks.I.attention.rope.q|k       (see below)
    decoder.layers_I.attention.attention_op        blocks.I.attention.backend         (softmax(q k^T) v)
    decoder.layers_I.attention.out                 blocks.I.attention.w_out
    decoder.layers_I.post_self_attention_layer_norm blocks.I.attention_norm
    decoder.layers_I.mlp.wi_0|wi_1|wo              blocks.I.feed_forward.w1|w3|w2     (gate, up, down)
    decoder.layers_I.post_mlp_layer_norm           blocks.I.feed_forward_norm
    decoder.decoder_norm                           lm_head.norm
    decoder.logits_dense                           lm_head.w_out

OLMo-core's rotary module returns the pair (q, k), which replay.torch does not record; tools/olmo3_pair.py
gives it two identity children `q` and `k` that its outputs pass through, so both sides record the rotary
of the queries and of the keys ([B, S, heads, head_dim] on both). A path not in the table keeps MaxText's name.
"""

from __future__ import annotations

import re

LAYER = {"attention.query": "attention.w_q", "attention.key": "attention.w_k", "attention.value": "attention.w_v",
         "attention.query_norm": "attention.q_norm", "attention.key_norm": "attention.k_norm",
         "attention.rotary_embedding.q": "attention.rope.q", "attention.rotary_embedding.k": "attention.rope.k",
         "attention.attention_op": "attention.backend", "attention.out": "attention.w_out", "post_self_attention_layer_norm": "attention_norm",
         "mlp.wi_0": "feed_forward.w1", "mlp.wi_1": "feed_forward.w3", "mlp.wo": "feed_forward.w2",
         "post_mlp_layer_norm": "feed_forward_norm"}
OUTSIDE = {"token_embedder": "embeddings", "decoder.decoder_norm": "lm_head.norm",
           "decoder.logits_dense": "lm_head.w_out"}
_LAYER_PATH = re.compile(r"^decoder\.layers_(\d+)\.(.+)$")


def olmo_core_name(maxtext_path: str) -> str:
    if maxtext_path in OUTSIDE:
        return OUTSIDE[maxtext_path]
    m = _LAYER_PATH.match(maxtext_path)
    if m and m.group(2) in LAYER:
        return f"blocks.{m.group(1)}.{LAYER[m.group(2)]}"
    return maxtext_path
