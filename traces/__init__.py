"""replay's run format: reading and writing runs needs only numpy and zstandard, never JAX.

A trace can therefore be read anywhere, and written by any training loop (see FORMAT.md).
"""

from traces.compare import Comparison, FieldDiff, compare, diff_records, float_distance
from traces.errors import (
    DiskFullError,
    ManifestCorruptError,
    NewerFormatError,
    NotARunError,
    ResumeDivergedError,
    RunLockedError,
    RunNotFoundError,
    SchemaError,
    StepOrderError,
    TraceCorruptError,
    TraceError,
)
from traces.fed import fed, first_fed
from traces.manifest import UncheckedManifestError, trusting_unchecked_manifests
from traces.run import Run, manifest_checksum, read_manifest, write_manifest
from traces.schema import CAUSAL_KINDS, Schema, StepRecord, decode_record, encode_record, same_bits
from traces.trace import FORMAT_VERSION, Damage, TraceReader, describe_damage
from traces.index_repair import write_indexes
from traces.writer import TraceWriter

__all__ = [
    "CAUSAL_KINDS", "FORMAT_VERSION", "Comparison", "Damage", "DiskFullError", "FieldDiff", "ManifestCorruptError",
    "NewerFormatError", "NotARunError", "ResumeDivergedError", "Run", "RunLockedError", "RunNotFoundError", "Schema",
    "SchemaError", "StepOrderError", "StepRecord", "TraceCorruptError", "TraceError", "TraceReader", "TraceWriter",
    "UncheckedManifestError", "trusting_unchecked_manifests",
    "compare", "decode_record", "describe_damage", "diff_records", "encode_record", "fed", "first_fed", "float_distance",
    "manifest_checksum", "read_manifest", "same_bits", "write_indexes", "write_manifest",
]
