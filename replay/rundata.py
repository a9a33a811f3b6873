"""A run's data without its step: the data-only capability of the loop protocol.

Some commands need a run's data but must not build its replayable (which compiles the step):
`replay audit` is read-only and imports no JAX, `replay pack` copies rows without running
anything, compare's held-out rows are read before either side is evaluated. They ask the run's
*data-only entry*: a function `(manifest, run_path, data=None, whole_source=False) -> object`
that opens nothing until asked, named for the factory that replays the run (DATA_ENTRIES). The
object it returns answers (each optional, looked up by name; docstrings in trainer/replay_data.py):

    cfg, seq_len, seed, n_examples, source_name, fingerprint()   the source and its config
    example_rows(ids) -> int32 [n, L+1]    rows of global example ids
    example_hashes(rows) -> uint64 [n]     the hashes the trace records for such rows
    batch_ids(step) -> int64 [B]           the examples the sampler reads for a step
    fed_hashes(step) -> uint64 [B]         the hashes of the batch a step was fed
    write_examples(path, ids), carried(path)   a bundle's examples file, and the data it serves
    described_source(info)                 the source a manifest's "data" section describes

A replay.init run has none: its batches live in its example store (replay/record/examples_store.py)
and commands read them there; a loop whose factory is not listed gets a one-line refusal naming
what its loop must give.

DATA_ENTRIES names the trainer's entry as a string, as replay.engine.protocol names the trainer's factory
(LEGACY_DEFAULT_FACTORY): the module is imported by that name only when a trainer run's data is
asked for, never by replay's own imports, so `traces <- replay <- trainer` holds. A bundle's manifest
cannot choose it: the entry follows from the factory, and a bundle's factory is one of replay's
own (replay/bundle/trust.py).
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from traces import Run

from replay.errors import InputError
from replay.engine.protocol import LEGACY_DEFAULT_FACTORY

# factory -> its data-only entry ("module:function"); only factories replay ships with are listed.
DATA_ENTRIES = {LEGACY_DEFAULT_FACTORY: "trainer.replay_data:run_data"}


class NoDataEntry(InputError):
    """The run's loop gives no data-only entry; the message says what it would need."""


def factory_of(manifest: dict) -> str:
    return str(manifest.get("replayable", LEGACY_DEFAULT_FACTORY))


def data_entry(manifest: dict) -> str | None:
    """The data-only entry ("module:function") of the factory that replays the run, or None."""
    return DATA_ENTRIES.get(factory_of(manifest))


def run_data(run: Run, data: str | None = None, whole_source: bool = False) -> Any:
    """The data-only view of `run` (see the module doc); `data_of` with its manifest and folder
    (a run on object storage: its local copy, traces/storage/mirror.py, which loops read as files)."""
    from replay.engine.protocol import local_run

    return data_of(run.manifest, local_run(run).path, data=data, whole_source=whole_source)


def data_of(manifest: dict, run_path: str | os.PathLike, data: str | None = None, whole_source: bool = False) -> Any:
    """The data-only view of the run with this manifest in `run_path`. Cost: one import; nothing is read.

    `data` reads the rows from another token file (--data), `whole_source` from the config's
    source even in a bundle (which otherwise serves only the rows it carries). Raises NoDataEntry
    when the run's loop has none, ImportError when its module cannot be imported here."""
    spec = data_entry(manifest)
    if spec is None:
        raise NoDataEntry(f"its loop ({factory_of(manifest)}) gives replay no data-only entry")
    module, _, name = spec.partition(":")
    entry = getattr(importlib.import_module(module), name)
    return entry(manifest, run_path, data=data, whole_source=whole_source)


def capability(obj: Any, name: str, what: str) -> Any:
    """`obj.name`, or NoDataEntry saying the run's loop does not provide it (`what`: its contract)."""
    found = getattr(obj, name, None)
    if found is None:
        raise NoDataEntry(f"the run's loop does not provide {name} ({what})")
    return found
