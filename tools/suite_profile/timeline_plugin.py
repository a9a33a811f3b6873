"""pytest plugin: per-test wall and CPU (self + waited-for children) to $TL_DIR/<worker>.jsonl (see README.md)."""
import json, os, time
_f = None
def _out():
    global _f
    if _f is None:
        d = os.environ.get("TL_DIR", "/tmp/tl"); os.makedirs(d, exist_ok=True)
        _f = open(os.path.join(d, os.environ.get("PYTEST_XDIST_WORKER", "main") + ".jsonl"), "a")
    return _f
def _cpu():
    t = os.times(); return t.user + t.system + t.children_user + t.children_system
import pytest
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    w0, c0 = time.time(), _cpu()
    yield
    f = _out(); f.write(json.dumps({"id": item.nodeid, "t0": w0, "wall": time.time() - w0, "cpu": _cpu() - c0}) + "\n"); f.flush()
