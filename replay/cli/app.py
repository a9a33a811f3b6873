"""The `replay` command: a typer app, one module per command under replay/cli/.

Each command module has `register(app)`, which adds its command to the app; it stays a thin
wrapper that parses options, calls library code and prints through `replay.cli.console`.
Heavy imports (JAX) go inside the command function, so `replay show` and `replay --help` start
fast. Installed plugins (replay/plugins.py; the trainer's `train`, `plan`, `demo`) add their
commands when a command name is not one of replay's own or the commands are listed, so
`replay show` imports no plugin.

Errors are turned into exit codes in one place, `ReplayGroup`, so the console script and
in-process tests (typer's CliRunner) behave the same:
  * a user error (the table in replay/errors.py): `error: <message>` on stderr, its code
    (1 when the runs differ, 2 for bad input or a damaged run);
  * a usage error (an unknown option or command, a missing argument, a value click cannot
    parse): one `error:` line that names the command's --help, exit 2;
  * any other exception is a bug in replay: one line saying so, exit 3;
  * the traceback is printed (to stderr) only with `replay --debug ...` or REPLAY_DEBUG=1.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from replay import plugins
from replay.cli import console
from replay.errors import EXIT_BAD_INPUT, exit_code_of, message, user_error_code

try:  # recent typer carries its own copy of click
    from typer._click import exceptions as _click_exceptions
except ImportError:  # pragma: no cover - older typer uses click itself
    from click import exceptions as _click_exceptions

_DEBUG_KEY = "replay.debug"
EXIT_CODES_LINE = "Exit codes: 0 ok, 1 the runs differ, 2 bad input or a damaged run, 3 a bug in replay."
_CONTROL_FLOW = (typer.Exit, typer.Abort, *(getattr(_click_exceptions, n) for n in ("Exit", "Abort")
                                            if hasattr(_click_exceptions, n)))
_HELP_SHOWN = getattr(_click_exceptions, "NoArgsIsHelpError", ())  # `replay` alone: the help, as click prints it


def _raise_usage_exit(exc: Exception, command_path: str):
    """click's three lines (usage, hint, error) as one: what is wrong and where the help is.
    `command_path` names the command when click's error carries no context (bad option usage)."""
    text = " ".join(exc.format_message().split()).rstrip(".")
    text = text[:1].lower() + text[1:]
    ctx = getattr(exc, "ctx", None)
    console.error(f"{text}; see `{ctx.command_path if ctx is not None else command_path} --help`")
    raise typer.Exit(EXIT_BAD_INPUT) from None


_NO_STEPS = ("show", "audit", "unpack")  # commands that never run a train step


def _prepare_process(args: list[str]) -> None:
    """A run may need the process prepared before anything starts JAX (a mesh-invariant trainer
    run: XLA:CPU settings), and commands start it early (orbax opening a checkpoint directory): so
    the manifest of each run an argument names goes to the plugins' `prepare_process` before the
    command runs (one-line error if too late). A run on gs:// or s3:// costs one request here."""
    from traces.errors import TraceError
    from traces.storage import as_path, is_url

    if not args or args[0] in _NO_STEPS:
        return
    if args[0] == "spike" and not any(a == "--step" or a.startswith("--step=") for a in args[1:]):
        return  # the scan reads the trace only: no plugin discovery (~35 ms of importlib.metadata)
    for arg in args[1:]:
        location = arg.split("=", 1)[-1]
        try:
            folder = as_path(location) if is_url(location) else Path(location)
            manifest = json.loads((folder / "run.json").read_text())
        except (OSError, ValueError, TraceError):  # not a run, or not readable: the command says so itself
            continue
        if isinstance(manifest, dict):
            plugins.prepare_process(manifest, warn=console.warn)


class ReplayGroup(TyperGroup):
    """The root command group: converts exceptions into one line and an exit code, and adds the
    plugins' commands on first need."""

    _plugins_added = False

    def _add_plugin_commands(self) -> None:
        if self._plugins_added:
            return
        self._plugins_added = True
        extra = typer.Typer(rich_markup_mode=None, add_completion=False)
        plugins.register_commands(extra, warn=console.warn)
        if not extra.registered_commands:
            return
        for name, command in typer.main.get_group(extra).commands.items():
            if name in self.commands:  # replay's own command keeps its name
                console.warn(f"a plugin's command `{name}` is ignored: replay has its own `{name}`")
                continue
            self.add_command(command, name)

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        if cmd_name not in self.commands:
            self._add_plugin_commands()
        return super().get_command(ctx, cmd_name)

    def list_commands(self, ctx: Any) -> list[str]:
        self._add_plugin_commands()
        return super().list_commands(ctx)

    def make_context(self, info_name: Any, args: Any, parent: Any = None, **extra: Any) -> Any:
        try:  # the root's own options: `replay --bogus`
            return super().make_context(info_name, args, parent, **extra)
        except _HELP_SHOWN:
            raise
        except _click_exceptions.ClickException as exc:
            _raise_usage_exit(exc, str(info_name or self.name))

    def invoke(self, ctx: Any) -> Any:
        args = [*getattr(ctx, "_protected_args", ()), *ctx.args]
        known = bool(args) and self.get_command(ctx, args[0]) is not None
        command_path = ctx.command_path + (f" {args[0]}" if known else "")
        try:
            _prepare_process(args)
            return super().invoke(ctx)
        except _CONTROL_FLOW:
            raise
        except _HELP_SHOWN:
            raise
        except _click_exceptions.ClickException as exc:  # the command's options and arguments
            _raise_usage_exit(exc, command_path)
        except Exception as exc:
            debug = bool(ctx.meta.get(_DEBUG_KEY))
            if debug:
                traceback.print_exception(exc, file=sys.stderr)
            line = message(exc)
            if user_error_code(exc) is None:
                line += ("" if debug else "; rerun with `replay --debug ...` for the traceback") + "; please report it"
            console.error(line)
            raise typer.Exit(exit_code_of(exc)) from None


app = typer.Typer(
    name="replay",
    cls=ReplayGroup,
    help="Deterministic record/replay and bisection debugger for JAX training.",
    epilog=EXIT_CODES_LINE,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


@app.callback()
def _root(
    ctx: typer.Context,
    debug: Annotated[
        bool, typer.Option("--debug", envvar="REPLAY_DEBUG", help="Print full tracebacks on errors.")
    ] = False,
    trust_unchecked_manifest: Annotated[
        bool, typer.Option("--trust-unchecked-manifest", envvar="REPLAY_TRUST_UNCHECKED_MANIFEST",
                           help="Read a format_version 1 run.json that has no checksum (recorded before replay "
                                "checked manifests) as written, instead of refusing it.")
    ] = False,
) -> None:
    """Deterministic record/replay and bisection debugger for JAX training."""
    from traces.manifest import trusting_unchecked_manifests

    ctx.meta[_DEBUG_KEY] = debug
    ctx.with_resource(trusting_unchecked_manifests(trust_unchecked_manifest))  # for this command only


def _register_commands() -> None:
    """replay's own commands; the plugins' join them in `ReplayGroup` when first needed."""
    from replay.cli import audit, bisect, compare, pack, run, show, spike, unpack, verify

    for module in (show, run, bisect, compare, audit, spike, pack, unpack, verify):
        module.register(app)


_register_commands()


def main() -> None:
    """Entry point of the `replay` console script."""
    app()


if __name__ == "__main__":
    main()
