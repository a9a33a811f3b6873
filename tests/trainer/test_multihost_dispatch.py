"""Multi-host recording off the critical path (issue 12): with several processes the per-example
hashes are gathered on device behind the step (replay/record/gather.py), so step k's hashes reach
the host only after step k+1 was dispatched, and the trace is byte-identical to the one the old
blocking gather (before each dispatch) wrote. Checked by order of events, never by wall-clock."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from replay.record.gather import GatheredHashes, Timeline


def _recorder(tmp_path, monkeypatch):
    from replay.record import recorder as rec
    from traces import Schema, TraceWriter

    monkeypatch.setattr(rec, "_ready", lambda tree: True)  # every step's outputs already done
    schema = Schema(examples_per_step=2, rng_words=0, metrics=(("loss", "loss"),))
    timeline = Timeline()
    return rec.Recorder(schema, TraceWriter(tmp_path / "trace", schema), "step", timeline=timeline), timeline


def _gathered(k: int) -> GatheredHashes:
    words = np.array([2 * k, 2 * k + 1], np.uint64).view(np.uint32).reshape(-1, 2)
    return GatheredHashes(jnp.asarray(words))


def test_a_gathered_record_is_read_only_after_the_next_dispatch(tmp_path, monkeypatch):
    """Even when step k's gather is already done, the call that queued it does not read it."""
    recorder, timeline = _recorder(tmp_path, monkeypatch)
    for k in range(3):
        h = _gathered(k)
        assert h.is_ready() and np.array_equal(np.asarray(h), [2 * k, 2 * k + 1])
        recorder.record(k, {"loss": np.float32(k), "rng": np.zeros(0, np.uint32)}, h)
    recorder.flush()
    order = timeline.order()
    for k in range(2):
        assert order.index(("dispatched", k + 1)) < order.index(("gathered", k)) < order.index(("written", k))
    assert recorder.last.step == 2 and list(recorder.last.example_hashes) == [4, 5]
    recorder.writer.close()


@pytest.mark.slow
def test_two_processes_dispatch_ahead_of_the_gather_and_record_the_same_trace(tmp_path):
    from bench.multihost_dispatch import _tree_bytes, run

    # Step level: the gather is of the per-example hashes, which every level records; what the
    # layer level adds (fingerprints, per-example losses) comes back with the step's outputs, not
    # through this gather, and costs each process a bigger compile. One block: the gather does not
    # depend on the model, and its compiles are cheaper.
    overrides = ["trace.level=step", "model.n_layers=1"]
    result = run(steps=4, warmup=0, overrides=overrides, out=tmp_path, rounds=1)
    assert result["overrides"] == overrides
    assert result["traces_identical"]  # the asynchronous gather writes the old gather's bytes
    for mode in ("blocking", "async"):
        for i in range(2):
            events = json.loads((tmp_path / f"timeline-{mode}-0-{i}.json").read_text())
            order = [(e, s) for e, s, _ in events if e != "finished"]
            for k in range(3):
                gathered, next_dispatch = order.index(("gathered", k)), order.index(("dispatched", k + 1))
                if mode == "async":
                    assert next_dispatch < gathered, (mode, i, k, order)
                else:  # the old gather: before the step's own dispatch, so the check above would fail
                    assert gathered < order.index(("dispatched", k)), (mode, i, k, order)
    assert result["async"]["gathered_after_next_dispatch"] and not result["blocking"]["gathered_after_next_dispatch"]
    # The byte comparison sees a one-byte change.
    seg = sorted((tmp_path / "async-0" / "trace").iterdir())[0]
    data = bytearray(seg.read_bytes())
    data[-1] ^= 1
    seg.write_bytes(bytes(data))
    assert _tree_bytes(tmp_path / "blocking-0" / "trace") != _tree_bytes(tmp_path / "async-0" / "trace")
