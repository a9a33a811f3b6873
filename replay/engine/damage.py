"""A run's damage and its name, for people: what every command that opens a run says of it.

A command names a run as the user gave it: the bundle file for a bundle (BUNDLE:member for its
files), never the temporary folder the bundle was unpacked to; the run folder otherwise. Damage
is what traces' Run.damage finds cheaply (headers, seals, missing segments, a trace shorter than
the finished run), less the torn last record a crash or a live writer leaves; a command that
needs the run whole refuses it in one line naming the file, byte and step (DamagedRunError).
Cost: no read beyond what opening the run read.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

from traces import Run, TraceCorruptError, describe_damage as describe_trace_damage


class DamagedRunError(TraceCorruptError):
    """A run or bundle whose trace is damaged, given to a command that needs it whole."""


def run_damage(run: Run, crash_tail: bool = True) -> list:
    """The damage known cheaply of `run` (traces' Run.damage: headers, seals, missing leading
    segments, a trace shorter than the finished run). `crash_tail`: leave out the torn last
    record of a run that is not complete -- what a crash or a live writer leaves, not damage."""
    found = getattr(run, "damage", None)
    found = list(found() if callable(found) else found) if found is not None else list(run.trace.damage)
    tail = run.trace.tail if crash_tail and run.status != "complete" else None
    if tail is not None:
        found = [d for d in found if (d.path, d.offset) != (str(tail[0]), tail[1])]
    return found


def describe_damage(run: Run, damage: list) -> str:
    """One line naming the file, byte and step of the first damage, in the bundle's terms for a bundle."""
    return bundle_terms(run, describe_trace_damage(damage))


def damage_error(run: Run, what: str, remedy: str, crash_tail: bool = True) -> DamagedRunError | None:
    """The one-line refusal of a damaged `run` ("WHAT is damaged: ...; steps a..b are readable;
    REMEDY"), or None when its trace is undamaged."""
    damage = run_damage(run, crash_tail)
    if not damage:
        return None
    trace = run.trace
    readable = f"steps {trace.start}..{trace.end - 1} are readable" if len(trace) else "no step is readable"
    return DamagedRunError(f"{what} is damaged: {describe_damage(run, damage)}; {readable}; {remedy}", shown_path(run))


def shown_path(run: Run) -> str:
    """What to call `run` in a message: the bundle file for a bundle, else the run folder."""
    return str(getattr(run, "bundle", None) or run.path)


def bundle_terms(run: Run, text: str) -> str:
    """`text` with a bundle's temporary folder replaced by the bundle file (BUNDLE:member)."""
    bundle = getattr(run, "bundle", None)
    return in_terms(text, run.path, bundle) if bundle else text


def in_terms(text: str, root, bundle) -> str:
    return text.replace(str(root) + os.sep, f"{bundle}:").replace(str(root), str(bundle))


def rename_in(e: BaseException, root, bundle) -> None:
    """Rewrites the message of `e` (its first argument) in the bundle's terms."""
    if e.args and isinstance(e.args[0], str):
        e.args = (in_terms(e.args[0], root, bundle),) + e.args[1:]


@contextmanager
def named_as_bundle(run: Run):
    """Errors raised inside name the bundle file, not the temporary folder it was unpacked to."""
    try:
        yield
    except Exception as e:
        if getattr(run, "bundle", None):
            rename_in(e, run.path, run.bundle)
        raise
