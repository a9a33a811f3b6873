"""`replay demo`: the main job of the README quick start.

Issue 5 builds it: train run A on the embedded corpus, train run B with a data-repeat fault
in the middle (the "cluster change"), bisect and audit them, and show the first divergent
step, the cause and the repeated examples. Until then it says so and exits 3, rather than
pretend.
"""

from __future__ import annotations

import typer

from replay.cli import console
from replay.cli.errors import EXIT_NOT_IMPLEMENTED


def register(app: typer.Typer) -> None:
    app.command("demo")(demo)


def demo() -> None:
    """Train two runs, one fed repeated data mid-way, and let bisect find where and why (not built yet)."""
    console.status(
        "replay demo will train run A on the embedded corpus, train run B with a data-repeat fault in the "
        "middle, then run `replay bisect A B` to name the first divergent step, the cause (data) and the "
        "repeated examples."
    )
    console.fail("replay demo is not implemented yet (issue 5); `replay show RUN` works now", EXIT_NOT_IMPLEMENTED)
