"""Record MaxText's own training loop: `python -m replay.maxtext RUN <MaxText's train argv>`.

    python -m replay.maxtext runs/mt [--stop-at K] maxtext/configs/base.yml hardware=cpu steps=20 ...
    replay run runs/mt --steps 10:19          # restore checkpoint 10, re-run 10..19, compare bits

MaxText (`pip install "maxtext[tpu]==0.2.5"`, Python >= 3.12; tools/maxtext-env.sh builds a cached
venv with it and this package) trains through `maxtext.trainers.pre_train.train.main`, which builds
its jitted step in `maxtext.utils.train_utils.jit_train_step`. This launcher runs that `main` with
`jit_train_step` replaced by one that returns MaxText's own jitted step wrapped in `run.step(...)`:
the same program, called as MaxText calls it, also recorded (example hashes of the batch's token
rows, MaxText's scalar metrics with `learning/loss` as the loss, fingerprints of the state entering
and leaving each step, and the step exported with the run). `replay.init` opens at the first step,
after MaxText has started `jax.distributed` (several processes write one run). Checkpoints: with MaxText's
checkpointing on (enable_checkpointing=true, checkpoint_period=P) they are MaxText's own, saved by its
manager, and the run saves no copy of the state: its config records MaxText's checkpoint folder (and
run.json's `loop_checkpoints` the steps they give, for `replay show`, refreshed as MaxText saves), and a
replay with MaxText's code restores MaxText's checkpoint s as the state entering step s + 1, verified
against the trace (replay/maxtext/checkpoints.py; the state entering step 0 is rebuilt from the argv).
With MaxText's checkpointing off, replay saves the state entering step k every 10 steps into the run.

Resuming: MaxText started again with its checkpointing on restores its own latest checkpoint; its
checkpoint s holds the state after step s (optimizer count s + 1, where its loop restarts), replay's
checkpoint k the state entering step k. The recording continues the run in RUN when MaxText restarts at
the step its trace ends at (one line otherwise), on the same or another process count (another count
compiles another program: run.json's `resumed_programs`). `--stop-at K` stops MaxText's loop before
step K as a preemption would (its checkpoints of the earlier steps written), for such a resume.

The run's config is MaxText's plus its argv and process count: `make` (the run's entry point)
rebuilds MaxText's loop from them (replay/maxtext/rebuild.py), so `replay run` and `replay bisect`
replay with MaxText's code (the recorded program, first ops named), on as many processes as trained;
where MaxText is not installed it declines and the exported program (with the stored examples of a
one-process run) replays instead, unless the run's checkpoints are MaxText's own (refused in one line).

`--tap-grads` also taps the gradients inside MaxText's step (`tap_gradients`, the patch point: NNX
MaxText's `TrainStateNNX.apply_gradients`), and the replay's `make` taps the same. `--tap-forward` taps
every module output inside the model (replay/maxtext/forward_taps.py; `=olmo_core` names them as
OLMo-core's modules), `--sketch-width 64` records distance sketches: with both, `replay bisect` against an
OLMo-core run names the first op above the noise floor (tools/olmo3_pair.py).

Without MaxText's code (a bundle, or MaxText not installed) a run whose checkpoints are MaxText's own
is refused in one line (the exported program takes MaxText's NNX state; its checkpoints hold the Linen
layout that MaxText's code converts). With dataset_type=grain, MaxText's saved Grain iterator state
(s/iter) sets the replay's loader there (replay/maxtext/checkpoints.py); olmo_grain saves none (its
sampler restarts at the checkpoint's step). MaxText's checkpoints on object storage (base_output_directory
gs://...) are listed through traces.storage and restored by MaxText's code from the bucket. Not yet: DiLoCo
(whose step takes a per-step key as a third argument): refused in one line.

Cost at a million steps: what recording costs any loop (one record a step, streamed to disk).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import replay
from replay.engine.code import EntrypointNotFound
from replay.errors import InputError, ReplayUnavailable, message, user_error_code
from replay.maxtext.checkpoints import KEY, LISTED_KEY, MaxTextCheckpoints, listing, recorded
from replay.record.loop import entrypoint

LOSS = "scalar/learning/loss"  # MaxText's metrics: {"scalar": {"learning/loss": ..., ...}}
DEFAULT_EVERY = 10  # checkpoint period when MaxText's own checkpointing is off
ARGV_KEY = "replay_maxtext_argv"  # the run's config: MaxText's argv, what make() rebuilds the loop from
PROCESSES_KEY = "replay_maxtext_processes"  # the processes it trained on: a rebuild needs as many
TAPS_KEY = "replay_maxtext_taps"  # "grad" (--tap-grads), "forward" (--tap-forward): make() taps the same
NAMES_KEY = "replay_maxtext_forward_names"  # the forward taps' names: "maxtext" or "olmo_core"
_live: list = []  # while recording: (state, batch, jitted step) of the first step, for make()'s check


class MaxTextError(InputError):
    """MaxText is missing, or configured in a way this launcher cannot record."""


@entrypoint
def make(config: dict) -> Any:
    """The run's entry point: MaxText's own loop rebuilt from the MaxText argv the run recorded.

    MaxText's `train.main` runs again with that argv up to its first call of the jitted step, which is
    captured instead of run (replay/maxtext/rebuild.py): the same model, optimizer, mesh, sharding rules
    and data pipeline MaxText builds, so the replay's program is the one MaxText trained with."""
    # Either refusal lets a replay fall back to the run's exported program (replay/record/exported.py).
    # A run whose checkpoints are MaxText's own is refused rather than declined: only MaxText's code restores
    # them, and the exported program would find no checkpoint to start from (replay/maxtext/checkpoints.py).
    held = recorded(config)
    argv = config.get(ARGV_KEY) if isinstance(config, dict) else None
    if not (isinstance(argv, list) and all(isinstance(a, str) for a in argv)):
        raise EntrypointNotFound("this MaxText run recorded no MaxText argv (recorded before replay.maxtext kept "
                                 "one), so MaxText's loop cannot be rebuilt from it")
    try:
        import maxtext  # noqa: F401
    except ImportError as exc:
        raise _declined(f"MaxText is not installed here ({exc}), so its loop cannot be rebuilt; "
                        "tools/maxtext-env.sh builds an environment with it", held) from exc
    missing = [a for a in argv if a.endswith((".yml", ".yaml")) and "=" not in a and not Path(a).is_file()]
    if missing:  # the run was recorded on another machine or checkout: MaxText's main would fail on it
        raise _declined(f"the MaxText config file the run was recorded with, {missing[0]}, is not here, "
                        "so MaxText's loop cannot be rebuilt", held)
    import jax

    processes = config.get(PROCESSES_KEY, 1)
    if processes != jax.process_count():  # MaxText's mesh and data sharding are built for that many
        raise ReplayUnavailable(f"this MaxText run trained on {processes} processes and MaxText's loop is rebuilt "
                                f"on as many: start the replay on {processes} (replay run RUN --steps A:B --coordinator "
                                f"HOST:PORT --num-processes {processes} --process-id I, one per process); here "
                                f"{jax.process_count()}")
    if "grad" in (config.get(TAPS_KEY) or []):
        tap_gradients()  # the program the run recorded has the taps; the replay's must too
    if "forward" in (config.get(TAPS_KEY) or []):
        from replay.maxtext.forward_taps import tap_forward

        tap_forward(config.get(NAMES_KEY) or "maxtext")
    if _live:  # the check replay.init makes while recording: MaxText's own objects, not a second main()
        state, batch, jitted = _live
        return replay.Loop(step=jitted, batch_at=lambda k: batch, init=lambda: state)
    from replay.maxtext.rebuild import rebuild

    built = rebuild(argv)
    built.enter_mesh()
    steps = config.get("steps") if isinstance(config.get("steps"), int) else None
    return replay.Loop(step=built.jitted, batch_at=built.batch_at, init=built.init, abstract_state=built.abstract_state(),
                       checkpoints=MaxTextCheckpoints(argv, held, built, steps) if held else None)


def _declined(why: str, held: dict | None) -> Exception:
    """make() cannot rebuild MaxText's loop here: the exported program stands in (EntrypointNotFound),
    unless the run's checkpoints are MaxText's own, which only MaxText's code restores (one line, exit 2)."""
    if held is None:
        return EntrypointNotFound(why)
    return ReplayUnavailable(f"this run's checkpoints are MaxText's own ({held['directory']}), which only MaxText's "
                             f"code restores, and {why}: replay it where MaxText runs (a run recorded with "
                             "enable_checkpointing=false keeps replay's own checkpoints and replays without MaxText)")


def _config_dict(config: Any) -> dict:
    """MaxText's HyperParameters as JSON-safe {key: value} (what run.json keeps as the config)."""
    raw = getattr(config, "get_keys", None)
    items = raw() if callable(raw) else dict(vars(config))
    out = {}
    for key, value in sorted(items.items()):
        if isinstance(value, (str, int, float, bool)) or value is None:
            out[key] = value
        elif isinstance(value, (list, tuple)) and all(isinstance(v, (str, int, float, bool)) for v in value):
            out[key] = list(value)
        else:
            out[key] = repr(value)
    return out


class RecordedMaxTextStep:
    """MaxText's jitted step `(state, batch) -> (state, metrics)`, recorded into `run_dir`."""

    def __init__(self, jitted: Any, run_dir: Path, config: Any, argv: list[str], stop_at: int | None = None,
                 stop: Any = None, taps: list[str] | tuple = (), forward_names: str = "maxtext", sketch_width: int = 0):
        self.jitted, self.run_dir, self.config, self.argv = jitted, run_dir, config, list(argv)
        self.stop_at, self.stop, self.taps = stop_at, stop, list(taps)
        self.forward_names, self.sketch_width = forward_names, sketch_width
        # MaxText's checkpointing on: its checkpoints are the run's (replay/maxtext/checkpoints.py), no copy
        self.maxtext_saves = bool(getattr(config, "enable_checkpointing", False)) and int(
            getattr(config, "checkpoint_period", 0) or 0) > 0
        self.every = 0 if self.maxtext_saves else DEFAULT_EVERY
        self.run: Any = None
        self.step: Any = None

    def __call__(self, state: Any, batch: Any, *rng: Any) -> Any:
        if rng:
            raise MaxTextError("this MaxText step takes a per-step key (DiLoCo): not recorded yet; "
                               "run without enable_diloco")
        if self.run is None:
            self._open(maxtext_step(state))
        k = self.run.next_step
        if self.stop_at is not None and k >= self.stop_at:
            self.stop()  # before step k runs: MaxText has saved its checkpoints of the steps before it
        if self.every and k % self.every == 0:
            self.run.save(k, state)
        if self.maxtext_saves and k and (k - 1) % int(self.config.checkpoint_period) == 0:
            self._list_checkpoints()  # MaxText saved its checkpoint k - 1 after step k - 1 (async: maybe not yet)
        _live[:] = [state, batch, self.jitted]
        try:
            return self.step(state, batch)
        finally:
            _live.clear()

    def _open(self, start: int) -> None:
        """The run opened at MaxText's first step: a new one, or, when MaxText resumed from its own
        checkpoint (`start` > 0) and the folder holds the run, that run resumed where its trace ends."""
        import jax

        # Each process holds only its rows of a batch: stored examples (a replay without code) are
        # one process's only; with several, the trace (bisect, audit, show) is what is recorded.
        single = jax.process_count() == 1
        held = (self.run_dir / "run.json").exists()
        # replay.init would refuse the folder naming its own API, not MaxText's; only process 0 checks:
        # the others may already see the run.json process 0 is creating for this same run
        if held and not start and jax.process_index() == 0:
            raise MaxTextError(f"{self.run_dir} holds a run, and MaxText starts at step 0 (no checkpoint of its own "
                               "under base_output_directory/run_name/checkpoints): resume with the output folder "
                               "and run_name it trained with, or record into a new folder")
        if start and held:
            self.run = replay.init(self.run_dir, resume=True, store_examples=single)
            if self.run.next_step != start:  # a trace with a gap or an overlap would misname every later step
                raise MaxTextError(f"MaxText resumed at step {start} from its checkpoint, but the run {self.run_dir} "
                                   f"was recorded up to step {self.run.next_step - 1}; resume from the checkpoint "
                                   "the run ends at, or record into a new folder")
            self._record_checkpoints()  # MaxText may resume from (and save into) another output folder
        elif start:
            raise MaxTextError(f"MaxText resumed at step {start} from its own checkpoint, and {self.run_dir} holds no "
                               "run to continue: give the folder the run was recorded in")
        else:
            config = dict(_config_dict(self.config), **{ARGV_KEY: self.argv, PROCESSES_KEY: jax.process_count(),
                                                        TAPS_KEY: self.taps, NAMES_KEY: self.forward_names})
            if self.maxtext_saves:
                config[KEY] = self._checkpoints_entry()
            listed = {LISTED_KEY: listing(config[KEY], self._last())} if self.maxtext_saves else {}
            self.run = replay.init(self.run_dir, config=config, store_examples=single,
                                   entrypoint="replay.maxtext:make", dataset_size=_dataset_size(self.config),
                                   manifest={"loop": "maxtext", "maxtext_version": _maxtext_version(), **listed})
        self.step = self.run.step(self.jitted, batch_axis=0, loss=LOSS, sketch_width=self.sketch_width)

    def _checkpoints_entry(self) -> dict:
        """Where MaxText saves its checkpoints (absolute: a replay may run from another folder)."""
        where = str(self.config.checkpoint_dir)
        return {"directory": where if "://" in where else str(Path(where).absolute()),
                "period": int(self.config.checkpoint_period)}

    def _record_checkpoints(self) -> None:
        config = self.run.manifest.get("config") or {}
        if self.maxtext_saves and KEY in config and config[KEY] != self._checkpoints_entry():
            self.run.annotate(config=dict(config, **{KEY: self._checkpoints_entry()}))
        self._list_checkpoints()

    def _last(self) -> int | None:
        steps = getattr(self.config, "steps", None)
        return steps if isinstance(steps, int) else None

    def _list_checkpoints(self) -> None:
        """The manifest's list of the steps MaxText's checkpoints give (LISTED_KEY, what `replay show` lists),
        refreshed when MaxText has saved one: a directory listing, run.json rewritten only when it changed."""
        import jax

        if not self.maxtext_saves or self.run is None or jax.process_index():  # process 0 writes run.json
            return
        now = listing(self._checkpoints_entry(), self._last())
        if self.run.manifest.get(LISTED_KEY) != now:
            self.run.annotate(**{LISTED_KEY: now})

    def __getattr__(self, name: str) -> Any:
        # MaxText also lowers its step ahead of time (memory stats, `compiled_trainstep_file`):
        # that is MaxText's own program, not the recorded one, so anything else goes to it.
        return getattr(self.jitted, name)

    def finish(self) -> None:
        if self.run is not None:
            self._list_checkpoints()  # an asynchronous save finished after the last step that listed it
            self.run.finish()


def maxtext_step(state: Any) -> int:
    """MaxText's own step counter in the state its step is given (the optimizer's count: MaxText starts
    its loop there, `train.get_first_step`); 0 where the state has none."""
    import jax
    import numpy as np

    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        if jax.tree_util.keystr(path).startswith("['optimizer']['step']"):
            shards = getattr(leaf, "addressable_shards", None)  # replicated: every process holds the value
            return int(np.asarray(shards[0].data if shards else leaf))
    return 0


def _dataset_size(config: Any) -> int | None:
    """The instances of an olmo_grain run's data (its index's `total_instances`), so `replay audit` counts
    epochs by the data, not by what the trace shows; None for other pipelines."""
    if getattr(config, "dataset_type", "") != "olmo_grain":
        return None
    try:
        from maxtext.input_pipeline.olmo_data import load_index

        return int(load_index(config.olmo_index_path).total_instances)
    except (OSError, ValueError, KeyError):  # MaxText's own loader says what is wrong with the index
        return None


def tap_gradients() -> None:
    """The patch point for gradient taps: MaxText's NNX `train_step` hands its gradients (clipped, as the
    optimizer gets them) to `TrainStateNNX.apply_gradients`; from now on in this process they are tapped
    there as `grad` (`replay.tap`: a no-op outside a recorded step's trace). Linen MaxText (pure_nnx off)
    calls another `apply_gradients`: not tapped."""
    from maxtext.common.train_state_nnx import TrainStateNNX

    original = TrainStateNNX.apply_gradients
    if getattr(original, "replay_tap", False):
        return

    def apply_gradients(self, grads: Any, **kwargs: Any) -> Any:
        return original(self, replay.tap(grads, "grad"), **kwargs)

    apply_gradients.replay_tap = True  # type: ignore[attr-defined]
    TrainStateNNX.apply_gradients = apply_gradients


def absl_flags_parsed() -> None:
    """absl's flags marked parsed (their defaults), as MaxText's `app.run(main)` leaves them: `main` called
    directly leaves them unparsed, and Grain's loader (dataset_type=grain or olmo_grain) reads one in its
    first `next`, which fails; MaxText's loop then stops quietly before its first step."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def _maxtext_version() -> str:
    try:
        from importlib.metadata import version

        return version("maxtext")
    except Exception:  # noqa: BLE001 - a version is informational
        return "unknown"


def record(run_dir: str | Path, argv: list[str], stop_at: int | None = None, taps: list[str] | None = None,
           forward_names: str = "maxtext", sketch_width: int = 0) -> Path:
    """Runs MaxText's training `main(argv)` (argv without the program name) recording into `run_dir`.

    stop_at: MaxText's loop stopped before step `stop_at`, as a preemption stops it (its own checkpoints
    of the earlier steps written, the run recorded up to step stop_at - 1); MaxText started again with
    the same argv then resumes from its checkpoint, and the recording continues this run. Its config
    (`steps` included: its learning-rate schedule is part of the step's program) stays the same.
    taps: "grad" taps the gradients MaxText's step applies (`tap_gradients`), fingerprinted per
    parameter each step; "forward" every module output inside the model (replay/maxtext/forward_taps.py:
    MaxText's decoder unscanned, `record_internal_nn_metrics=true` added to argv), named by
    `forward_names` ("olmo_core": OLMo-core's module paths, for an OLMo 3 pair).
    sketch_width: also each tensor's distance sketch (64: replay.torch's), for a cross-framework bisect."""
    try:
        from maxtext.trainers.pre_train import train
        from maxtext.utils import train_utils
    except ImportError as exc:
        raise MaxTextError(f"MaxText is not installed here ({exc}); build its environment with "
                           "tools/maxtext-env.sh (Python 3.12, maxtext[tpu]==0.2.5)") from exc
    run_dir = Path(run_dir)
    taps = list(taps or [])
    if "forward" in taps:
        from replay.maxtext.forward_taps import ARGV, tap_forward

        tap_forward(forward_names)
        argv = [*argv, *(a for a in ARGV if a not in argv)]  # recorded with the run: make() rebuilds the same
    original = train_utils.jit_train_step
    recorded: list[RecordedMaxTextStep] = []

    class Stopped(Exception):
        """Raised from the wrapped step at `stop_at`, caught below: a signal that never leaves this function."""

    def stop() -> None:
        raise Stopped

    def jit_train_step(config, *args, **kwargs):
        if "forward" in taps and getattr(config, "scan_layers", False):  # one sown value per stacked module
            raise MaxTextError("--tap-forward taps each decoder layer's modules: run MaxText with scan_layers=false")
        wrapped = RecordedMaxTextStep(original(config, *args, **kwargs), run_dir, config, argv, stop_at, stop,
                                      taps, forward_names, sketch_width)
        recorded.append(wrapped)
        return wrapped

    train_utils.jit_train_step = jit_train_step
    absl_flags_parsed()
    if "grad" in taps:
        tap_gradients()
    try:
        train.main(["train", *argv])
    except Stopped:
        pass
    finally:
        train_utils.jit_train_step = original
    if not recorded or recorded[0].run is None:
        raise MaxTextError("MaxText trained no step through its jitted train step; nothing was recorded")
    recorded[0].finish()
    return run_dir


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    stop_at, taps, names, width = None, [], "maxtext", 0
    while len(argv) > 1 and argv[1].split("=")[0] in ("--stop-at", "--tap-grads", "--tap-forward", "--sketch-width"):
        flag = argv[1]
        if flag in ("--tap-grads", "--tap-forward") or flag.startswith("--tap-forward="):
            taps.append("grad" if flag == "--tap-grads" else "forward")
            names = flag.split("=", 1)[1] if "=" in flag else names
            if names not in ("maxtext", "olmo_core"):
                print(f"error: {flag}: name the tensors maxtext (MaxText's module paths) or olmo_core", file=sys.stderr)
                return 2
            argv = [argv[0], *argv[2:]]
            continue
        if len(argv) < 3 or not argv[2].isdigit():
            print(f"error: {flag} {' '.join(argv[2:3])}: give an integer >= 0", file=sys.stderr)
            return 2
        if flag == "--stop-at":
            stop_at = int(argv[2])
        else:
            width = int(argv[2])
        argv = [argv[0], *argv[3:]]
    if len(argv) < 2 or argv[0].startswith("-"):
        print("usage: python -m replay.maxtext RUN [--stop-at STEP] [--tap-grads] [--tap-forward[=olmo_core]] "
              "[--sketch-width 64] <MaxText config.yml> [key=value ...]", file=sys.stderr)
        return 2
    try:
        record(argv[0], argv[1:], stop_at, taps, names, width)
    except Exception as exc:
        code = user_error_code(exc)  # replay's user errors (replay/errors.py); anything else is a bug
        if code is None:
            raise
        print(f"error: {message(exc)}", file=sys.stderr)
        return code
    print(f"recorded {argv[0]}; verify it with: replay run {argv[0]} --steps A:B", file=sys.stderr)
    return 0

