"""The `replay` command: a typer app, one module per command under replay/cli/.

Each command module has `register(app)`, which adds its command to the app; it stays a thin
wrapper that parses options, calls library code and prints through `replay.cli.console`.
Heavy imports (JAX, the trainer) go inside the command function, so `replay show` and
`replay --help` start fast.

Errors are turned into exit codes in one place, `ReplayGroup.invoke`, so the console script
and in-process tests (typer's CliRunner) behave the same:
  * a user error (see replay/cli/errors.py): `error: <message>` on stderr, its exit code (2);
  * any other exception is a bug in replay: one line saying so, exit 1;
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

from replay.cli import console
from replay.cli.errors import EXIT_BUG, user_error_code

_DEBUG_KEY = "replay.debug"


def _is_framework_exception(exc: BaseException) -> bool:
    """typer's own control flow (Exit, Abort, usage errors): handled by typer itself."""
    return type(exc).__module__.split(".")[0] in ("typer", "click")


_NO_STEPS = ("show", "audit", "plan", "unpack")  # commands that never run a train step


def _prepare_mesh_invariant(args: list[str]) -> None:
    """A mesh-invariant run (trainer/invariant.py) needs XLA:CPU settings in place before anything
    starts JAX, and commands start it early (orbax opening a checkpoint directory): so when any
    argument is such a run, apply them before the command runs (one-line error if too late)."""
    if not args or args[0] in _NO_STEPS:
        return
    for arg in args[1:]:
        manifest = Path(arg.split("=", 1)[-1]) / "run.json"
        try:
            mesh = json.loads(manifest.read_text()).get("config", {}).get("mesh", {})
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(mesh, dict) and mesh.get("mesh_invariant"):
            from replay.cli.errors import register_user_error
            from trainer import invariant
            from trainer.config import ConfigError

            register_user_error(ConfigError)
            invariant.prepare_process()
            return


class ReplayGroup(TyperGroup):
    """The root command group: converts exceptions into one line and an exit code."""

    def invoke(self, ctx: Any) -> Any:
        try:
            _prepare_mesh_invariant([*getattr(ctx, "_protected_args", ()), *ctx.args])
            return super().invoke(ctx)
        except Exception as exc:
            if _is_framework_exception(exc):
                raise
            debug = bool(ctx.meta.get(_DEBUG_KEY))
            code = user_error_code(exc)
            if debug:
                traceback.print_exception(exc, file=sys.stderr)
            if code is not None:
                console.error(str(exc) or type(exc).__name__)
            else:
                hint = "" if debug else "; rerun with `replay --debug ...` for the traceback"
                console.error(
                    f"internal error, this is a bug in replay: {type(exc).__name__}: {exc}{hint}; please report it"
                )
                code = EXIT_BUG
            raise typer.Exit(code) from None


app = typer.Typer(
    name="replay",
    cls=ReplayGroup,
    help="Deterministic record/replay and bisection debugger for JAX training.",
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
) -> None:
    """Deterministic record/replay and bisection debugger for JAX training.

    Exit codes: 0 ok, 1 runs differ (or a bug in replay), 2 bad input, 3 not built yet.
    """
    ctx.meta[_DEBUG_KEY] = debug


def _register_commands() -> None:
    from replay.cli import audit, bisect, demo, pack, plan, run, show, spike, train, unpack

    for module in (show, train, run, bisect, audit, spike, pack, unpack, plan, demo):
        module.register(app)


_register_commands()


def main() -> None:
    """Entry point of the `replay` console script."""
    app()


if __name__ == "__main__":
    main()
