"""`traces` must import and work where JAX is not installed."""

import subprocess
import sys

from tests.traces.helpers import BLOCK_JAX

TRACES_WITHOUT_JAX = BLOCK_JAX + r"""
import traces, traces.fingerprint, traces.compare, traces.run
import numpy as np
print(traces.FORMAT_VERSION, traces.fingerprint.fingerprint(np.arange(5, dtype=np.float32)) > 0)
assert not any(m.split(".")[0] in ("jax", "jaxlib") for m in sys.modules)
try:
    import jax
except ImportError:
    print("jax blocked")
"""


def test_traces_imports_without_jax():
    out = subprocess.run([sys.executable, "-c", TRACES_WITHOUT_JAX], capture_output=True, text=True, check=True).stdout
    from traces import FORMAT_VERSION

    assert out.split() == [str(FORMAT_VERSION), "True", "jax", "blocked"]
