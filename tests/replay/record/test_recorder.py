"""The record's batch hash is the format's (FORMAT.md: xxh3-64 over the batch size and the
per-example hashes): pinned, so moving or rewriting it cannot change what old runs hold."""

import numpy as np

from replay.record.recorder import batch_hash

GOLDEN_BATCH_HASH = 4446074722206199714  # as tests/trainer/test_data.py pins trainer.data's


def test_batch_hash_is_the_recorded_format():
    assert batch_hash(np.array([1, 2, 3], dtype=np.uint64)) == GOLDEN_BATCH_HASH
    assert batch_hash(np.array([3, 2, 1], dtype=np.uint64)) != GOLDEN_BATCH_HASH  # order counts


def _recorder(tmp_path, monkeypatch, ready: bool):
    from replay.record import recorder as rec
    from traces import Schema, TraceWriter

    monkeypatch.setattr(rec, "_ready", lambda tree: ready)
    schema = Schema(examples_per_step=2, rng_words=0, metrics=(("loss", "loss"),))
    writer = TraceWriter(tmp_path / "trace", schema)
    return rec.Recorder(schema, writer, "step"), writer


def _metrics(k: int) -> dict:
    return {"loss": np.float32(k), "rng": np.zeros(0, np.uint32)}


def test_records_still_running_are_not_waited_for_and_are_written_in_order(tmp_path, monkeypatch):
    """The host does not block on a record whose step is still running (it would wait on the device,
    and on a CPU backend compete with it for the cores); it holds at most MAX_PENDING of them, then
    waits for the oldest; flush() writes every one, in step order."""
    recorder, writer = _recorder(tmp_path, monkeypatch, ready=False)
    n = recorder.MAX_PENDING
    for k in range(n):
        recorder.record(k, _metrics(k), np.array([2 * k, 2 * k + 1], np.uint64))
        assert recorder.last is None  # nothing ready: nothing fetched yet
    recorder.record(n, _metrics(n), np.array([2 * n, 2 * n + 1], np.uint64))
    assert recorder.last.step == 0  # one over the bound: the oldest is waited for
    recorder.flush()
    assert recorder.last.step == n
    writer.close()
    from traces import TraceReader, Schema

    trace = TraceReader(tmp_path / "trace", Schema(examples_per_step=2, rng_words=0, metrics=(("loss", "loss"),)))
    assert [r.step for r in trace.records()] == list(range(n + 1))
    assert [float(r.metrics[0]) for r in trace.records()] == [float(k) for k in range(n + 1)]


def test_a_ready_record_is_written_at_once(tmp_path, monkeypatch):
    recorder, writer = _recorder(tmp_path, monkeypatch, ready=True)
    recorder.record(0, _metrics(0), np.array([0, 1], np.uint64))
    assert recorder.last is not None and recorder.last.step == 0
    writer.close()
