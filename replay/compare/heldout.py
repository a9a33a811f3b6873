"""The held-out rows a compared pair is evaluated on: examples neither run was trained on.

Candidates are drawn from the runs' data source in an order fixed by the pair's root seed and the
stream name "replay.compare.eval", so the same pair is evaluated on the same rows every time; a
candidate whose hash either trace records as fed before the last evaluated step is skipped
(traces.first_fed, through the trace index). Both runs read the same source (checked by its
fingerprint), so both are evaluated on the same bytes.

Cost: reading 4x the rows asked for, and one index lookup a segment per run (traces/fed.py: at
1.4M steps ~88K block reads for 1,024 hashes); nothing proportional to the run's length is held.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from replay.compare.errors import CompareInputError
from replay import rundata
from traces import first_fed

STREAM = "replay.compare.eval"


def _seed(root_seed: int) -> int:
    import xxhash

    return xxhash.xxh3_64_intdigest(f"{STREAM}:{root_seed}".encode())


def _data_fingerprint(manifest: dict) -> str | None:
    """The data source's fingerprint a run recorded: a trainer run's manifest "data", a reference
    run's config "data" (trainer/reference_train.py)."""
    for where in (manifest.get("data"), (manifest.get("config") or {}).get("data")):
        if isinstance(where, dict) and isinstance(where.get("fingerprint"), str):
            return where["fingerprint"]
    return None


def held_out_rows(sides: list[Any], n: int, before_step: int) -> tuple[np.ndarray, int]:
    """(int32 rows [n, L+1], how many candidates were skipped as trained on) for `sides`.

    The rows come from the first side's data-only view (replay/rundata.py: its config's whole
    source, never a bundle's carried rows, nothing compiled): `n_examples`, `seed`,
    `example_rows(ids)` and `example_hashes(rows)`."""
    described = [_data_fingerprint(s.run.manifest) for s in sides]
    if None not in described and described[0] != described[1]:
        raise CompareInputError(f"{sides[0].path} and {sides[1].path} read different data (fingerprints "
                                f"{described[0][:12]} and {described[1][:12]}); compare --eval needs runs on the same data")
    try:
        view = rundata.run_data(sides[0].run, whole_source=True)
        for name, what in (("n_examples", "n_examples, the examples of its source"), ("seed", "seed, the run's root seed"),
                           ("example_rows", "example_rows(ids) -> int32 [n, L+1]"),
                           ("example_hashes", "example_hashes(rows) -> uint64 [n]")):
            rundata.capability(view, name, what)
    except rundata.NoDataEntry as e:
        raise CompareInputError(f"{sides[0].path}: compare --eval cannot draw held-out rows: {e}") from None
    candidates = np.random.default_rng(_seed(view.seed)).permutation(view.n_examples)[:4 * n]
    rows = view.example_rows(candidates)
    hashes = view.example_hashes(rows)
    trained: set[int] = set()
    for s in sides:
        trained |= set(first_fed(s.run, hashes, before_step=before_step))
    keep = np.array([int(h) not in trained for h in hashes], bool)
    if keep.sum() < n:
        raise CompareInputError(f"only {int(keep.sum())} of {len(hashes)} candidate examples of {view.source_name} are "
                                f"not trained on by step {before_step}; evaluate fewer (--examples) or earlier steps")
    return rows[keep][:n], int((~keep[:np.flatnonzero(keep)[n - 1] + 1]).sum())
