"""How many times a scan of a run in a bucket waits on the network: `replay audit` requests the
index parts of a window of segments at once (as bisect's trace scan does), so its round trips
grow with the windows (16 segments each), not with the segments."""

from __future__ import annotations

import json
import threading

from tests.cli_util import invoke
from tests.replay.test_audit import make_run as make_audit_run
from tests.replay.test_audit import resume_repeat
from tests.traces.emulators import upload
from traces import storage
from traces.storage.path import View


def test_audit_of_a_remote_run_waits_once_a_window_per_index_part(tmp_path, s3, monkeypatch):  # noqa: F811
    local = make_audit_run(tmp_path / "run", resume_repeat(), 1000, segment_records=2)  # 15 sealed segments
    url = upload(local, f"{s3}/{tmp_path.name}/run")
    store = storage.open_store(url)[0]
    waits = []  # one a prefetch (its requests overlap), one a range read the scan makes itself
    prefetch, read_range = View.prefetch, type(store).read_range

    def counted_prefetch(self, ranges):
        waits.append(("window", len(ranges)))
        return prefetch(self, ranges)

    def counted_read(self, key, offset, size):
        if threading.current_thread() is threading.main_thread():
            waits.append(("read", key))
        return read_range(self, key, offset, size)

    monkeypatch.setattr(View, "prefetch", counted_prefetch)
    monkeypatch.setattr(type(store), "read_range", counted_read)
    there = invoke("audit", "--json", url)
    assert there.exit_code == 1, there.output  # resume_repeat() feeds steps 10..19 again
    assert json.loads(there.stdout.replace(url, str(local))) == json.loads(invoke("audit", "--json", str(local)).stdout)
    # No range read one segment or one step at a time.
    assert [w for w in waits if w[0] == "read"] == [], waits
    # Opening's headers and seals; the index headers, block heads, tables and examples keys of
    # the 15 sealed segments; for the replayed batches found, the rows of both sides (their
    # segments' offsets, then their frames): one window each.
    assert len(waits) <= 1 + 4 + 2 * 2, waits
