"""Forward parity of the trainer's JAX model and its PyTorch reference (HF transformers' OLMo).

Converts the reference's random init into the trainer's model (and the trainer's init into the
reference) and compares float32 logits on one random 512-token sequence, for several model
shapes. A larger init_std gives logits of magnitude ~5-10, as a trained model's, so the KL is
not small only because the distributions are flat. Prints one JSON object on its last line:
per case the max per-token KL, the max abs logit difference and the largest logit.
Budget (issue 13): max_token_kl <= 1e-6 in every case.
"""

from __future__ import annotations

import argparse
import json
import time

from trainer.config import ModelConfig
from trainer.reference_parity import KL_BAR, forward_parity

CASES = {
    "tiny": ModelConfig(),
    "tiny_init0.2": ModelConfig(init_std=0.2),
    "tied_init0.2": ModelConfig(tied_embeddings=True, init_std=0.2),
    "olmo_like_v100k": ModelConfig(vocab_size=100_352, d_model=256, n_layers=2, n_heads=8, n_kv_heads=2, d_ff=768,
                                   rope_theta=500_000.0, init_std=0.1),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated: " + ", ".join(CASES))
    args = parser.parse_args()
    t0 = time.perf_counter()
    results = {}
    for name in args.cases.split(","):
        for direction in ("hf_to_jax", "jax_to_hf"):
            r = forward_parity(CASES[name], seq_len=args.seq_len, direction=direction)
            results[f"{name}/{direction}"] = {k: r[k] for k in ("max_token_kl", "max_abs_logit_diff", "max_abs_logit")}
    worst = max(v["max_token_kl"] for v in results.values())
    print(json.dumps({"bench": "reference_parity", "generation": r["generation"], "seq_len": args.seq_len,
                      "cases": results, "worst_token_kl": worst, "budget_token_kl": KL_BAR,
                      "within_budget": worst <= KL_BAR, "seconds": round(time.perf_counter() - t0, 1)}))


if __name__ == "__main__":
    main()
