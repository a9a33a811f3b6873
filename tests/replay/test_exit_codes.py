"""Exit codes: 0 ok, 1 the runs differ, 2 bad input or a damaged run, 3 a bug in replay.

Every command refuses a bad input with exactly one `error:` line and exit 2 and changes
nothing on disk; click's usage errors are one such line too; the code of an exception comes
from one static table, whatever ran before in the process. In-process (CliRunner) and on a
run written with the traces API alone, so no test here trains or compiles.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import traces
from replay import audit as audit_lib
from replay import errors
from tests.cli_util import assert_error_line, dir_digest, invoke

ROOT = Path(__file__).resolve().parents[2]
B = 4
STEPS = 20
COMMANDS = ("show", "train", "run", "bisect", "compare", "audit", "spike", "pack", "unpack", "plan", "demo", "verify")


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """20 recorded steps in three segments, with per-example hashes (audit) and a loss (spike)."""
    path = tmp_path_factory.mktemp("exit-codes") / "run"
    schema = traces.Schema(examples_per_step=B, rng_words=2, metrics=(("loss", "loss"),))
    r = traces.Run.create(path, schema, {"config": {"model": {"seq_len": 4}}, "data": {}})
    writer = r.writer(8)
    for k in range(STEPS):
        writer.append(traces.StepRecord(k, np.array([k, 1], np.uint32), k + 1,
                                        np.arange(k * B, (k + 1) * B, dtype=np.uint64) + 7,
                                        np.array([1.0 / (k + 1)], np.float32)))
    r.finish()
    return path


@pytest.fixture
def a_file(tmp_path) -> Path:
    path = tmp_path / "notes.txt"
    path.write_text("not a folder, not a bundle\n")
    return path


# ------------------------------------------------------------------------------ bad input, per command


def _bad_inputs(run: Path, tmp: Path, a_file: Path) -> dict[str, tuple[list[str], tuple[str, ...], Path | None]]:
    """command -> (argv, words the error line must hold, a path the command must not create)."""
    missing = tmp / "missing"
    return {
        "show": (["show", str(missing)], ("no such run",), None),
        "train": (["train", "--preset", "no-such-preset", "--out", str(tmp / "new")], ("no-such-preset",), tmp / "new"),
        "run": (["run", str(run), "--steps", "100:200"], ("100:200", "0..19"), None),
        "bisect": (["bisect", str(run), str(missing)], ("no such run", str(missing)), None),
        "audit": (["audit", str(run), "--steps", "0:500"], ("0:500", "0..19"), None),
        "spike": (["spike", str(run), "--window", "0"], ("--window 0",), None),
        "pack": (["pack", str(missing), "-o", str(tmp / "bug.rpk")], ("no such run",), tmp / "bug.rpk"),
        "unpack": (["unpack", str(a_file), str(tmp / "dir")], ("not a replay bundle",), tmp / "dir"),
        "plan": (["plan", "--preset", "no-such-preset", "--devices", "2"], ("no-such-preset",), None),
        "demo": (["demo", "--out", str(a_file)], ("--out", "is a file"), None),
        "compare": (["compare", str(run), str(missing), "--eval"], ("no such run", str(missing)), None),
        "verify": (["verify", str(missing), "--steps", "0:2"], ("no such run",), None),
    }


@pytest.mark.parametrize("command", COMMANDS)
def test_bad_input_is_one_line_exit_2_and_changes_nothing(command, run, tmp_path, a_file):
    argv, words, not_created = _bad_inputs(run, tmp_path, a_file)[command]
    run_before, file_before = dir_digest(run), a_file.read_bytes()
    assert_error_line(invoke(*argv), 2, *words)
    assert dir_digest(run) == run_before
    assert a_file.read_bytes() == file_before
    assert not_created is None or not not_created.exists()


@pytest.mark.parametrize("steps", ["0:500", "15:21", "25:", "20:30"])
def test_audit_refuses_a_range_past_the_recorded_steps(run, steps):
    """It audited 0..19 for --steps 0:500 and said nothing: a range is audited whole or refused."""
    line = assert_error_line(invoke("audit", str(run), "--steps", steps), 2, steps, "0..19")
    assert "0:20" in line  # what to give instead
    assert invoke("audit", str(run), "--steps", "0:20").exit_code == 0
    assert invoke("audit", str(run), "--steps", "15:").exit_code == 0


def test_demo_out_below_a_file_is_refused(a_file):
    line = assert_error_line(invoke("demo", "--out", str(a_file / "demo")), 2, str(a_file))
    assert "is a file" in line


# ------------------------------------------------------------------------------ usage errors (click)


def _usage_errors(run: Path, tmp: Path) -> list[tuple[list[str], tuple[str, ...]]]:
    out = str(tmp / "out.rpk")
    return [
        *[([cmd, "--no-such-option"], ("no such option", f"replay {cmd} --help")) for cmd in COMMANDS],
        *[([cmd], ("missing", f"replay {cmd} --help")) for cmd in ("show", "run", "bisect", "audit", "spike", "unpack")],
        (["pack", str(run)], ("missing", "replay pack --help")),
        (["plan", "--preset", "tiny"], ("missing option", "--devices")),
        (["plan", "--preset", "tiny", "--devices", "abc"], ("invalid value", "--devices", "replay plan --help")),
        (["demo", "--steps", "abc"], ("invalid value", "--steps", "replay demo --help")),
        (["train", "--preset", "tiny", "--steps", "abc"], ("invalid value", "--steps", "replay train --help")),
        (["spike", str(run), "--step", "abc"], ("invalid value", "--step", "replay spike --help")),
        (["spike", str(run), "--threshold", "high"], ("invalid value", "--threshold")),
        (["pack", str(run), "-o", out, "--spike", "abc"], ("invalid value", "--spike")),
        (["show", str(run), "--json=yes"], ("--json", "replay show --help")),
        (["bisect", str(run), str(run), "extra"], ("unexpected extra argument", "replay bisect --help")),
        (["no-such-command"], ("no such command", "replay --help")),
        (["--no-such-option", "show"], ("no such option", "replay --help")),
    ]


def test_usage_errors_are_one_line_exit_2(run, tmp_path):
    """click printed three lines (Usage, Try, Error) for each of these."""
    before = dir_digest(run)
    for argv, words in _usage_errors(run, tmp_path):
        result = invoke(*argv)
        try:
            assert_error_line(result, 2, *words)
        except AssertionError as e:
            raise AssertionError(f"replay {' '.join(argv)}: {e}") from None
        assert "Usage:" not in result.output, argv
    assert dir_digest(run) == before and not (tmp_path / "out.rpk").exists()


def test_every_registered_command_is_checked_here():
    """A command added without a row in COMMANDS would escape the bad-input and usage checks
    (the plugins' commands too: the trainer's train, plan and demo, added when listed)."""
    import typer

    from replay.cli.app import app

    group = typer.main.get_command(app)
    assert set(group.list_commands(typer.Context(group))) == set(COMMANDS)


def test_help_is_still_help():
    result = invoke("--help")
    assert result.exit_code == 0 and "2 bad input or a damaged run, 3 a bug in replay" in " ".join(result.stdout.split())
    for cmd in COMMANDS:
        result = invoke(cmd, "--help")
        assert result.exit_code == 0 and "Usage:" in result.stdout, cmd


# ------------------------------------------------------------------------------ the table


def _resolve(name: str) -> type:
    module, _, qualname = name.rpartition(".")
    while module:  # "pkg.mod.Outer.Inner": the module is the longest importable prefix
        try:
            obj = importlib.import_module(module)
            break
        except ModuleNotFoundError:
            module, _, outer = module.rpartition(".")
            qualname = f"{outer}.{qualname}"
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def test_every_table_entry_names_an_exception_class():
    """A renamed or moved class would silently become a bug (exit 3): the names must resolve."""
    for name, code in errors.EXIT_CODES.items():
        cls = _resolve(name)
        assert isinstance(cls, type) and issubclass(cls, BaseException), name
        assert errors.class_name(cls) == name
        assert code in (errors.EXIT_DIVERGED, errors.EXIT_BAD_INPUT), name


def _defined_exception_classes() -> list[type]:
    """Every exception class that replay/, traces/ and trainer/ define at module level."""
    found = []
    for package in ("replay", "traces", "trainer"):
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text())
            names = [n.name for n in tree.body if isinstance(n, ast.ClassDef) and n.bases]
            if not names:
                continue
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            if module.startswith("replay.torch") and importlib.util.find_spec("torch") is None:
                continue  # an environment without torch (tools/maxtext-env.sh's): nothing there can raise
            mod = importlib.import_module(module)
            found += [c for c in (getattr(mod, n) for n in names) if isinstance(c, type) and issubclass(c, BaseException)]
    return found


def test_every_exception_the_packages_raise_to_users_has_a_code():
    """A new error class without an entry would be reported as a bug in replay."""
    classes = _defined_exception_classes()
    assert len(classes) >= 10
    missing = [errors.class_name(c) for c in classes if errors.code_of_type(c) is None]
    assert not missing, f"add these to replay/errors.py EXIT_CODES: {missing}"


def test_most_specific_class_wins():
    from trainer.config import ConfigError

    class LocalConfigError(ConfigError):
        pass

    assert errors.exit_code_of(traces.StepOrderError("x")) == 2
    assert errors.exit_code_of(traces.TraceCorruptError("x")) == 2
    assert errors.exit_code_of(LocalConfigError("x")) == 2
    assert errors.exit_code_of(PermissionError(13, "Permission denied", "/x")) == 2
    assert errors.exit_code_of(errors.UserError("x", 1)) == 1
    assert errors.exit_code_of(ValueError("x")) == errors.EXIT_BUG == 3
    assert errors.exit_code_of(RuntimeError("x")) == 3
    assert errors.exit_code_of(OSError("x")) == 3


def test_a_resume_that_did_not_reproduce_a_step_is_a_divergence():
    """It exited 2 (bad input) as a StepOrderError; it is "the runs differ": 1."""
    diverged = getattr(traces.errors, "ResumeDivergedError", None)
    if diverged is None:
        pytest.skip("traces.errors.ResumeDivergedError is not built yet")
    assert issubclass(diverged, traces.StepOrderError)
    assert errors.exit_code_of(diverged("step 12 differs")) == 1

    class Subclass(diverged):
        pass

    assert errors.exit_code_of(Subclass("x")) == 1


def test_the_table_cannot_be_changed_at_run_time():
    with pytest.raises(TypeError):
        errors.EXIT_CODES["builtins.ValueError"] = 2  # type: ignore[index]
    assert not hasattr(errors, "register_user_error")  # no registry that commands could grow


def _raise_from_audit(monkeypatch, exc: BaseException) -> None:
    def broken(*args, **kwargs):
        raise exc

    monkeypatch.setattr(audit_lib, "audit", broken)


def test_unknown_exception_is_a_bug_exit_3(run, monkeypatch):
    _raise_from_audit(monkeypatch, RuntimeError("boom"))
    line = assert_error_line(invoke("audit", str(run)), 3, "bug in replay", "RuntimeError: boom", "--debug")
    assert line.startswith("error: internal error")
    result = invoke("--debug", "audit", str(run))
    assert result.exit_code == 3 and "Traceback" in result.stderr and "RuntimeError: boom" in result.stderr


def test_internal_error_is_one_short_line(run, monkeypatch):
    _raise_from_audit(monkeypatch, RuntimeError("tensorstore said:\n" + "a long line of detail\n" * 200))
    line = assert_error_line(invoke("audit", str(run)), 3, "bug in replay", "tensorstore said")
    assert len(line) < 700


def test_divergence_raised_by_a_command_exits_1(run, monkeypatch):
    diverged = getattr(traces.errors, "ResumeDivergedError", None)
    if diverged is None:
        pytest.skip("traces.errors.ResumeDivergedError is not built yet")
    _raise_from_audit(monkeypatch, diverged(f"{run}: step 12 was recorded with other content"))
    assert_error_line(invoke("audit", str(run)), 1, "step 12")


def test_os_errors_on_user_paths_are_one_line(run, monkeypatch):
    _raise_from_audit(monkeypatch, PermissionError(13, "Permission denied", "/data/tokens.bin"))
    assert_error_line(invoke("audit", str(run)), 2, "/data/tokens.bin: permission denied")


def test_codes_do_not_depend_on_the_commands_run_before(run, monkeypatch, tmp_path):
    """`ConfigError` was a bug (exit 1) until a command that registered it had run in the process."""
    from trainer.config import ConfigError

    def codes() -> tuple[int, int]:
        with monkeypatch.context() as m:
            _raise_from_audit(m, ConfigError("bad config"))
            config = invoke("audit", str(run)).exit_code
            _raise_from_audit(m, ValueError("unexpected"))
            bug = invoke("audit", str(run)).exit_code
        return config, bug

    first = codes()
    for argv in (["plan", "--preset", "nope", "--devices", "1"], ["demo", "--steps", "1"],
                 ["spike", str(run), "--window", "0"], ["train", "--preset", "nope", "--out", str(tmp_path / "t")],
                 ["pack", str(tmp_path / "missing"), "-o", str(tmp_path / "x.rpk")]):
        invoke(*argv)
        assert codes() == first == (2, 3), argv


@pytest.mark.slow
def test_codes_in_a_fresh_process(run):
    """Nothing ran before: ConfigError is still bad input, and a usage error is one line (the
    console-script path: standalone click, not CliRunner)."""
    script = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from replay import audit\n"
        "from replay.cli.app import app\n"
        "from trainer.config import ConfigError\n"
        "def broken(*a, **k):\n"
        "    raise ConfigError('bad config')\n"
        "audit.audit = broken\n"
        "print(CliRunner().invoke(app, ['audit', sys.argv[1]], env={'REPLAY_DEBUG': None}).exit_code)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script, str(run)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == 2
    proc = subprocess.run([sys.executable, "-m", "replay.cli.app", "audit", str(run), "--stpes", "1:2"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: no such option: --stpes"), proc.stderr
    assert "audit --help" in lines[0]
