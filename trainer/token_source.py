"""A token source: a flat stream of token ids, from a token file (a read-only memmap, as OLMo and
nanoGPT store them) or the embedded corpus that ships with the package, with its fingerprint and
its check against the model's vocabulary; and writing token files. trainer/data.py cuts examples
and batches from it.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import os
from importlib import resources

import numpy as np
import xxhash

from trainer import tokenizer
from trainer.errors import DataError

# Little-endian explicitly: a file written on one machine must read (and hash) the
# same on any other.
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
EMBEDDED_PREFIX = "embedded:"
EMBEDDED_DEFAULT = "embedded:default"
_EMBEDDED_FILES = {"default": "default.txt.gz"}

_FINGERPRINT_TAG = b"replay.data.tokens.v1\0"
# Scans of big memmaps go in chunks so validation never allocates a full-size mask.
_SCAN_CHUNK = 1 << 24


# --------------------------------------------------------------------------- sources


@dataclasses.dataclass(frozen=True, eq=False)
class TokenSource:
    """A flat stream of token ids (a read-only memmap for files)."""

    kind: str  # "file" or "embedded"
    path: str  # file path, or "embedded:NAME"
    dtype: str  # "uint16" or "uint32"
    tokens: np.ndarray
    declared_vocab_size: int | None = None

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @functools.cached_property
    def max_id(self) -> int:
        return max(int(chunk.max()) for _, chunk in _chunks(self.tokens))

    @property
    def vocab_size(self) -> int:
        """The declared vocab, else the smallest one that covers every id in the source."""
        if self.declared_vocab_size is not None:
            return self.declared_vocab_size
        return self.max_id + 1

    @functools.cached_property
    def _fingerprint(self) -> str:
        # The dtype and length are in the digest: the same bytes read as uint16 or
        # uint32 are a different token stream.
        h = xxhash.xxh3_128(_FINGERPRINT_TAG)
        h.update(f"{self.dtype}:{self.n_tokens}\0".encode())
        for _, chunk in _chunks(self.tokens):
            h.update(np.ascontiguousarray(chunk))
        return h.hexdigest()

    def fingerprint(self) -> str:
        """xxh3_128 hex of the token bytes, dtype and length (computed once)."""
        return self._fingerprint

    def describe(self) -> dict:
        """What the run manifest records about the data."""
        return {
            "kind": self.kind,
            "path": self.path,
            "dtype": self.dtype,
            "n_tokens": self.n_tokens,
            "fingerprint": self.fingerprint(),
        }

    def validate(self, vocab_size: int) -> None:
        """Raise DataError if any id would index past a model vocab of `vocab_size`."""
        if self.max_id < vocab_size:
            return
        for start, chunk in _chunks(self.tokens):
            bad = np.flatnonzero(chunk >= vocab_size)
            if bad.size:
                pos = start + int(bad[0])
                raise DataError(
                    f"{self.path}: token id {int(chunk[bad[0]])} at position {pos} is >= the "
                    f"model's vocab_size {vocab_size} (max id in the source is {self.max_id}); "
                    f"set vocab_size to at least {self.max_id + 1} or re-tokenize the data"
                )


def open_source(spec: str, dtype: str = "uint16", vocab_size: int | None = None) -> TokenSource:
    """A token source from "embedded:NAME" or a flat token file path.

    With `vocab_size`, the source is validated against it at once, so a wrong
    vocabulary fails before any compile or step instead of as silent garbage.
    """
    spec = os.fspath(spec)
    if spec.startswith(EMBEDDED_PREFIX):
        source = _open_embedded(spec[len(EMBEDDED_PREFIX) :], vocab_size)
    else:
        source = _open_file(spec, dtype, vocab_size)
    if vocab_size is not None:
        source.validate(vocab_size)
    return source


def _open_file(path: str, dtype: str, vocab_size: int | None) -> TokenSource:
    if dtype not in DTYPES:
        raise DataError(f"unknown token dtype {dtype!r} for {path}; use one of {sorted(DTYPES)}")
    if not os.path.isfile(path):
        raise DataError(
            f"token file not found: {path}; pass an existing flat token file "
            f"(raw uint16/uint32 memmap) or {EMBEDDED_DEFAULT!r}"
        )
    np_dtype = DTYPES[dtype]
    size = os.path.getsize(path)
    if size == 0:
        raise DataError(f"token file {path} is empty; write tokens to it or use {EMBEDDED_DEFAULT!r}")
    if size % np_dtype.itemsize:
        raise DataError(
            f"token file {path} has {size} bytes, not a multiple of {np_dtype.itemsize} "
            f"({dtype}); the file is truncated or its dtype is not {dtype}"
        )
    tokens = np.memmap(path, dtype=np_dtype, mode="r")
    return TokenSource("file", path, dtype, tokens, vocab_size)


def _open_embedded(name: str, vocab_size: int | None) -> TokenSource:
    if name not in _EMBEDDED_FILES:
        raise DataError(
            f"unknown embedded corpus {EMBEDDED_PREFIX}{name}; available: "
            + ", ".join(EMBEDDED_PREFIX + n for n in sorted(_EMBEDDED_FILES))
        )
    return TokenSource(
        "embedded", EMBEDDED_PREFIX + name, "uint16", _embedded_tokens(name),
        vocab_size if vocab_size is not None else tokenizer.VOCAB_SIZE,
    )


@functools.lru_cache(maxsize=None)
def _embedded_tokens(name: str) -> np.ndarray:
    blob = resources.files("trainer").joinpath("corpus", _EMBEDDED_FILES[name]).read_bytes()
    tokens = tokenizer.encode(gzip.decompress(blob).decode("utf-8")).astype(DTYPES["uint16"])
    tokens.setflags(write=False)  # shared by every source opened in this process
    return tokens


def write_token_file(path: str, tokens, dtype: str = "uint16") -> None:
    """Write ids as a raw little-endian token file, atomically (temp file + rename)."""
    if dtype not in DTYPES:
        raise DataError(f"unknown token dtype {dtype!r}; use one of {sorted(DTYPES)}")
    ids = np.asarray(tokens).reshape(-1)
    limit = np.iinfo(DTYPES[dtype]).max
    if ids.size and (ids.min() < 0 or ids.max() > limit):
        raise DataError(f"token ids span [{ids.min()}, {ids.max()}], which {dtype} cannot hold")
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(ids.astype(DTYPES[dtype]).tobytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _chunks(tokens: np.ndarray):
    for start in range(0, tokens.shape[0], _SCAN_CHUNK):
        yield start, tokens[start : start + _SCAN_CHUNK]
