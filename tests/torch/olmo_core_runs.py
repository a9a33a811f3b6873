"""OLMo-core's own Trainer on a tiny `olmo3_1M`, recorded through ReplayCallback: the fits that
tests/torch/test_olmo_core.py compares (imported by its fixture only, so that collecting the suite
never imports olmo_core)."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
from olmo_core.data import NumpyDataLoaderConfig, NumpyFSLDatasetConfig, TokenizerConfig
from olmo_core.data.data_loader import NumpyFSLDataLoader
from olmo_core.nn.attention import AttentionBackendName, SlidingWindowAttentionConfig
from olmo_core.nn.transformer import TransformerConfig
from olmo_core.optim import AdamWConfig
from olmo_core.train import Duration, TrainerConfig
from olmo_core.train.callbacks import Callback, CheckpointerCallback
from olmo_core.train.train_module import TransformerTrainModuleConfig

from replay.torch.olmo_core import ReplayCallback

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
    model = TransformerConfig.olmo3_1M(
        vocab_size=VOCAB, attn_backend=AttentionBackendName.torch,  # flash_2 (the default) needs a GPU
        sliding_window=SlidingWindowAttentionConfig(pattern=[8, 8, 8, -1], force_full_attention_on_first_layer=False,
                                                    force_full_attention_on_last_layer=True)).build(init_device="cpu")
    module = TransformerTrainModuleConfig(rank_microbatch_size=BATCH * SEQ, max_sequence_length=SEQ,
                                          optim=AdamWConfig(lr=1e-2)).build(model)
    loader = NumpyDataLoaderConfig(global_batch_size=BATCH * SEQ, seed=0, work_dir=str(root / "work")).build(dataset(root))
    if loader_class is not None:
        loader.__class__ = loader_class
    # Checkpoints every SAVE_EVERY steps: OLMo-core saves them in post_train_batch, where the save also
    # logs (and clears) the step's metrics.
    callbacks = {"checkpointer": CheckpointerCallback(save_interval=SAVE_EVERY), **(callbacks or {})}
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
