"""OLMo-core's own Trainer on a tiny `olmo3_1M`, recorded through ReplayCallback: the fits that
tests/torch/test_olmo_core*.py compare (imported by their fixtures only, so that collecting the
suite never imports olmo_core).

`launch` starts a fit on 1 or 2 ranks the way OLMo-core is launched (torchrun's environment
variables, `prepare_training_environment`, gloo on 127.0.0.1), each rank a process running this
module; `seed_runs` makes the seed scenario's runs from them."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from olmo_core.data import NumpyDataLoaderConfig, NumpyFSLDatasetConfig, TokenizerConfig
from olmo_core.data.data_loader import NumpyFSLDataLoader
from olmo_core.nn.attention import AttentionBackendName, SlidingWindowAttentionConfig
from olmo_core.nn.transformer import TransformerConfig
from olmo_core.optim import AdamWConfig
from olmo_core.distributed.parallel import DataParallelType
from olmo_core.train import Duration, TrainerConfig
from olmo_core.train.callbacks import Callback, CheckpointerCallback
from olmo_core.train.train_module import TransformerDataParallelConfig, TransformerTrainModuleConfig

from replay.torch.olmo_core import ReplayCallback
from tests.ports import free_port

VOCAB, SEQ, BATCH, STEPS, K = 512, 16, 4, 10, 5
SAVE_EVERY = 3


class DoubleLR(Callback):
    """The injected learning-rate change: every param group's lr doubled from step `at` on."""

    def __init__(self, at: int):
        self.at = at

    def pre_optim_step(self):
        if self.trainer.global_step - 1 == self.at:
            for group in self.trainer.train_module.optim.param_groups:
                group["lr"] *= 2


class Crash(Callback):
    """A fit that dies at step `at` (after a checkpoint, before the next)."""

    def __init__(self, at: int):
        self.at = at

    def pre_step(self, batch):
        if self.trainer.global_step - 1 == self.at:
            raise RuntimeError(f"crash at step {self.at}")


class OffByOneResume(NumpyFSLDataLoader):
    """A loader whose resume starts one global batch before where its checkpoint stopped."""

    def load_state_dict(self, state_dict):
        super().load_state_dict({**state_dict, "tokens_processed": state_dict["tokens_processed"] - self.global_batch_size})


class ContiguousShards(NumpyFSLDataLoader):
    """MaxText's olmo_grain sharding, injected to show the audit can fail: each rank reads a contiguous
    1/world of the epoch's order and resumes at batches_processed * its per-rank batch, so the
    order depends on the world size, and a resume on another world size feeds seen instances."""

    def _get_local_instance_indices(self, indices: np.ndarray):
        per_rank = self.rank_batch_size // self.dataset.sequence_length
        indices = np.asarray(indices[: self.total_size])
        shard = indices.reshape(self.dp_world_size, -1)[self.dp_rank]
        return shard[self.batches_processed * per_rank:]


class FullDisk(Callback):
    """Rank 0's recording fails at step `at` (the trace can be neither written nor closed), as on a
    full disk."""

    priority = 3  # before ReplayCallback's pre_step

    def __init__(self, at: int):
        self.at = at

    def pre_step(self, batch):
        if self.trainer.global_step - 1 == self.at and torch.distributed.get_rank() == 0:
            def full(*args):
                raise OSError(28, "No space left on device")
            run = self.trainer.callbacks["replay"]._run
            run.flush = run._run.close = full


# What a fit's spec names (launch): the loader class or the callbacks it adds.
VARIANTS = {"contiguous": lambda: {"loader_class": ContiguousShards}, "full_disk": lambda: {"callbacks": {"full_disk": FullDisk(3)}}}


def dataset(root: Path):
    tokens = root / "tokens.npy"
    if not tokens.exists():
        np.random.default_rng(0).integers(1, VOCAB, size=SEQ * 64, dtype=np.uint16).tofile(tokens)
    tok = TokenizerConfig(vocab_size=VOCAB, eos_token_id=0, pad_token_id=0)
    ds = NumpyFSLDatasetConfig(tokenizer=tok, paths=[str(tokens)], sequence_length=SEQ, work_dir=str(root / "work")).build()
    ds.prepare()
    return ds


def fit(root: Path, name: str, steps: int, callbacks: dict | None = None, loader_class=None,
        world_size: int | None = None) -> None:
    """One fit of OLMo-core's Trainer; a second fit of the same name resumes from its checkpoint."""
    torch.manual_seed(0)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    model = TransformerConfig.olmo3_1M(
        vocab_size=VOCAB, attn_backend=AttentionBackendName.torch,  # flash_2 (the default) needs a GPU
        sliding_window=SlidingWindowAttentionConfig(pattern=[8, 8, 8, -1], force_full_attention_on_first_layer=False,
                                                    force_full_attention_on_last_layer=True)).build(init_device="cpu")
    ddp = TransformerDataParallelConfig(name=DataParallelType.ddp) if world > 1 else None
    module = TransformerTrainModuleConfig(rank_microbatch_size=BATCH * SEQ // world, max_sequence_length=SEQ,
                                          optim=AdamWConfig(lr=1e-2), dp_config=ddp).build(model)
    loader = NumpyDataLoaderConfig(global_batch_size=BATCH * SEQ, seed=0, work_dir=str(root / "work")).build(dataset(root))
    if loader_class is not None:
        loader.__class__ = loader_class
    # Checkpoints every SAVE_EVERY steps: OLMo-core saves them in post_train_batch, where the save also
    # logs (and clears) the step's metrics.
    # On several ranks the saves are synchronous: OLMo-core 3.0.0 records an async save's duration as a
    # metric at the step each rank's save happens to finish, so ranks a step apart reduce different
    # metric sets in its bookkeeping all-reduce, and gloo aborts the fit ("collective mismatch", seen
    # once in three 2-rank runs here).
    callbacks = {"checkpointer": CheckpointerCallback(save_interval=SAVE_EVERY, save_async=None if world == 1 else False),
                 **(callbacks or {})}
    config = TrainerConfig(save_folder=str(root / "olmo" / name), max_duration=Duration.steps(steps),
                           metrics_collect_interval=1000, callbacks=callbacks)
    # The user's side: the two lines the README shows.
    config = config.with_callback("replay", ReplayCallback(str(root / name)))
    trainer = config.build(module, loader)
    if world_size is not None:  # what the loader says in a data-parallel run (after the Trainer's own check)
        loader.dp_world_size = world_size
    trainer.fit()


def train_all(root: Path) -> list[str]:
    """The six runs of test_olmo_core.py's docstring, in nine fits; returns what the callback logged."""
    # torch.distributed.checkpoint logs every save and load at DEBUG through a logger that propagates
    # to the root, where pytest's capture formats each record: 50 s of this module's 90 on 2 cores.
    dcp, ours, logged = logging.getLogger("c10d-NullHandler-dcp_logger"), logging.getLogger("replay.torch.olmo_core"), Logged()
    was, threads = dcp.propagate, torch.get_num_threads()
    dcp.propagate = False
    ours.addHandler(logged)
    # One thread: ops this small gain nothing from two, and on the suite's busy 2 cores torch's
    # two spin-waiting threads made a 10-step fit 17 s instead of 2.4 s (measured at load 7).
    torch.set_num_threads(1)
    try:
        fit(root, "a", STEPS)
        fit(root, "a2", STEPS)
        fit(root, "b", K)
        fit(root, "b", STEPS)
        fit(root, "lr", STEPS, callbacks={"double_lr": DoubleLR(at=K)})
        fit(root, "refeed", K)
        fit(root, "refeed", STEPS, loader_class=OffByOneResume)
        try:
            fit(root, "crash", STEPS, callbacks={"crash": Crash(at=K)})
        except RuntimeError as e:
            assert str(e) == f"crash at step {K}", e
        fit(root, "crash", STEPS)
    finally:
        dcp.propagate = was
        torch.set_num_threads(threads)
        ours.removeHandler(logged)
    return logged.lines


class Logged(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def launch(root: Path, fits: list[tuple[str, int, str | None]], world: int, timeout: float = 600,
           grace: float = 30) -> None:
    """Runs `fits` ((run name, steps, VARIANTS name or None), one after the other) on `world` ranks, one
    process each (torchrun's environment; gloo on 127.0.0.1): a fit of a name fitted before resumes
    from OLMo-core's checkpoint, on any world size. Raises RuntimeError with a failed rank's output
    tail and every rank's exit code; the ranks still running `grace` seconds after one failed are
    killed (-9). One process for several fits: importing torch and olmo_core costs more than a fit."""
    port = free_port()  # for the rendezvous
    repo = Path(__file__).resolve().parents[2]
    argv = [sys.executable, "-m", "tests.torch.olmo_core_runs", str(root)] + [f"{n}:{k}:{v or ''}" for n, k, v in fits]
    procs, logs = [], [root / f"{fits[0][0]}.{len(fits)}fits.rank{r}of{world}.log" for r in range(world)]
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
               "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
        with open(logs[rank], "w") as out:
            procs.append(subprocess.Popen(argv, cwd=repo, env=env, stdout=out, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.returncode not in (None, 0) for p in procs):  # the others may wait in a collective forever
                deadline = min(deadline, time.monotonic() + grace)
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    failed = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
    if failed:
        rank, code = failed[0]
        codes = ", ".join(f"rank {r} {p.returncode}" for r, p in enumerate(procs))
        raise RuntimeError(f"{[f[0] for f in fits]} on {world} ranks exited {codes}; rank {rank}'s output:\n"
                           f"{logs[rank].read_text()[-3000:]}")


TAKEN_SAYS = "taken: exists and is not empty"  # rank 0's reason for the last fit of seed_runs(checks=True)


def seed_runs(root: Path, checks: bool = False) -> dict[str, Any]:
    """The seed scenario under OLMo-core: trained to step K on one rank (OLMo-core checkpoints at K),
    then resumed from that checkpoint on two ranks ("1->2") or on one ("1->1"), each recording into
    one replay run. checks: also the runs that show failures are caught (in the same processes):
    "1->2 contiguous", the scenario with ContiguousShards' loader; "full disk", a fit on two
    ranks from step 0 whose rank 0 cannot write its trace from step 3 on (FullDisk); and last, a fit
    on two ranks into "taken", a folder rank 0 cannot open as a run, which must end both ranks:
    "taken error" is the launch's error (None if it ended cleanly), "logs" the two ranks' logs.
    Each process imports torch and olmo_core (~4.6 CPU s), so the checks share the processes."""
    first = [("seed_1to2", K, None), ("seed_1to1", K, None)] + ([("seed_bad", K, "contiguous")] if checks else [])
    launch(root, first + [("seed_1to1", STEPS, None)], 1)
    second = [("seed_bad", STEPS, "contiguous"), ("full_disk", STEPS, "full_disk"), ("taken", 2, None)] if checks else []
    if checks:
        (root / "taken").mkdir()
        (root / "taken" / "notes.txt").write_text("not a run")
    failed = None
    try:
        launch(root, [("seed_1to2", STEPS, None)] + second, 2)
    except RuntimeError as e:
        if not checks or TAKEN_SAYS not in str(e):  # the fits before "taken" must have ended cleanly
            raise
        failed = str(e)
    runs = {"1->2": root / "seed_1to2", "1->1": root / "seed_1to1"}
    if not checks:
        return runs
    logs = [root / f"seed_1to2.{1 + len(second)}fits.rank{r}of2.log" for r in range(2)]
    return {**runs, "1->2 contiguous": root / "seed_bad", "full disk": root / "full_disk", "taken": root / "taken",
            "taken error": failed, "logs": logs}


def _rank_main(root: str, *fits: str) -> None:
    import olmo_core.distributed.parallel
    from olmo_core.train import prepare_training_environment, teardown_training_environment

    prepare_training_environment(backend="gloo")
    torch.set_num_threads(1)  # ops this small gain nothing from more; the machine's cores are shared
    logging.getLogger("c10d-NullHandler-dcp_logger").propagate = False
    try:
        for spec in fits:
            name, steps, variant = spec.split(":")
            # OLMo-core builds its device mesh once per process (a job is one fit); each fit here builds one
            olmo_core.distributed.parallel._WORLD_MESH = None
            fit(Path(root), name, int(steps), **(VARIANTS[variant]() if variant else {}))
    finally:
        teardown_training_environment()


if __name__ == "__main__":
    _rank_main(*sys.argv[1:])
