"""Byte-level tokenizer: one token per UTF-8 byte, plus a few special ids.

Bytes need no trained vocabulary file, so the embedded corpus and any text a user
brings tokenize the same way everywhere, with nothing to download or version.
"""

from __future__ import annotations

import numpy as np

N_BYTES = 256
EOS_ID = 256  # ends a document; never produced by encode() unless asked
N_SPECIAL = 1
# Padded to a multiple of 64 so the embedding and logits matmuls tile cleanly on
# TPU/GPU; ids in [N_BYTES + N_SPECIAL, VOCAB_SIZE) are never produced.
VOCAB_SIZE = 320

# uint16 holds every id, and it is the on-disk dtype of the token files we write.
TOKEN_DTYPE = np.uint16


def encode(text: str, *, add_eos: bool = False) -> np.ndarray:
    """UTF-8 bytes of `text` as a 1-D uint16 array of ids, optionally ending in EOS."""
    ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(TOKEN_DTYPE)
    if add_eos:
        ids = np.append(ids, TOKEN_DTYPE(EOS_ID))
    return ids


def decode(ids) -> str:
    """Text for a sequence of ids; special and padding ids are dropped.

    A window cut from a token stream can start or end inside a multi-byte character,
    so invalid UTF-8 becomes U+FFFD instead of raising.
    """
    ids_N = np.asarray(ids).reshape(-1)
    if ids_N.size and ids_N.min() < 0:
        raise ValueError(f"token ids must be non-negative, got {int(ids_N.min())}")
    byte_ids = ids_N[ids_N < N_BYTES].astype(np.uint8)
    return byte_ids.tobytes().decode("utf-8", errors="replace")
