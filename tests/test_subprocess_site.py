"""tests/subprocess_site/sitecustomize.py: process 1 of a two-process job keeps its compiled program
in the session's persistent compilation cache as process 0 does (JAX alone writes process 0's
only), and a process started without the folder on its path is as before (the check can fail);
a process the session starts collects garbage as the workers do."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.ports import free_port

SITE = str(Path(__file__).resolve().parent / "subprocess_site")

# One program over both processes' devices, compiled by each process under its own cache key.
_JOB = r"""
import sys
import jax, jax.numpy as jnp
jax.distributed.initialize(coordinator_address="127.0.0.1:" + sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
from jax.sharding import NamedSharding, PartitionSpec
mesh = jax.make_mesh((2,), ("d",))
x = jax.make_array_from_process_local_data(NamedSharding(mesh, PartitionSpec("d")), jnp.ones((1, 3)))
total = jax.jit(lambda a: (a * 3).sum(), out_shardings=NamedSharding(mesh, PartitionSpec()))(x)
assert float(total) == 18.0
"""


def _cached_programs(cache: Path, with_site: bool) -> list[str]:
    """Cache entries of `jit__lambda` after one two-process job writing to `cache`."""
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != SITE]
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")}
    env.update(JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
               PYTHONPATH=os.pathsep.join(([SITE] if with_site else []) + paths))
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", _JOB, port, str(pid)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for pid in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-2000:] for o in outs)
    return sorted(p.name for p in cache.iterdir() if p.name.startswith("jit__lambda"))


def test_without_the_folder_only_process_0_writes_its_entry_and_with_it_process_1_writes_its_own(tmp_path):
    cache = tmp_path / "cache"  # one folder: the XLA cache paths inside it are part of every key
    alone = _cached_programs(cache, with_site=False)
    assert len(alone) == 1, alone  # JAX's own rule: process 0's entry only
    both = _cached_programs(cache, with_site=True)
    assert len(both) == 2 and alone[0] in both, (alone, both)  # process 0 found its entry; process 1 wrote its own


def test_a_process_the_session_starts_collects_garbage_as_the_workers_do():
    import gc

    code = "import gc; print(*gc.get_threshold())"
    started = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert started.stdout.split() == ["50000", "20", "20"] == [str(t) for t in gc.get_threshold()]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    alone = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert alone.stdout.split() == ["700", "10", "10"]  # Python's own, without the folder
