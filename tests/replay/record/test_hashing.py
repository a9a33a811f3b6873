"""Per-example hashes (replay/record/hashing.py) against the definition written out here with
xxhash alone, and the record builder's per-step cost guard (replay/record/recorder.py)."""

import numpy as np
import pytest
import xxhash

from replay.record.hashing import example_hashes


def _reference(leaves: list[tuple[str, np.ndarray]]) -> list[int]:
    """The definition: xxh3_64 of each example's little-endian bytes (every leaf's row, in tree
    order), seeded by xxh3_64 of the layout text (one unnamed array: dtype and row shape)."""
    if len(leaves) == 1 and leaves[0][0] == "batch":
        a = leaves[0][1]
        layout = f"{a.dtype.newbyteorder('<').name}{a.shape[1:]}"
    else:
        layout = ";".join(f"{n}={a.dtype.newbyteorder('<').name}{a.shape[1:]}" for n, a in leaves)
    seed = xxhash.xxh3_64_intdigest(layout.encode())
    rows = [b"".join(np.ascontiguousarray(a[i].astype(a.dtype.newbyteorder("<"))).tobytes() for _, a in leaves)
            for i in range(leaves[0][1].shape[0])]
    return [xxhash.xxh3_64_intdigest(r, seed) for r in rows]


def test_example_hashes_follow_the_definition_for_every_layout_zero_width_rows_included():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 5)).astype(np.float32)
    y = rng.integers(0, 9, (6, 1)).astype(">i8")  # big-endian: hashed as its little-endian bytes
    cases = [
        (x, [("batch", x)]),
        ({"x": x, "y": y}, [("x", x), ("y", y)]),
        (y, [("batch", y)]),
        (np.asfortranarray(x), [("batch", x)]),
        # Rows of no bytes: every example hashes as the empty string (this raised TypeError).
        (np.zeros((3, 0), np.int32), [("batch", np.zeros((3, 0), np.int32))]),
        ({"a": np.zeros((3, 0), np.float32)}, [("a", np.zeros((3, 0), np.float32))]),
        # No examples at all: no hashes (reshaping with -1 raised ValueError).
        (np.zeros((0, 5), np.int32), [("batch", np.zeros((0, 5), np.int32))]),
        ({"a": np.zeros((0, 2), np.float32), "b": np.zeros((0,), ">i8")},
         [("a", np.zeros((0, 2), np.float32)), ("b", np.zeros((0,), ">i8"))]),
    ]
    for batch, leaves in cases:
        assert example_hashes(batch).tolist() == _reference(leaves)


def test_a_packed_record_is_built_without_the_schemas_tensor_names(monkeypatch):
    """run.step's record gives its fingerprints in schema order, without names: the record builder
    checks their count and never builds the schema's (hundreds of) names, every step."""
    from replay.record import recorder
    from replay.record.recorder import RecordSchemaError, to_record
    from traces import Schema

    schema = Schema(examples_per_step=2, rng_words=0, metrics=(("loss", "loss"),),
                    tensors=tuple((f"t{i}", "forward") for i in range(3)))

    def no_names(self):
        raise AssertionError("the schema's tensor names were built")

    monkeypatch.setattr(recorder.Schema, "tensor_names", property(no_names))
    metrics = {"loss": np.float32(1), "rng": np.zeros(0, np.uint32),
               "fingerprints": np.arange(6, dtype=np.uint32).reshape(3, 2), "rms": np.ones(3, np.float32)}
    rec = to_record(schema, 0, metrics, np.array([1, 2], np.uint64))
    assert rec.fingerprints.tolist() == [(0 << 32) | 1, (2 << 32) | 3, (4 << 32) | 5]
    with pytest.raises(RecordSchemaError, match="returned 2 fingerprints for the schema's 3 tensors"):
        to_record(schema, 0, {**metrics, "fingerprints": metrics["fingerprints"][:2]}, np.array([1, 2], np.uint64))
