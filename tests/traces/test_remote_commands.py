"""Every command that takes a run takes it on object storage too (issue 35): `replay run`, `verify`,
`compare --eval`, `pack` (full, --from-bisect, --spike), `bisect` with its replays (one run local and
one remote, or both remote), `spike --step` and `audit --verify` of a run in a bucket (moto's S3
server on 127.0.0.1: tests/traces/emulators.py) report what they report of the same run on disk
(verify, which needs a 4-device process of its own, is judged alone), and a remote run that differs
is reported as differing. What replays restores from the run's local
copy (traces.storage.ondemand.local_copy), made once per process with only the checkpoints its
replays read (each fetched when read) and the trace read by ranges; gs:// takes the same path
through the same Store interface (tests/traces/test_remote_runs.py reads both). Files a command
writes beside its report (--plot, -o, --save-batch, unpack's DIR) are local: a URL there is refused
in one line.

The runs are examples/optax_loop.py's clean and learning-rate-bumped runs, shared with
tests/examples (tests/examples/loops.shared_runs), uploaded once per module."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli_util import assert_one_line_error, invoke
from tests.examples import loops
from tests.traces.emulators import upload

import optax_loop  # noqa: E402 - tests.examples.loops puts examples/ on sys.path

LR_AT = loops.LR_AT


@pytest.fixture(scope="module")
def runs(s3, tmp_path_factory):  # noqa: F811
    """{name: (the local run, its copy in the bucket)}: "clean", "lr" (the learning rate doubled at
    LR_AT) and "mixed" (clean's checkpoints and code with lr's trace: a replay of it differs)."""
    local = {k: Path(v) for k, v in loops.shared_runs(optax_loop, ("clean", "lr")).items()}
    mixed = tmp_path_factory.mktemp("mixed") / "mixed"
    shutil.copytree(local["clean"], mixed)
    shutil.rmtree(mixed / "trace")
    shutil.copytree(local["lr"] / "trace", mixed / "trace")
    local["mixed"] = mixed
    return {k: (str(v), upload(v, f"{s3}/commands/{k}")) for k, v in local.items()}


def both(runs, *args):
    """(the command on the local runs, the same on their copies in the bucket, its output with
    each URL put back as its local run): `clean`, `lr`, `mixed` in args name the runs."""
    here = invoke(*[runs[a][0] if a in runs else a for a in args])
    there = invoke(*[runs[a][1] if a in runs else a for a in args])
    text = there.stdout
    for local, url in runs.values():
        text = text.replace(url, local)
    return here, there, text


def fresh_copies(monkeypatch):
    """The test's local copies of remote runs made afresh (one is kept per process), so what they
    fetched is what this test's commands asked for."""
    from traces.storage import ondemand

    monkeypatch.setattr(ondemand, "_COPIES", {})
    monkeypatch.setattr(ondemand, "_LAZY", {})
    return ondemand


def staged_checkpoints(ondemand, url) -> set[int]:
    """The checkpoint steps of `url`'s local copy that hold any file (an unfetched one is an empty folder)."""
    folder = ondemand.local_copy(url) / "checkpoints"
    return {int(p.name) for p in folder.iterdir() if any(f.is_file() for f in p.rglob("*"))}


def test_run_replays_a_remote_run_bit_exact_and_a_remote_run_that_differs_is_reported(runs, monkeypatch):
    from traces import storage

    ondemand = fresh_copies(monkeypatch)
    storage.reset_counts()
    here, there, text = both(runs, "run", "clean", "--steps", "12:14", "--json")
    assert here.exit_code == there.exit_code == 0, there.output
    report = json.loads(there.stdout)
    assert report["run"] == runs["clean"][1] and report["all_bit_exact"] and report["bit_exact"] == 3, report
    assert json.loads(text) == json.loads(here.stdout)
    # It fetched checkpoint 10, which it restored, and 30, the newest, whose saved layout replay.init's
    # replayable reads (traces/storage/ondemand.py); not 0 or 20, nor the trace (read by ranges).
    url, local = runs["clean"][1], Path(runs["clean"][0])
    assert ondemand.fetched_checkpoints(url) == {10: "arrays", 30: "arrays"}
    assert staged_checkpoints(ondemand, url) == {10, 30} and not any((ondemand.local_copy(url) / "trace").iterdir())
    whole = sum(f.stat().st_size for f in local.rglob("*") if f.is_file())  # 469 KB; read: 382 KB (measured)
    assert storage.request_counts()["bytes"] < whole, (storage.request_counts(), whole)
    # Negative control: clean's checkpoints and code replayed against lr's trace differ where lr's learning rate does.
    here, there, text = both(runs, "run", "mixed", "--steps", f"{LR_AT - 1}:{LR_AT}", "--json")
    assert here.exit_code == there.exit_code == 1, there.output
    first = json.loads(there.stdout)["first_mismatch"]
    assert first["step"] == LR_AT and first["fields"][0]["kind"] == "update", first
    assert json.loads(text) == json.loads(here.stdout)


def test_an_error_about_a_remote_runs_checkpoint_names_the_url_not_the_local_copy(runs, s3, tmp_path):  # noqa: F811
    """Checkpoint 10 damaged in the bucket (one byte of its array data flipped): the restore's
    one-line error names the checkpoint at its URL (traces.storage.ondemand.in_url_terms)."""
    local = tmp_path / "damaged"
    shutil.copytree(runs["clean"][0], local)
    data = max((local / "checkpoints" / "10").rglob("d/*"), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    url = upload(local, f"{s3}/commands/damaged")
    result = invoke("run", url, "--steps", "12:14")
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.exit_code == 2 and len(errors) == 1 and "Traceback" not in result.output, result.output
    assert errors[0].startswith(f"error: {url}/checkpoints/10: checkpoint 10 is damaged"), errors
    assert "replay-staging" not in result.output, result.output


def test_bisect_replays_a_local_run_against_a_remote_one_and_two_remote_runs(runs, tmp_path, monkeypatch):
    """Both refine (replays of the window before the first differing step, then the first op): the
    same report either way, and the one tests/examples/loops.check_bisect_lr checks of the two runs
    on disk (their own bisect is not repeated here: ~4 CPU s). Of each remote run only the
    checkpoint its replays restore from (10, before LR_AT) and the newest (its layout) are fetched."""
    ondemand = fresh_copies(monkeypatch)
    plot = tmp_path / "bisect.png"
    reports = []
    for a, b, extra in ((runs["clean"][0], runs["lr"][1], ["--plot", str(plot)]), (runs["clean"][1], runs["lr"][1], [])):
        there = invoke("bisect", a, b, "--json", *extra)
        assert there.exit_code == 1, there.output
        report = json.loads(there.stdout.replace(runs["clean"][1], runs["clean"][0]).replace(runs["lr"][1], runs["lr"][0]))
        if extra:
            assert report["notes"].pop() == f"plot written to {plot}", report["notes"]
        reports.append(report)
    assert reports[0] == reports[1]
    for name in ("clean", "lr"):
        assert ondemand.fetched_checkpoints(runs[name][1]) == {10: "arrays", 30: "arrays"}, name
        assert staged_checkpoints(ondemand, runs[name][1]) == {10, 30}, name
    report = reports[0]
    assert (report["first_step"], report["cause"], report["refinement"]["op"]["op"]) == (LR_AT, "update", "eq"), report
    assert report["layer"] == report["fields"][0]["name"] and plot.read_bytes()[:4] == b"\x89PNG"
    same = invoke("bisect", runs["clean"][0], runs["clean"][1], "--json")  # one run, on disk and in the bucket
    assert same.exit_code == 0 and json.loads(same.stdout)["identical"] is True, same.output


def test_compare_eval_of_remote_runs_says_what_it_says_of_the_local_ones(runs):
    here, there, text = both(runs, "compare", "clean", "lr", "--eval", "--json")
    assert here.exit_code == there.exit_code == 1, there.output  # lr's doubled learning rate: its weights differ
    assert json.loads(text) == json.loads(here.stdout)
    same = invoke("compare", runs["clean"][0], runs["clean"][1], "--eval", "--json")  # one run, two places
    assert same.exit_code == 0 and json.loads(same.stdout)["agree"], same.output
    assert_one_line_error(invoke("compare", runs["clean"][1], runs["clean"][1], "--eval"),
                          f"{runs['clean'][1]} and {runs['clean'][1]} are the same run")
    assert_one_line_error(invoke("compare", runs["clean"][1] + "-absent", runs["lr"][1], "--eval"),
                          f"{runs['clean'][1]}-absent: no such run")


def test_pack_of_a_remote_run_replays_as_the_pack_of_the_local_run(runs, tmp_path):
    results = {}
    for where in (0, 1):
        out = tmp_path / f"{where}.rpk"
        packed = invoke("pack", runs["clean"][where], "--steps", "12:14", "-o", str(out), "--json")
        assert packed.exit_code == 0, packed.output
        replayed = invoke("run", str(out), "--json")
        assert replayed.exit_code == 0, replayed.output
        results[where] = (json.loads(packed.stdout), json.loads(replayed.stdout.replace(f"{where}.rpk", "X.rpk")))
    (local_pack, local_run), (remote_pack, remote_run) = results[0], results[1]
    assert remote_run == local_run and local_run["all_bit_exact"] and local_run["checkpoint"] == 10, remote_run
    assert [p["name"] for p in remote_pack["parts"]] == [p["name"] for p in local_pack["parts"]]
    assert remote_pack["examples"] == local_pack["examples"] > 0
    # --from-bisect and --spike replay the run (and bisect's other run) before packing.
    for extra, name in ((["--from-bisect", "lr"], "bisect"), (["--spike", "13"], "spike")):
        packs = [invoke("pack", runs["clean"][w], *(runs["lr"][w] if a == "lr" else a for a in extra),
                        "-o", str(tmp_path / f"{name}{w}.rpk"), "--json") for w in (0, 1)]
        assert packs[0].exit_code == packs[1].exit_code == 0, packs[1].output
        local, remote = (json.loads(p.stdout)["finding"] for p in packs)
        remote = json.loads(json.dumps(remote).replace(runs["clean"][1], runs["clean"][0])
                            .replace(runs["lr"][1], runs["lr"][0]))
        assert remote == local and local, name
    assert local["step"] == 13


def test_spike_step_and_audit_verify_of_a_remote_run(runs):
    spike = ("spike", "clean", "--step", str(LR_AT + 1), "--window", "5", "--json")  # after LR_AT: lr's losses differ
    for args in (spike, ("audit", "--verify", "--json", "clean")):
        here, there, text = both(runs, *args)
        assert here.exit_code == there.exit_code == 0, there.output
        assert json.loads(text) == json.loads(here.stdout), args


@pytest.mark.slow
def test_verify_of_a_remote_run_on_four_devices(runs):
    """verify needs 3 devices or more, set before JAX starts: a fresh 4-device process (its
    environment carries moto's endpoint) verifies the remote "mixed" run at LR_AT - 1 (clean's
    code reproduces its trace) and LR_AT (no re-execution reproduces lr's trace: a finding)."""
    code = ("import sys; from tests.cli_util import invoke; r = invoke('verify', sys.argv[1], '--steps', sys.argv[2], "
            "'--json'); print(r.exit_code); print(r.stdout.strip().splitlines()[-1]); print(r.stderr[-1000:])")
    examples = str(Path(loops.__file__).resolve().parents[2] / "examples")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]), examples])}
    done = subprocess.run([sys.executable, "-c", code, runs["mixed"][1], f"{LR_AT - 1}:{LR_AT}"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    exit_code, report = done.stdout.splitlines()[:2]
    report = json.loads(report)
    assert exit_code == "1", done.stdout
    assert (report["run"], report["steps"], report["steps_verified"]) == (runs["mixed"][1], [LR_AT - 1, LR_AT], 2)
    assert report["devices"] == 4 and not report["clean"], report
    assert [(f["class"], f["step"]) for f in report["findings"]] == [("trace", LR_AT)], report["findings"]


def test_files_a_command_writes_are_local_and_a_url_there_is_refused_in_one_line(runs, tmp_path):
    url = runs["clean"][1]
    for args, where in ((("bisect", runs["clean"][0], url, "--plot", f"{url}/b.png"), "--plot"),
                        (("spike", url, "--plot", f"{url}/s.png"), "--plot"),
                        (("spike", url, "--step", "13", "--save-batch", f"{url}/b.npy"), "--save-batch"),
                        (("pack", url, "--lite", "--steps", "1:2", "-o", f"{url}/x.rpk"), "-o"),
                        (("unpack", str(tmp_path / "x.rpk"), f"{url}-unpacked"), "DIR")):
        assert_one_line_error(invoke(*args), f"{where} ", "is written to local disk, not to object storage")
    assert_one_line_error(invoke("unpack", f"{url}/x.rpk", str(tmp_path / "x")), "unpack reads a bundle from local disk")
    # A bundle file in the bucket is not opened as a run: one line saying to copy it here.
    from traces.storage import open_store

    store, key = open_store(f"{url}-bundle.rpk")
    store.write_if_absent(key, b"not read")
    for command in ("show", "run"):
        assert_one_line_error(invoke(command, f"{url}-bundle.rpk"), f"{url}-bundle.rpk: is a file, not a run folder",
                              "copy it here first")


def test_the_process_is_prepared_from_a_remote_runs_manifest_before_the_command(runs, monkeypatch):
    from replay import plugins

    seen = []
    monkeypatch.setattr(plugins, "prepare_process", lambda manifest, warn: seen.append(manifest))
    result = invoke("verify", runs["clean"][1], "--steps", "x")  # refused before verify prepares the process itself
    assert result.exit_code == 2 and seen == [json.loads(Path(runs["clean"][0], "run.json").read_text())], seen
