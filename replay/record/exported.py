"""Replaying an API run from its exported program and example store: no user code runs.

`from_run` (replay/record/replayable.py) picks the program a replay uses:

- a bundle: the exported program, always (nothing shipped in or named by a bundle runs);
- a run folder: the user's code when its entry point can be imported under the code policy
  (replay/engine/code.py); the exported program when it cannot (not installed, or in a folder that
  needs --allow-code) and the run recorded one;
- the report says which, in its notes: "replayed from the exported program ..." or
  "replayed with your code ...".

The state is a flat list of leaves in the recorded order (replay/record/export.py says why),
carried as `FlatState`, a pytree whose leaf paths are the recorded ones, so the full-state
fingerprint recorded at every save checks the restored state exactly as it checks the user's.
The batch of step k is rebuilt from the trace's per-example hashes (replay/record/examples_store.py).
Typed PRNG keys travel as their raw words (export.py): a key orbax restores as a typed key has
its impl checked against the recorded one and its words fed. A program exported for N devices
runs on N: the mesh recorded in the manifest entry (axis names, shape, axis types, device ids)
is rebuilt over this process's devices, every input (restored state, rebuilt batch) is put on
its recorded sharding there, and another device count is refused before anything compiles, in
one line naming both counts (exit 2). Cost per replayed step: reading its trace record and its
examples' frames, one call of the program; independent of the run's length.
The program hash reported is the recorded one: the exported bytes are those recorded with it
(their sha256 is in the checksummed manifest), and the replay compares bits, not claims.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np

from replay.errors import ReplayUnavailable
from replay.record import checkpoints as ckpts
from replay.record import examples_store
from replay.record import export as exportlib
from replay.record.exported_entry import entry_damage
from traces.errors import TraceError
from replay.engine.code import CodeNotAllowed, is_bundle_run
from replay.engine.damage import shown_path
from replay.record.manifest import FACTORY
from replay.record.orbax_io import _WHAT_TO_DO, CheckpointDamagedError

EXPORTED_NOTE = "replayed from the exported program ({file}), without your code"
CODE_NOTE = "replayed with your code ({spec})"


class ExportedProgramError(TraceError):
    """The run's exported program is missing, damaged or does not fit this machine (bad input, exit 2: a
    TraceError, as any damaged file of a run is)."""


def _tree():
    import jax

    @jax.tree_util.register_pytree_with_keys_class
    class FlatState:
        """The recorded state's leaves in recorded order, under their recorded tree paths."""

        def __init__(self, paths: tuple[str, ...], leaves: list):
            self.paths, self.leaves = tuple(paths), list(leaves)

        def tree_flatten_with_keys(self):
            return [(jax.tree_util.GetAttrKey(p), x) for p, x in zip(self.paths, self.leaves)], self.paths

        def tree_flatten(self):
            return self.leaves, self.paths

        @classmethod
        def tree_unflatten(cls, paths, leaves):
            return cls(paths, list(leaves))

    return FlatState


_FLAT: Any = None


def flat_state(paths, leaves) -> Any:
    global _FLAT
    if _FLAT is None:
        _FLAT = _tree()
    return _FLAT(paths, leaves)


def usable(manifest: dict, where: str = "run.json") -> str | None:
    """None when the run recorded an exported program and its examples; else why not. A damaged
    "exported" or "example_store" entry is refused here (ExportedProgramError naming `where`, the
    manifest as messages show it): its checksum only says run.json is what some writer wrote."""
    if exportlib.KEY not in manifest:
        return "it recorded no exported program"
    damage = entry_damage(manifest)
    if damage:
        raise ExportedProgramError(f"{where}: its \"{damage[0]}\" entry is damaged ({damage[1]}): run.json was "
                                   "changed after recording; restore it from a copy of the run, or record it again")
    entry = manifest[exportlib.KEY]
    if entry.get("error"):
        return f"its step was not exported: {entry['error']}"
    store = manifest.get(examples_store.KEY)
    if not isinstance(store, dict) or not store.get("leaves"):
        processes = (manifest.get("environment") or {}).get("process_count", 1)
        if isinstance(processes, int) and processes > 1:  # store_examples is refused on several processes
            return (f"it was recorded on {processes} processes, which keep no example store, so its batches need "
                    "your batch_at")
        return "it recorded no example store (replay.init(..., store_examples=True) keeps one), so its batches need your batch_at"
    return None


def manifest_shown(run) -> str:
    """run.json as messages name it: BUNDLE:run.json for a bundle."""
    bundle = getattr(run, "bundle", None)
    return f"{bundle}:run.json" if bundle else str(Path(run.path) / "run.json")


class ExportedReplay:
    def __init__(self, run, data: str | None = None, allow_data_change: bool = False, on_compile=None,
                 allow_code: bool = False):
        import jax
        from jax import export as jexport

        if data is not None:
            raise ReplayUnavailable(f"{shown_path(run)}: this run's batches come from its example store; --data does not apply")
        manifest = run.manifest
        why = usable(manifest, manifest_shown(run))
        if why:
            raise ReplayUnavailable(f"{shown_path(run)}: cannot be replayed without its code: {why}")
        self.run, self.entry = run, manifest[exportlib.KEY]
        self.shown = shown_path(run)
        path = Path(run.path) / self.entry["file"]
        shown_file = f"{self.shown}:{self.entry['file']}" if getattr(run, "bundle", None) else str(path)
        if not path.is_file():
            raise ExportedProgramError(f"{shown_file}: the run's exported program is missing; restore it from a copy, "
                                       "or replay with your code (--allow-code, or the entry point installed)")
        data_bytes = path.read_bytes()
        if hashlib.sha256(data_bytes).hexdigest() != self.entry["sha256"]:
            raise ExportedProgramError(f"{shown_file}: the exported program is damaged (its sha256 differs from the "
                                       "one recorded in run.json); restore it from a copy, or replay with your code")
        self.mesh = device_mesh(self.entry, shown_file)  # before any compile: a wrong device count is one line
        if on_compile is not None:
            on_compile()
        try:
            self.exported = jexport.deserialize(bytearray(data_bytes))
        except Exception as e:  # noqa: BLE001 - a file whose sha256 holds but jax cannot read: another jax
            raise ExportedProgramError(f"{shown_file}: jax {jax.__version__} cannot read the exported program "
                                       f"(written by jax {self.entry.get('jax')}): {type(e).__name__}") from None
        self._call = jax.jit(self.exported.call)
        # Where each flat input goes: its recorded sharding on the rebuilt mesh (an input left to
        # the compiler: replicated on it), or the first device for a one-device program.
        if self.mesh is None:
            self.in_shardings = [jax.sharding.SingleDeviceSharding(jax.devices()[0])] * len(self.exported.in_avals)
        else:
            replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
            try:
                self.in_shardings = [s or replicated for s in self.exported.in_shardings_jax(self.mesh)]
            except ValueError as e:  # a mesh that does not match the exported one: the manifest and program disagree
                raise ExportedProgramError(f"{shown_file}: the exported program's shardings do not fit the mesh its "
                                           f"manifest entry records ({' '.join(str(e).split())[:200]}); replay with "
                                           "your code") from None
        self.paths = tuple(s["path"] for s in self.entry["state"])
        self.record_keys = list(self.entry["record"])
        self.examples = examples_store.ExampleReader(Path(run.path), manifest[examples_store.KEY],
                                                     shown=(f"{self.shown}:{manifest[examples_store.KEY]['file']}"
                                                            if getattr(run, "bundle", None) else None),
                                                     complete=run.status == "complete")
        self._manager = ckpts.open_manager(ckpts.run_checkpoint_dir(run), read_only=True)
        self.schema = run.schema
        self.replayed_from = "exported"
        self.restore_notes: list[str] = [EXPORTED_NOTE.format(file=self.entry["file"])]

    def environment(self) -> dict:
        from replay.record.environment import environment

        return environment()

    def program_hash(self) -> str | None:
        return self.run.manifest.get("program_hash")

    def checkpoint_steps(self) -> list[int]:
        return ckpts.steps(self._manager)

    def restore(self, step: int) -> Any:
        """Checkpoint `step` restored onto its own metadata tree, put in recorded order, verified."""
        import jax

        from replay.record.fingerprint import state_fingerprint

        where = ckpts.directory_of(self._manager) / str(step)
        # None for a missing or unreadable step: ckpts.restore names what is wrong
        meta = ckpts.state_metadata(self._manager, step) if step in ckpts.steps(self._manager) else None
        specs = {s["path"]: s for s in self.entry["state"]}
        where_to = dict(zip(self.paths, self.in_shardings))
        target = None if meta is None else jax.tree_util.tree_map_with_path(
            lambda p, m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=where_to.get(exportlib._path(p),
                                                                                           self.in_shardings[0])), meta)
        state = ckpts.restore(self._manager, step, target, None)
        by_path = {exportlib._path(p): x for p, x in jax.tree_util.tree_flatten_with_path(state)[0]}
        for p, x in list(by_path.items()):
            if exportlib._is_key(x):  # orbax gives a typed key back for one it stored (export.py's docstring)
                by_path[p] = key_words(x, specs.get(p), f"{where}: checkpoint {step} leaf {p}")
        if set(by_path) != set(specs):
            extra = sorted(set(by_path) ^ set(specs))[:3]
            raise CheckpointDamagedError(f"{where}: checkpoint {step} holds other state leaves than the exported "
                                         f"program takes ({', '.join(extra)}); {_WHAT_TO_DO}")
        for p, s in specs.items():
            x = by_path[p]
            if list(x.shape) != s["shape"] or np.dtype(x.dtype).name != s["dtype"]:
                raise CheckpointDamagedError(f"{where}: checkpoint {step} leaf {p} is {np.dtype(x.dtype).name}"
                                             f"{list(x.shape)}, the exported program takes {s['dtype']}{s['shape']}")
        flat = flat_state(self.paths, [jax.device_put(by_path[p], sh) for p, sh in zip(self.paths, self.in_shardings)])
        # (device_put: a key's words, or a leaf orbax placed otherwise, go where the program takes them)
        expected = (self.run.manifest.get(ckpts.FINGERPRINTS_KEY) or {}).get(str(step))
        if expected is None:
            self.restore_notes.append(f"checkpoint {step} has no recorded fingerprint, so it was restored unverified")
        elif state_fingerprint(flat) != expected:
            raise CheckpointDamagedError(f"{where}: checkpoint {step} is damaged (its state's fingerprint "
                                         f"{state_fingerprint(flat)} differs from {expected} recorded when it was "
                                         f"saved); {_WHAT_TO_DO}")
        return flat

    def step(self, state: Any, step: int) -> tuple[Any, dict, np.ndarray]:
        import jax

        hashes = np.asarray(self.run.trace.read(step).example_hashes, np.uint64)
        batch = self.examples.batch(step, hashes)
        n = len(self.paths)
        out = self._call(*state.leaves, *(jax.device_put(x, sh) for x, sh in zip(batch, self.in_shardings[n:])))
        if len(out) != n + len(self.record_keys):
            raise ExportedProgramError(f"{self.shown}: the exported program returns {len(out)} values, its signature "
                                       f"says {n + len(self.record_keys)}")
        return flat_state(self.paths, list(out[:n])), dict(zip(self.record_keys, out[n:])), hashes


def device_mesh(entry: dict, shown_file: str) -> Any:
    """The mesh the exported program runs on (None: one device), rebuilt from the manifest entry.
    A program partitioned for N devices runs on N, so another device count is refused here."""
    import jax

    devices, have = int(entry.get("devices", 1)), jax.device_count()
    if devices == 1:
        return None
    if devices != have:
        raise ExportedProgramError(
            f"{shown_file}: the step was exported for {devices} devices and this process has {have}; replay it on "
            f"{devices} devices (on CPU: XLA_FLAGS=--xla_force_host_platform_device_count={devices}), or replay with "
            "your code (--allow-code), whose results on another device count are measured, not promised bit-exact")
    mesh = entry.get("mesh") or {"axes": ["devices"], "shape": [devices], "axis_types": ["Auto"], "device_ids": []}
    by_id = {d.id: d for d in jax.devices()}
    ids = mesh.get("device_ids") or []
    chosen = [by_id[i] for i in ids] if len(ids) == devices and all(i in by_id for i in ids) else jax.devices()
    types = tuple(getattr(jax.sharding.AxisType, t) for t in mesh.get("axis_types") or ["Auto"] * len(mesh["axes"]))
    grid = np.array(chosen, dtype=object).reshape(mesh["shape"])
    return jax.sharding.Mesh(grid, tuple(mesh["axes"]), axis_types=types)


def key_words(x: Any, spec: dict | None, where: str) -> Any:
    """The raw uint32 words of a restored typed key, after checking its impl is the recorded one."""
    import jax

    impl = str(jax.random.key_impl(x))
    if spec is None or spec.get("key") != impl:
        want = "not a key" if spec is None or "key" not in spec else f"a {spec['key']} key"
        raise ExportedProgramError(f"{where} is a {impl} PRNG key; the exported program takes {want} there: the "
                                   "checkpoint is not the one this program was recorded with")
    return jax.random.key_data(x)


def choose(run, with_code, **options: Any) -> Any:
    """The replayable for an API run: `with_code(run, **options)` (LoopReplay) or ExportedReplay."""
    why = usable(run.manifest, manifest_shown(run))
    if is_bundle_run(run) and why is None:
        return ExportedReplay(run, **options)
    try:
        rep = with_code(run, **options)
    except CodeNotAllowed as e:
        if why is not None:  # say both: why the code is not used, and why the exported program cannot stand in
            raise type(e)(f"{str(e).rstrip('.')}; without that code it cannot be replayed: {why}") from None
        rep = ExportedReplay(run, **options)
        # Whole: cut to a width, it lost its instruction mid-word ("pass --allow-cod"). The run's own
        # name, which starts the error, is dropped: the note is the run's already.
        why = " ".join(str(e).split())
        why = why.removeprefix(f"{rep.shown}: ").removeprefix(f"{run.path}: ")
        rep.restore_notes[0] += f" (the entry point was not imported: {why})"
        return rep
    rep.replayed_from = "code"
    rep.restore_notes.insert(0, CODE_NOTE.format(spec=run.manifest.get("entrypoint")))
    return rep


# ---------------------------------------------------------------------------- bundles (replay pack)


def pack_refusal(manifest: dict) -> str | None:
    """Why a full bundle of this loop's run cannot be packed (None: it can)."""
    if manifest.get("replayable") != FACTORY:
        return (f"it was recorded by its own training loop ({manifest.get('replayable')}), whose batches replay "
                "cannot carry")
    damage = entry_damage(manifest) if exportlib.KEY in manifest else None
    if damage:  # pack's message names the run
        return f"run.json's \"{damage[0]}\" entry is damaged ({damage[1]})"
    return usable(manifest)


def stage_for_bundle(run, stage: Path, first: int, last: int, staged) -> tuple[dict, list[Path], dict]:
    """Writes into `stage` what a bundle of steps first..last replays from: the exported program
    (copied, its sha256 checked) and the rows of every example those steps feed (from the run's
    store, each rebuilt batch checked against the trace's hashes). Returns (info for the bundle
    manifest, the files, manifest entries to override)."""
    from replay.bundle.format import PackError

    manifest = run.manifest
    entry, store = manifest[exportlib.KEY], manifest[examples_store.KEY]
    program = Path(run.path) / entry["file"]
    data = program.read_bytes() if program.is_file() else b""
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise PackError(f"{program}: the exported program is missing or damaged (its sha256 differs from run.json's); "
                        "pack with --lite, or restore it from a copy")
    (stage / entry["file"]).parent.mkdir(parents=True, exist_ok=True)
    (stage / entry["file"]).write_bytes(data)
    reader = examples_store.ExampleReader(Path(run.path), store)
    needed: set[int] = set()
    for rec in staged.records(first, last + 1):
        needed.update(np.asarray(rec.example_hashes, np.uint64).tolist())
    try:
        count = reader.write_subset(stage / store.get("file", examples_store.FILE), needed)
        carried = examples_store.ExampleReader(stage, store)
        for rec in staged.records(first, last + 1):  # as the replay will rebuild them
            carried.batch(rec.step, rec.example_hashes)
    except examples_store.ExampleStoreError as e:
        raise PackError(str(e)) from None
    files = [stage / entry["file"], stage / store.get("file", examples_store.FILE)]
    raw = sum(int(np.prod(s["shape"], dtype=np.int64)) * np.dtype(s["dtype"]).itemsize for s in store["leaves"])
    info = {"examples": count, "detail": f"{count} distinct examples of {raw} bytes, the exported program"}
    return info, files, {"checkpoint_dir": "checkpoints"}
