"""The data side of the loop protocol, as the trainer implements it (see replay/engine/protocol.py).

What replay's commands ask of a run's data (the rows of a batch, the token rows of an example,
what was injected into a batch), in two forms:

- `TrainerData`, the data-only view of a trainer run, built from its manifest without compiling
  anything or importing JAX (unless a fault plan is asked for): `replay audit` (read-only, no
  JAX), `replay pack` (no compile) and compare's held-out rows reach it through
  replay/rundata.py, which names `run_data` below as the data-only entry of runs the trainer's
  factory replays;
- `TrainerDataProtocol`, mixed into trainer.replayable.TrainerReplay, so the replayable of a
  trainer run answers the same capabilities (spike's token rows, its injected positions) exactly
  as any loop's replayable would, from the source and fault plan its step already feeds from.

Rows are int32 [n, L+1] token windows (inputs [:, :-1], targets [:, 1:]); example e of a source is
tokens[e*(L+1) : (e+1)*(L+1)] (trainer/data.py). Nothing here imports JAX at module level.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from trainer import data as datalib
from trainer import tokenizer
from trainer.config import from_dict
import itertools


class TrainerData:
    """The data of one trainer run (or of a replay.torch run of the trainer's reference), read from
    its manifest: its config (`config`, or `config.trainer_config` for a reference run), its data
    section, and the examples a bundle carries. Opening is lazy: nothing is read until asked."""

    def __init__(self, manifest: dict, run_path: str | os.PathLike, data: str | None = None,
                 whole_source: bool = False):
        self._manifest, self._path = manifest, Path(run_path)
        self._data, self._whole = data, whole_source
        self._cfg = self._source = self._plan = self._batcher = None

    # ------------------------------------------------------------------ config and source

    @property
    def cfg(self) -> Any:
        """The run's trainer config (trainer.config.Config); ConfigError when it is not one."""
        if self._cfg is None:
            raw = self._manifest.get("config")
            if self._manifest.get("recorded_by") == "replay.torch" and isinstance(raw, dict) and "trainer_config" in raw:
                raw = raw["trainer_config"]  # trainer/reference_train.py's runs
            self._cfg = from_dict(raw)
        return self._cfg

    @property
    def source_name(self) -> str:
        """The source messages name: --data, else the config's data.source (a bundle's rows were cut from it)."""
        return self._data or self.cfg.data.source

    def _bundled(self) -> str | None:
        if self._data or self._whole:
            return None
        return (self._manifest.get("bundle") or {}).get("examples")

    @property
    def source(self) -> datalib.TokenSource:
        """The token source, validated against the model's vocab; DataError (a ValueError) when it
        cannot be read. A bundle's carried examples unless `data` or `whole_source` was given."""
        if self._source is None:
            cfg, bundled = self.cfg, self._bundled()
            self._source = (datalib.open_example_file(self._path / bundled, cfg.model.vocab_size) if bundled
                            else datalib.open_source(self._data or cfg.data.source, cfg.data.token_dtype,
                                                     cfg.model.vocab_size))
        return self._source

    def fingerprint(self) -> str:
        """The fingerprint of the source the rows come from (the manifest's data.fingerprint when it is
        the recorded one). Cost: one pass over the token file, once."""
        return self.source.fingerprint()

    @property
    def seed(self) -> int:
        """The run's root seed (config.seed): held-out candidates are drawn in an order keyed by it."""
        return int(self.cfg.seed)

    @property
    def seq_len(self) -> int:
        return int(self.cfg.model.seq_len)

    @property
    def n_examples(self) -> int:
        """Examples in one epoch of the source: n_tokens // (L+1)."""
        return self.source.n_tokens // (self.seq_len + 1)

    def example_rows(self, ids) -> np.ndarray:
        """int32 [n, L+1]: the rows of examples `ids` (int64 [n], global example ids), in that order.
        Cost: n rows read (a memmap gather), whatever the run's length (a million steps or ten)."""
        return datalib.load_batch(self.source, ids, self.seq_len)

    def example_hashes(self, rows) -> np.ndarray:
        """uint64 [n]: the per-example hashes the trace records for rows int [n, L+1] (xxh3_64 of each
        row's bytes, seeded by dtype and row shape). Cost: ~0.2 us a row."""
        return datalib.example_hashes(rows)

    # ------------------------------------------------------------------ batches by step

    @property
    def faults(self) -> Any:
        """The run's fault plan (trainer.faults.FaultPlan; empty for a clean run). Imports JAX."""
        if self._plan is None:
            from trainer.faults import FaultPlan

            self._plan = FaultPlan.from_manifest(self._manifest.get("faults"), self.cfg)
        return self._plan

    @property
    def _batches(self) -> datalib.Batcher:
        if self._batcher is None:
            from trainer.rng import data_seed

            cfg = self.cfg
            self._batcher = datalib.Batcher(self.source, cfg.model.seq_len, cfg.data.global_batch_size,
                                            data_seed(cfg.seed), sampler=cfg.data.sampler)
        return self._batcher

    def batch_ids(self, step: int) -> np.ndarray:
        """int64 [B]: the global ids of the examples the sampler reads for `step` (a data-repeat
        fault's earlier step included), in global batch order. Cost: O(B) at any dataset size and any
        step (the lazy permutation of trainer/order.py: step 1,000,000 costs what step 0 does)."""
        return self._batches.global_ids(self.faults.batch_step(step))

    def fed_rows(self, step: int) -> np.ndarray:
        """int32 [B, L+1]: the global batch `step` was fed, faults applied (bad-batch rows swapped in).
        Cost: B rows read and, with a bad-batch fault, hashed; no step is run, nothing grows with the
        run's length."""
        return fed_rows(self.source, self._batches, self.faults, self.seq_len, step)

    def fed_hashes(self, step: int) -> np.ndarray:
        """uint64 [B]: the example hashes of the batch `step` was fed, as the trace records them."""
        return self.example_hashes(self.fed_rows(step))

    def injected_positions(self, step: int) -> list[int]:
        """Global batch positions a recorded bad-batch fault replaced at `step` (empty otherwise).
        Reads the manifest only."""
        return injected_positions(self._manifest, step, self.cfg.data.global_batch_size)

    def decode_tokens(self, tokens) -> str | None:
        """The byte tokenizer's text of `tokens` (None when the run's vocabulary is not the byte
        tokenizer's)."""
        return decode_tokens(self.cfg.model.vocab_size, tokens)

    # ------------------------------------------------------------------ bundles (replay pack)

    def write_examples(self, path: str | os.PathLike, ids) -> dict:
        """Writes the rows of examples `ids` to `path` (the bundle's examples file, read back by
        `carried(path)`); returns its metadata ({"examples": distinct ids, "seq_len", ...}). Cost:
        the rows of those examples (B per packed step), nothing else of the source or the run."""
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        return datalib.write_example_file(path, self.source, ids, self.seq_len)

    def carried(self, path: str | os.PathLike) -> "TrainerData":
        """This run's data served only from the examples file `path` (what a bundle carries)."""
        view = TrainerData(self._manifest, self._path, whole_source=True)
        view._cfg, view._plan = self._cfg, self._plan
        view._source = datalib.open_example_file(path, self.cfg.model.vocab_size)
        return view

    # ------------------------------------------------------------------ the manifest's data section

    @staticmethod
    def described_source(info: dict) -> "DescribedSource":
        """The source a manifest's "data" section describes ({"path", "dtype", ...}), unvalidated:
        FileNotFoundError when it is not on this machine, DataError when it cannot be read."""
        spec = info.get("path")
        if not spec:
            raise FileNotFoundError("the manifest names no data source")
        if not spec.startswith(datalib.EMBEDDED_PREFIX) and not os.path.isfile(spec):
            raise FileNotFoundError(spec)
        return DescribedSource(datalib.open_source(spec, info.get("dtype", "uint16")))


class DescribedSource:
    """A token source opened from a manifest's data section alone (audit's duplicate windows)."""

    def __init__(self, source: datalib.TokenSource):
        self.source = source

    def fingerprint(self) -> str:
        """xxh3_128 of the token bytes, dtype and length: one pass over the file."""
        return self.source.fingerprint()

    def window_hashes(self, ids, seq_len: int) -> np.ndarray:
        """uint64 [n]: the example hashes of windows `ids` of length seq_len + 1."""
        return datalib.example_hashes(datalib.load_batch(self.source, ids, seq_len))


def run_data(manifest: dict, run_path: str | os.PathLike, data: str | None = None,
             whole_source: bool = False) -> TrainerData:
    """The data-only entry of runs the trainer's factory replays (replay/rundata.py calls it):
    cheap, nothing opened until asked, no JAX, no compile."""
    return TrainerData(manifest, run_path, data=data, whole_source=whole_source)


def fed_rows(source: datalib.TokenSource, batcher: datalib.Batcher, plan: Any, seq_len: int, step: int) -> np.ndarray:
    """int32 [B, L+1]: the global batch fed at `step` from `source` in `batcher`'s order, `plan`'s
    faults applied (a data-repeat's earlier batch, a bad-batch's swapped rows)."""
    source_step = plan.batch_step(step) if plan else step
    ids = batcher.global_ids(source_step)
    rows = datalib.load_batch(source, ids, seq_len)
    if plan:
        batch = datalib.Batch(rows[:, :-1], rows[:, 1:], datalib.example_hashes(rows), ids)
        batch = plan.alter_batch(batch, step, slice(0, rows.shape[0]))
        rows = np.concatenate([batch.inputs_BxL[:, :1], batch.targets_BxL], axis=1)
    return np.ascontiguousarray(rows, np.int32)


def injected_positions(manifest: dict, step: int, global_batch: int) -> list[int]:
    """Positions a recorded bad-batch fault replaced at `step` (empty for other steps and runs)."""
    if f"bad-batch@{step}" not in (manifest.get("faults") or []):
        return []
    from trainer.faults import bad_positions

    return bad_positions(global_batch)


def decode_tokens(vocab_size: int | None, tokens) -> str | None:
    """The byte tokenizer's text of `tokens` (None for another vocabulary): control characters
    escaped, runs of 4 or more of one character written once with "×n"."""
    if vocab_size != tokenizer.VOCAB_SIZE:
        return None
    parts = []
    for c, group in itertools.groupby(tokenizer.decode(tokens)):
        n = len(list(group))
        char = c if c.isprintable() else repr(c)[1:-1]
        parts.append(f"{char}×{n}" if n >= 4 else char * n)
    return "".join(parts)


class TrainerDataProtocol:
    """Data capabilities of TrainerReplay (self.built, self.cfg, self._manifest are the trainer's):
    the batch a step fed, read from the source and fault plan the compiled step feeds from."""

    def fed_rows(self, step: int) -> np.ndarray:
        """int32 [B, L+1]: the global token rows `step` was fed (inputs [:, :-1], targets [:, 1:]),
        faults applied. Cost: B rows read from the source; no step is run."""
        built = self.built
        return fed_rows(built.source, built.batcher, built.faults, built.cfg.model.seq_len, step)

    def example_hashes(self, rows) -> np.ndarray:
        """uint64 [n]: the per-example hashes the trace records for rows int [n, L+1]."""
        return datalib.example_hashes(rows)

    def decode_tokens(self, tokens) -> str | None:
        """Text of token ids (byte tokenizer runs), None for another vocabulary."""
        return decode_tokens(self.cfg.model.vocab_size, tokens)

    def injected_positions(self, step: int) -> list[int]:
        """Global batch positions a recorded bad-batch fault replaced at `step` (empty otherwise)."""
        return injected_positions(self._manifest, step, self.cfg.data.global_batch_size)
