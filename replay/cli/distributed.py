"""Several processes (jax.distributed, one per host): the options `replay train` and `replay run`
share, and the order they impose. The same command is started once per process with the same
--coordinator and --num-processes and its own --process-id; jax.distributed must be initialized
before anything touches a device, so a command calls `initialize` first. Only process 0 prints
what the command reports (`prints_report`; status and progress: `first_process_prints`); errors are printed by every process.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Annotated, Optional

import typer

from replay.cli import console

Coordinator = Annotated[Optional[str], typer.Option(help="Multi-process: coordinator HOST:PORT (jax.distributed).")]
NumProcesses = Annotated[int, typer.Option(help="Multi-process: number of processes.")]
ProcessId = Annotated[int, typer.Option(help="Multi-process: this process's index.")]


def initialize(coordinator: str | None, num_processes: int, process_id: int) -> None:
    """jax.distributed.initialize for --coordinator (nothing without it). Must come before anything
    touches a device."""
    if coordinator is None:
        if num_processes != 1 or process_id != 0:
            console.fail(f"--num-processes {num_processes} --process-id {process_id} need --coordinator HOST:PORT "
                         "(the same on every process); or drop them to run in one process")
        return
    if num_processes < 1 or not 0 <= process_id < num_processes:
        console.fail(f"--process-id {process_id} is not one of the {num_processes} processes (0..{num_processes - 1})")
    import jax

    try:
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)
    except (RuntimeError, ValueError) as e:
        console.fail(f"--coordinator {coordinator}: jax.distributed could not start ({' '.join(str(e).split())[:200]}); "
                     "start every process with the same --coordinator and --num-processes before anything else")


def process_index() -> int:
    import jax

    return jax.process_index()


def prints_report(coordinator: str | None) -> bool:
    """Whether this process prints the command's report (one process: yes; several: process 0)."""
    return coordinator is None or process_index() == 0


@contextmanager
def first_process_prints(coordinator: str | None):
    """Inside: only process 0 of a multi-process command (--coordinator given) prints (reports,
    status, progress). An error leaving the block is printed by every process: the quiet ends
    before the CLI prints it."""
    quiet = not prints_report(coordinator)
    before = console.out.quiet, console.err.quiet
    if quiet:
        console.out.quiet = console.err.quiet = True
    try:
        yield
    finally:
        console.out.quiet, console.err.quiet = before


def any_process(flag: bool) -> bool:
    """Whether `flag` holds on any process (itself with one): a verdict every process exits with."""
    import jax

    if jax.process_count() == 1:
        return flag
    import numpy as np
    from jax.experimental import multihost_utils

    return bool(np.max(multihost_utils.process_allgather(np.int32(flag))))
