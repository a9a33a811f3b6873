"""Which code replays a run (replay/engine/code.py): nothing inside a bundle runs, a folder the manifest
names runs only with --allow-code, an installed module runs by name, and two runs whose loops
share a module name each replay with their own code.

Runs are recorded from copies of tests/replay/fixtures/tinyloop.py (legacy manifests:
"replayable": "tinyloop:replayable", "replayable_path": the copy's folder).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from replay.engine import code
from tests.cli_util import assert_error_line, invoke
from tests.replay.tinyruns import copy_loop, load_copy, record
from traces import Run, Schema

EVIL = """
from pathlib import Path
import replay
Path({marker!r}).write_text("imported")
@replay.entrypoint
def replayable(run, **kw):
    Path({marker!r}).write_text("called")
"""


@pytest.fixture(scope="module")
def loops(tmp_path_factory):
    """Two checkouts, a/tinyloop.py and b/tinyloop.py, differing in SCALE; runs of each."""
    root = tmp_path_factory.mktemp("checkouts")
    a, b = load_copy(copy_loop(root / "a", 1.0)), load_copy(copy_loop(root / "b", 2.0))
    runs = root / "runs"
    return {"root": root, "a": record(a, runs / "a"), "a2": record(a, runs / "a2"), "b": record(b, runs / "b")}


def _run_carrying(tmp: Path, marker: Path, bundle: bool, search_path: str | None = ".", code_in: str = ".") -> Path:
    """A run folder that names a module (evil.py, which writes `marker` when imported, in the run's
    folder `code_in`, relative to the run: the run ships it; or outside it: the user's checkout)."""
    path = tmp / "carrier"
    manifest = {"replayable": "evil:replayable"}
    if search_path is not None:
        manifest["replayable_path"] = search_path
    if bundle:
        manifest["bundle"] = {"format_version": 1, "lite": False, "steps": [0, 0], "checkpoint": 0}
    run = Run.create(path, Schema(examples_per_step=1, rng_words=2, metrics=(("loss", "loss"),)), manifest)
    run.finish()
    (path / code_in).mkdir(parents=True, exist_ok=True)
    (path / code_in / "evil.py").write_text(EVIL.format(marker=str(marker)))
    return path


# ------------------------------------------------------------------ nothing in a bundle runs

def test_a_bundle_that_names_a_module_it_carries_is_refused_and_nothing_is_imported(tmp_path):
    marker = tmp_path / "imported.txt"
    path = _run_carrying(tmp_path, marker, bundle=True)
    for flags in ([], ["--allow-code"]):  # not even when code is allowed
        line = assert_error_line(invoke("run", str(path), "--steps", "0", *flags), 2, "bundle", "evil")
        assert "never run" in line
        assert not marker.exists()


def test_a_bundle_module_is_not_found_through_sys_path_either(tmp_path, monkeypatch):
    """Even with the bundle's folder on sys.path (python run from inside it), nothing there runs."""
    marker = tmp_path / "imported.txt"
    path = _run_carrying(tmp_path, marker, bundle=True, search_path=None)
    monkeypatch.syspath_prepend(str(path))
    monkeypatch.chdir(path)
    run = Run.open(path)
    with pytest.raises(code.CodeNotAllowed, match="never run"):
        code.import_entrypoint(run, "evil:replayable", allow_code=True)
    assert not marker.exists() and "evil" not in sys.modules
    run.manifest.pop("bundle")  # not known as a bundle: the run's own folder is still not on the path
    with pytest.raises(code.CodeNotAllowed, match="cannot be imported here"):
        code.import_entrypoint(run, "evil:replayable", allow_code=True)
    assert not marker.exists() and "evil" not in sys.modules


def test_an_unpacked_bundle_is_known_by_its_run_bundle_attribute(tmp_path):
    marker = tmp_path / "imported.txt"
    run = Run.open(_run_carrying(tmp_path, marker, bundle=False))
    run.bundle = tmp_path / "bug.rpk"  # what replay.bundle.open_run sets on a bundle it unpacked
    with pytest.raises(code.CodeNotAllowed, match="bug.rpk"):
        code.import_entrypoint(run, "evil:replayable", allow_code=True, search_path=".")
    assert not marker.exists()


# ------------------------------------------------------------------ a folder runs only when asked

def test_a_folder_the_manifest_names_needs_allow_code(tmp_path):
    marker = tmp_path / "imported.txt"
    path = _run_carrying(tmp_path, marker, bundle=False, search_path="../checkout", code_in="../checkout")
    line = assert_error_line(invoke("run", str(path), "--steps", "0"), 2, "--allow-code", "evil")
    assert not marker.exists(), line
    run = Run.open(path)
    fn = code.import_entrypoint(run, "evil:replayable", allow_code=True, search_path="../checkout")
    assert marker.read_text() == "imported" and callable(fn)


@pytest.mark.parametrize("code_in", [".", "sub/dir"])
def test_code_inside_the_run_folder_never_runs_even_with_allow_code(tmp_path, code_in):
    """A run (a copied folder, a bundle unpacked and stripped of its manifest's "bundle" key) that
    carries its own code: --allow-code allows the user's checkout, not what travels with the run.
    Old code imported it."""
    marker = tmp_path / "imported.txt"
    path = _run_carrying(tmp_path, marker, bundle=False, search_path=code_in, code_in=code_in)
    for flags in ([], ["--allow-code"]):
        assert_error_line(invoke("run", str(path), "--steps", "0", *flags), 2, "inside the run's own folder", "evil")
    assert not marker.exists()
    with pytest.raises(code.CodeNotAllowed, match="never run"):
        code.import_entrypoint(Run.open(path), "evil:replayable", allow_code=True, search_path=str(path / code_in))
    assert not marker.exists()


def test_code_inside_a_folder_a_bundle_was_unpacked_to_never_runs(tmp_path):
    """A run names code in a folder `replay unpack` wrote (its mark there), outside the run's own
    folder: refused. A run inside such a folder is a bundle's, and says it is not: refused too."""
    marker = tmp_path / "imported.txt"
    path = _run_carrying(tmp_path, marker, bundle=False, search_path="../shipped", code_in="../shipped")
    (tmp_path / "shipped" / code.MARKER).write_text("{}")
    for flags in ([], ["--allow-code"]):
        assert_error_line(invoke("run", str(path), "--steps", "0", *flags), 2, "evil", "a bundle was unpacked to")
    assert not marker.exists() and not code.is_bundle_run(Run.open(path))
    (tmp_path / code.MARKER).write_text("{}")  # now the run is inside a bundle's folder too
    assert code.is_bundle_run(Run.open(path))
    for flags in ([], ["--allow-code"]):
        assert_error_line(invoke("run", str(path), "--steps", "0", *flags), 2, "not describe a bundle", "never run")
    assert not marker.exists()


@pytest.mark.parametrize("spec", ["sys:exit", "builtins:print", "os:system", "antigravity:x", "this:x"])
def test_a_standard_library_function_is_never_imported_or_called(tmp_path, spec, monkeypatch):
    """Old code imported the module and called the function with the run (sys:exit exited)."""
    path = tmp_path / "run"
    Run.create(path, Schema(examples_per_step=1, rng_words=2, metrics=(("loss", "loss"),)),
               {"replayable": spec}).finish()
    calls = []  # sys.exit stays itself: the CLI exits through it
    monkeypatch.setattr("os.system", lambda *a: calls.append(a))
    monkeypatch.delitem(sys.modules, "antigravity", raising=False)
    monkeypatch.delitem(sys.modules, "this", raising=False)
    for flags in ([], ["--allow-code"]):
        assert_error_line(invoke("run", str(path), "--steps", "0", *flags), 2, spec, "standard library")
    assert calls == [] and "antigravity" not in sys.modules and "this" not in sys.modules


def test_an_unmarked_function_is_never_called(loops, tmp_path):
    """An installed module's function that is not a loop factory (here: the fixture's `train`)."""
    from traces.run import write_manifest
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(loops["a"], copy)
    write_manifest(copy / "run.json", {**Run.open(loops["a"]).manifest, "replayable": "tinyloop:train"})
    line = assert_error_line(invoke("run", str(copy), "--steps", "0", "--allow-code"), 2, "tinyloop:train",
                             "@replay.entrypoint")
    assert "Traceback" not in line and len(list((copy / "checkpoints").iterdir())) == len(
        list((loops["a"] / "checkpoints").iterdir()))


def test_legacy_user_loop_replays_with_allow_code_only(loops):
    run = str(loops["a"])
    assert_error_line(invoke("run", run, "--steps", "1:6"), 2, "--allow-code", "tinyloop")
    result = invoke("run", run, "--steps", "1:6", "--allow-code", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["bit_exact"] == 6


def test_an_installed_module_is_imported_by_name_without_allow_code(loops, tmp_path, monkeypatch):
    """The run's code installed elsewhere (here: on sys.path from another folder) needs no flag."""
    installed = copy_loop(tmp_path / "site", 1.0).parent
    monkeypatch.syspath_prepend(str(installed))
    monkeypatch.delitem(sys.modules, "tinyloop", raising=False)
    result = invoke("run", str(loops["a"]), "--steps", "1:6", "--json")
    assert result.exit_code == 0, result.output
    assert Path(sys.modules["tinyloop"].__file__).parent == installed
    monkeypatch.delitem(sys.modules, "tinyloop")


def test_a_module_imported_earlier_from_a_folder_no_longer_on_sys_path_is_not_installed(loops, monkeypatch):
    import importlib

    folder = loops["root"] / "b"
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.delitem(sys.modules, "tinyloop", raising=False)
    importlib.import_module("tinyloop")  # b's copy, under the plain name
    sys.path.remove(str(folder))
    with pytest.raises(code.CodeNotAllowed, match="--allow-code"):
        code.import_entrypoint(Run.open(loops["a"]), "tinyloop:replayable", allow_code=False,
                               search_path=str(loops["root"] / "a"))
    monkeypatch.delitem(sys.modules, "tinyloop")


# ------------------------------------------------------------------ two checkouts, one module name

def test_two_loops_with_one_module_name_each_replay_with_their_own_code(loops):
    """Old behaviour: both resolved to the module imported first, so B replayed with a's SCALE
    and differed from its own trace."""
    from replay.engine.protocol import load

    ra, rb = load(Run.open(loops["a"]), allow_code=True), load(Run.open(loops["b"]), allow_code=True)
    ma, mb = sys.modules[type(ra.inner).__module__], sys.modules[type(rb.inner).__module__]
    assert ma is not mb and (ma.SCALE, mb.SCALE) == (1.0, 2.0)
    for name in ("a", "b", "a"):
        result = invoke("run", str(loops[name]), "--steps", "0:7", "--allow-code", "--json")
        assert result.exit_code == 0, (name, result.output)
        assert json.loads(result.stdout)["bit_exact"] == 8


def test_bisect_of_the_two_loops_replays_each_with_its_own_code(loops):
    result = invoke("bisect", str(loops["a"]), str(loops["b"]), "--allow-code", "--json")
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert report["first_step"] == 0, report  # SCALE changes the first update
    assert report.get("failure") is None


def test_a_different_constant_is_caught(loops, tmp_path):
    """The check above can fail: a run replayed with the other checkout's code differs."""
    run = Run.open(loops["b"])
    manifest = {**run.manifest, "replayable_path": str(loops["root"] / "a")}
    from traces.run import write_manifest

    import shutil

    copy = tmp_path / "b_with_a_code"
    shutil.copytree(loops["b"], copy)
    write_manifest(copy / "run.json", manifest)
    result = invoke("run", str(copy), "--steps", "0:7", "--allow-code", "--json")
    assert result.exit_code == 1, result.output


def test_allowing_is_scoped():
    assert code.code_allowed() is False
    with code.allowing(True):
        assert code.code_allowed() is True
    assert code.code_allowed() is False


def test_spec_must_be_module_colon_function(loops):
    with pytest.raises(code.CodeNotAllowed, match="module:function"):
        code.import_entrypoint(Run.open(loops["a"]), "tinyloop.replayable", allow_code=True)


def test_siblings_and_packages_of_two_checkouts_stay_apart(tmp_path):
    """Each folder's module, the modules it imports from its folder, and packages with relative
    imports: loaded per folder, none left under its plain name for the other folder to get."""
    for name in ("a", "b"):
        (tmp_path / name / "pkg").mkdir(parents=True)
        (tmp_path / name / "helper.py").write_text(f"VALUE = {name!r}\n")
        (tmp_path / name / "train.py").write_text("import helper, replay\n@replay.entrypoint\n"
                                                  "def f():\n    return helper.VALUE\n")
        (tmp_path / name / "pkg" / "__init__.py").write_text("")
        (tmp_path / name / "pkg" / "inner.py").write_text(f"V = {name!r}\n")
        (tmp_path / name / "pkg" / "mod.py").write_text("import replay\nfrom . import inner\n@replay.entrypoint\n"
                                                        "def f():\n    return inner.V\n")
    run_path = tmp_path / "run"
    run = Run.create(run_path, Schema(examples_per_step=1, rng_words=2, metrics=(("loss", "loss"),)), {})
    run.finish()
    run = Run.open(run_path)
    got = {spec: [code.import_entrypoint(run, spec, allow_code=True, search_path=str(tmp_path / n))() for n in "ab"]
           for spec in ("train:f", "pkg.mod:f")}
    assert got == {"train:f": ["a", "b"], "pkg.mod:f": ["a", "b"]}
    assert "helper" not in sys.modules and "pkg" not in sys.modules and "train" not in sys.modules
    fn = code.import_entrypoint(run, "train:f", allow_code=True, search_path=str(tmp_path / "a"))
    assert code.function_name(fn) == "train.f"  # named as the manifest names it, not by its private module name
