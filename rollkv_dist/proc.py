"""Child processes of rollkv: every child in its own process group, killed as a group.

Build tools (cmake -> ninja -> compilers), pip (and the build backends it runs to prepare an
sdist's metadata) and the engine's programs start helpers of their own. Killing only the
direct child leaves those running with parent 1, so every child started here gets a new
session (``start_new_session=True``: its pid is its process group id) and is stopped with
``os.killpg``: SIGTERM, then SIGKILL after a grace period, then SIGKILL once more for any
member that survived the leader.

Every group started is appended to STARTED_GROUPS (the gates check after each gate that none
of its groups is still alive) and kept in a registry until it is gone; ``kill_all()`` stops what
is left (the CLI calls it on every exit, interrupt included). ``handle_termination()`` turns
SIGTERM into ``Terminated`` (a KeyboardInterrupt), so an interrupt and a kill of rollkv both
run the same clean-up: child groups killed, temporary outputs removed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

STARTED_GROUPS: list[int] = []  # every process group started through this module, in order
_LIVE: dict[int, subprocess.Popen[Any]] = {}  # groups not yet known to be gone
GRACE_S = 10.0  # SIGTERM -> SIGKILL


class Terminated(KeyboardInterrupt):
    """rollkv received SIGTERM; handled like an interrupt (clean-up runs, exit 143)."""


def popen(cmd: Sequence[str | os.PathLike[str]], **kwargs: Any) -> subprocess.Popen[Any]:
    """subprocess.Popen in a new process group (session), registered for kill_all()."""
    kwargs["start_new_session"] = True
    proc = subprocess.Popen([str(c) for c in cmd], **kwargs)
    STARTED_GROUPS.append(proc.pid)
    _LIVE[proc.pid] = proc
    return proc


def kill_group(proc: subprocess.Popen[Any], grace: float = GRACE_S) -> None:
    """SIGTERM the child's process group, SIGKILL after `grace` s; no member is left running.

    Safe to call for a child that already exited (its helpers may not have). A second
    interrupt while waiting skips straight to SIGKILL.
    """
    pgid = proc.pid
    try:
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 15.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
            except KeyboardInterrupt:
                continue
    finally:
        # the leader is gone (or never answered); no member of the group may survive it
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        if proc.returncode is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=15.0)
        # SIGKILL is delivered asynchronously: the other members (reparented, not ours to wait for) may still be
        # listed as running for a moment after the leader is reaped
        deadline = time.monotonic() + 5.0
        while group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.02)
        if not group_alive(pgid):
            _LIVE.pop(pgid, None)


def group_alive(pgid: int) -> bool:
    """True when a process of group pgid still runs (zombies, which hold nothing, do not count)."""
    proc = Path("/proc")
    if proc.is_dir():
        for d in proc.iterdir():
            if not d.name.isdigit():
                continue
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                return True
        return False
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


@contextlib.contextmanager
def running(cmd: Sequence[str | os.PathLike[str]], grace: float = GRACE_S,
            **kwargs: Any) -> Iterator[subprocess.Popen[Any]]:
    """Start cmd in its own group; on leaving the block (normally, on error, on interrupt)
    the whole group is killed, so nothing it started outlives it."""
    proc = popen(cmd, **kwargs)
    try:
        yield proc
    finally:
        kill_group(proc, grace)


def run(cmd: Sequence[str | os.PathLike[str]], *, timeout: float | None = None, input: str | None = None,
        **kwargs: Any) -> subprocess.CompletedProcess[Any]:
    """Like subprocess.run (capture with capture_output=True), but the child runs in its own
    group and the whole group dies on timeout (subprocess.TimeoutExpired) or interrupt."""
    if kwargs.pop("capture_output", False):
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    with running(cmd, **kwargs) as p:
        try:
            out, err = p.communicate(input=input, timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(p)
            raise
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def kill_all() -> list[int]:
    """Kill every registered group that still has a live member; returns their ids."""
    killed = []
    for pgid, proc in list(_LIVE.items()):
        if proc.poll() is None or group_alive(pgid):
            killed.append(pgid)
            kill_group(proc, grace=2.0)
        else:
            _LIVE.pop(pgid, None)
    return killed


@contextlib.contextmanager
def handle_termination() -> Iterator[None]:
    """Within the block SIGTERM raises Terminated (a KeyboardInterrupt) in the main thread."""
    def on_term(_sig: int, _frame: Any) -> None:
        raise Terminated()

    try:
        previous = signal.signal(signal.SIGTERM, on_term)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
