"""The record's batch hash is the format's (FORMAT.md: xxh3-64 over the batch size and the
per-example hashes): pinned, so moving or rewriting it cannot change what old runs hold."""

import numpy as np
import pytest

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
    and on a CPU backend compete with it for the cores); it holds at most MAX_HELD of them, then
    waits for the oldest WRITE_BATCH; flush() writes every one, in step order."""
    recorder, writer = _recorder(tmp_path, monkeypatch, ready=False)
    n, batch = recorder.MAX_HELD, recorder.WRITE_BATCH
    for k in range(n):
        recorder.record(k, _metrics(k), np.array([2 * k, 2 * k + 1], np.uint64))
        assert recorder.last is None and recorder.held == k + 1  # nothing ready: nothing fetched yet
    recorder.record(n, _metrics(n), np.array([2 * n, 2 * n + 1], np.uint64))
    assert recorder.last.step == batch - 1 and recorder.held == n + 1 - batch  # over the bound: the oldest waited for
    recorder.flush()
    assert recorder.last.step == n and recorder.held == 0
    writer.close()
    from traces import TraceReader, Schema

    trace = TraceReader(tmp_path / "trace", Schema(examples_per_step=2, rng_words=0, metrics=(("loss", "loss"),)))
    assert [r.step for r in trace.records()] == list(range(n + 1))
    assert [float(r.metrics[0]) for r in trace.records()] == [float(k) for k in range(n + 1)]


def test_ready_records_are_written_a_batch_at_a_time_never_the_newest(tmp_path, monkeypatch):
    """Ready records wait until WRITE_BATCH of them are held besides the newest (the write path then
    runs warm for the batch, ~100 us less of the loop's CPU a step at a ~1 ms step), and the newest
    is never among them (a gather still in flight is never read in the call that queued it)."""
    recorder, writer = _recorder(tmp_path, monkeypatch, ready=True)
    batch = recorder.WRITE_BATCH
    for k in range(batch):
        recorder.record(k, _metrics(k), np.array([2 * k, 2 * k + 1], np.uint64))
        assert recorder.last is None
    recorder.record(batch, _metrics(batch), np.array([0, 1], np.uint64))
    assert recorder.last.step == batch - 1 and recorder.held == 1
    writer.close()


def _packed_host(record: dict):
    """The host PackedRecord run.step's program returns for `record` (packed on device, fetched)."""
    from replay.record.packed import PackedRecord, pack

    packed = pack(record)
    return PackedRecord(np.asarray(packed.words), packed.layout)


def test_a_packed_record_is_read_by_slices_into_the_same_record_as_by_name(monkeypatch):
    """to_record reads run.step's packed record by one plan of slices (a record costs views of one
    vector, not a lookup per value); what it builds must equal, field by field and bit by bit, what
    reading the same values by name builds. The slice path must be the one taken (counted), and a
    layout it cannot slice (metrics not in the schema's order) falls back to reading by name."""
    from replay.record import recorder as rec
    from traces import Schema
    from traces.schema import encode_record

    rng = np.random.default_rng(0)
    bits = lambda shape: rng.integers(0, 2**32, size=shape, dtype=np.uint32)  # NaN payloads, -0.0, subnormals
    record = {"loss": bits(()).view(np.float32), "grad_norm": bits(()).view(np.float32),
              "example_loss": bits(4).view(np.float32), "rng": bits(2),
              "fingerprints": bits((3, 2)), "rms": bits(3).view(np.float32)}
    schema = Schema(examples_per_step=4, rng_words=2, metrics=(("loss", "loss"), ("grad_norm", "backward")),
                    tensors=(("state/w", "state"), ("forward/h", "forward"), ("update/w", "update")),
                    example_metrics=("loss",))
    hashes = np.arange(4, dtype=np.uint64)
    sliced = []
    monkeypatch.setattr(rec, "_from_packed", lambda *a, f=rec._from_packed: sliced.append(1) or f(*a))
    host = _packed_host(record)
    fast, by_name = rec.to_record(schema, 7, host, hashes), rec.to_record(schema, 7, dict(host), hashes)
    assert sliced == [1]
    assert encode_record(schema, fast) == encode_record(schema, by_name)
    assert fast.fingerprints.tolist() == [(int(a) << 32) | int(b) for a, b in record["fingerprints"]]
    assert fast.metrics.view(np.uint32).tolist() == [record["loss"].view(np.uint32), record["grad_norm"].view(np.uint32)]
    # The step level (no fingerprints) and a layout in another order than the schema's metrics.
    step_only = {k: v for k, v in record.items() if k not in ("fingerprints", "rms")}
    swapped = {"grad_norm": record["grad_norm"], **{k: v for k, v in step_only.items() if k != "grad_norm"}}
    for values in (step_only, swapped):
        sliced.clear()
        host = _packed_host(values)
        fast, by_name = rec.to_record(schema, 7, host, hashes), rec.to_record(schema, 7, dict(host), hashes)
        assert sliced == ([1] if values is step_only else [])
        assert encode_record(schema, fast) == encode_record(schema, by_name) and fast.fingerprints is None
        assert float(fast.metrics[0]) == float(by_name.metrics[0]) or np.isnan(fast.metrics[0])
        assert fast.metrics.view(np.uint32)[0] == record["loss"].view(np.uint32)


def test_a_packed_record_with_the_wrong_tensor_count_is_refused():
    import pytest
    from replay.record import recorder as rec
    from traces import Schema

    schema = Schema(examples_per_step=2, rng_words=0, metrics=(("loss", "loss"),), tensors=(("state/w", "state"),))
    host = _packed_host({"loss": np.float32(1), "rng": np.zeros(0, np.uint32),
                         "fingerprints": np.zeros((2, 2), np.uint32), "rms": np.zeros(2, np.float32)})
    with pytest.raises(rec.RecordSchemaError, match="2 fingerprints for the schema's 1 tensors"):
        rec.to_record(schema, 0, host, np.zeros(2, np.uint64))


_STOPS_AT_7 = """
import sys
import replay
from replay.record import recorder
from tests.replay.test_record_api import batch_at, make
recorder._ready = lambda tree: False  # every record still running: the recorder holds them all (7 < MAX_HELD)
loop = make({"scale": 1.0})
run = replay.init(sys.argv[1], config={"scale": 1.0}, entrypoint=make)
step = run.step(level="step")(loop.step)
state = loop.init()
for k in range(20):
    if k == 7:
        raise RuntimeError("the loop stops at step 7")
    state, _ = step(state, batch_at(k))
run.finish()
"""


def test_a_loop_that_stops_on_an_error_without_finishing_keeps_the_records_in_flight(tmp_path):
    """The README's loop (replay.init, run.step, run.finish(), no `with`) stopped by an uncaught error
    at step 7: the steps 0-6 it dispatched are all in the trace, the records still held on device
    written at exit (one stderr line says so), and the run stays incomplete. Without
    that, the trace ended at step 2: the four steps before the error, the ones a user wants, lost."""
    import subprocess
    import sys
    from pathlib import Path

    from traces import Run

    root = Path(__file__).resolve().parents[3]
    done = subprocess.run([sys.executable, "-c", _STOPS_AT_7, str(tmp_path / "run")], cwd=root, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 1 and "the loop stops at step 7" in done.stderr, done.stderr
    run = Run.open(tmp_path / "run")
    assert (run.trace.start, run.trace.end, run.status) == (0, 7, "crashed"), (run.trace.end, run.status)
    assert [r.step for r in run.trace.records()] == list(range(7))
    assert "at exit wrote the 7 record(s) still in flight, through step 6" in done.stderr, done.stderr


def test_a_ctrl_c_while_a_record_is_fetched_leaves_it_queued_for_the_close_to_write(tmp_path, monkeypatch):
    """Ctrl-C lands where the loop's thread waits: in the fetch of the oldest record held. That record
    stays queued, so the close that follows (run.close, the trainer's, at exit) writes it and every one
    after it. Before, it was dequeued first: lost, and the writer then refused the next step as a gap,
    so every record held was lost (`replay train` interrupted lost its last ~5 steps)."""
    from replay.record import recorder as rec
    from traces import TraceReader

    recorder, writer = _recorder(tmp_path, monkeypatch, ready=False)
    n = recorder.MAX_HELD
    for k in range(n):
        recorder.record(k, _metrics(k), np.array([2 * k, 2 * k + 1], np.uint64))
    real, calls = rec._fetch, []

    def interrupted_once(tree):
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real(tree)

    monkeypatch.setattr(rec, "_fetch", interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        recorder.record(n, _metrics(n), np.array([2 * n, 2 * n + 1], np.uint64))  # over the bound: waits for step 0
    recorder.flush()
    writer.close()
    trace = TraceReader(tmp_path / "trace", writer.schema)
    assert [r.step for r in trace.records()] == list(range(n + 1))
