"""MaxText's own checkpoints as a recorded run's checkpoints (`replay.Loop(checkpoints=...)`).

With MaxText's checkpointing on (enable_checkpointing=true, checkpoint_period=P) the launcher saves
no copy of the state into the run: MaxText's checkpoint manager saves it, and the run's config
records where (`replay_maxtext_checkpoints`: MaxText's checkpoint folder and period). MaxText's
checkpoint s holds the state AFTER step s (its optimizer count s + 1, where its loop restarts), so it
is replay's state entering step k = s + 1; it is restored by MaxText's own code onto MaxText's abstract
state (rebuild.maxtext_checkpoint: its Linen layout converted to the NNX state its step takes), then
verified by replay against the trace's fingerprints of the state entering step k
(replay/record/loop_checkpoints.py): a flipped bit in one of MaxText's array chunks, which orbax
restores without complaint, is refused in one line naming the checkpoint's folder. On several processes
each restores its shards of the same checkpoint and checks the whole state (the fingerprints are a
collective every process computes), so all refuse alike. The launcher also lists the steps MaxText's
folder gives in run.json (`loop_checkpoints`, refreshed after each period's save and at the end), which
`replay show` reads without running any of the run's code.

The state entering step 0 is in no MaxText checkpoint (its s = 0 is the state after step 0). It is
rebuilt, not saved: MaxText's `main` builds it from the run's argv (its seed) whenever the loop is
rebuilt for a replay (make() needs that rebuild for the program anyway), and it is verified against the
trace like any other restored state. A saved copy would cost one whole state (parameters and optimizer
moments: a checkpoint's size) per run, which is what letting MaxText own the checkpoints avoids.

With `dataset_type=grain` MaxText also saves its Grain iterator's state (`s/iter`, one JSON file per
process): the replay's loader is set to it (rebuild.Rebuilt.seek), so step k's batch costs one `next`,
not k + 1 from the pipeline's start. Whether it is right is checked where the run stored its rows (one
process): the loader's batch at the first step after the restore is compared with the stored one, a
difference said in a note, the stored rows fed.

Without MaxText's code (a bundle, or MaxText not installed) nothing here can run: the exported
program takes the NNX state MaxText's step takes, and turning MaxText's Linen-layout checkpoint into it
is MaxText's own conversion. make() then refuses in one line rather than falling back to the exported
program (which would find no checkpoint to start from). A run recorded with MaxText's checkpointing off
keeps replay's own checkpoints (every 10 steps) and replays without MaxText.

Cost of a restore from MaxText's checkpoint: one MaxText setup up to its first step (model init, data
pipeline, MaxText's ahead-of-time compile), as a rebuild; of step 0: none beyond the rebuild.
"""

from __future__ import annotations

from typing import Any

from traces.storage import as_path

KEY = "replay_maxtext_checkpoints"  # the run's config: {"directory": MaxText's checkpoint folder, "period": P}
# The run's manifest: the steps the loop's own checkpoints give and their folder, what `replay show` lists
# (it runs no code of the run's; replay/cli/show.py reads this key)
LISTED_KEY = "loop_checkpoints"


def on_disk(directory: str, last: int | None) -> list[int]:
    """The steps k (replay's numbering) MaxText's checkpoint folder gives: 0 (rebuilt from the argv) and
    s + 1 for each checkpoint s MaxText finished saving (its folder holds `items`). Its checkpoint of the
    last step (k = `last`, the run's steps) has no step after it to replay, and MaxText refuses to restore
    it anyway. A folder on object storage (gs://, s3://) is listed through traces.storage (the bucket's
    client and its usual credentials): one listing, and one per checkpoint."""
    folder = as_path(directory)  # a Path would turn gs:// into gs:/
    labels = [int(p.name) for p in folder.iterdir() if p.name.isdigit() and (p / "items").is_dir()] \
        if folder.is_dir() else []
    return [0] + sorted(s + 1 for s in labels if last is None or s + 1 < last)


def listing(held: dict, last: int | None) -> dict:
    """The manifest's LISTED_KEY entry: MaxText's checkpoint folder and the steps it gives now."""
    return {"directory": held["directory"], "steps": on_disk(held["directory"], last),
            "by": "MaxText's checkpoint manager (its checkpoint s is the state entering step s + 1)"}


def recorded(config: Any) -> dict | None:
    """What the run's config says of MaxText's checkpoints (None: replay saved its own)."""
    held = config.get(KEY) if isinstance(config, dict) else None
    return held if isinstance(held, dict) and isinstance(held.get("directory"), str) else None


class MaxTextCheckpoints:
    """MaxText's checkpoint folder, read as replay's: steps() and restore(k) in replay's numbering."""

    def __init__(self, argv: list[str], held: dict, built: Any, steps: int | None):
        self.argv, self.built, self.last = list(argv), built, steps
        self.directory = held["directory"].rstrip("/")  # a local folder or a gs:// URL, as MaxText was given it

    def steps(self) -> list[int]:
        return on_disk(self.directory, self.last)

    def restore(self, k: int) -> Any:
        if k == 0:
            return self.built.init()
        from replay.maxtext.rebuild import maxtext_checkpoint

        state = maxtext_checkpoint(self.argv, self.directory, k - 1)
        self.built.enter_mesh()  # MaxText's main set its own mesh and rules for the restore: the replay's again
        saved = as_path(self.directory) / str(k - 1) / "iter"
        if saved.is_dir():  # dataset_type=grain: MaxText saved its iterator too
            self.built.seek(k, saved)
        return state

    def describe(self, k: int) -> str:
        if k == 0:
            return "MaxText's initial state, rebuilt from the run's argv"
        return f"{self.directory}/{k - 1}: MaxText's checkpoint {k - 1}"
