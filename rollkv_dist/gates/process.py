"""The gates' process runner: a program with a time limit, in its own process group (rollkv_dist.proc, which
every child of rollkv goes through; on timeout or exit the whole group gets SIGTERM, then SIGKILL, so no process
is left holding GPU memory), its output saved under the gate's work folder and its command line recorded in the
gate's result."""

from __future__ import annotations

import os
import shlex
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from rollkv_dist import proc as proc_mod
from rollkv_dist.gates.context import GateResult


@dataclass
class ProcResult:
    cmd: list[str]
    rc: int | None
    timed_out: bool
    seconds: float
    stdout_path: Path
    stderr_path: Path | None

    @property
    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return "" if self.stderr_path is None else self.stderr_path.read_text(errors="replace")

    @property
    def log(self) -> str:
        """Everything the process printed (llama.cpp logs go to stderr)."""
        return self.stdout + ("\n" + self.stderr if self.stderr_path else "")


def run_logged(cmd: list[str], log_base: Path, timeout: float, env: dict[str, str] | None = None,
               split_stderr: bool = False, result: GateResult | None = None,
               show_env: tuple[str, ...] = ()) -> ProcResult:
    """Run cmd with a time limit in its own process group; stdout (and stderr) saved to files.
    The recorded command line starts with `K=V` for the show_env variables set in env."""
    log_base.parent.mkdir(parents=True, exist_ok=True)
    out_p = log_base.with_suffix(".out" if split_stderr else ".log")
    err_p = log_base.with_suffix(".err") if split_stderr else None
    if result is not None:
        shown = [f"{k}={(env or {})[k]}" for k in show_env if k in (env or {})]
        result.commands.append(shlex.join([*shown, *(str(c) for c in cmd)]))
        result.logs.append(str(out_p))
        if err_p:
            result.logs.append(str(err_p))
    t0 = time.monotonic()
    timed_out = False
    with open(out_p, "w") as fo, (open(err_p, "w") if err_p else open(os.devnull, "w")) as fe, \
            proc_mod.running(cmd, stdout=fo, stderr=fe if err_p else subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, env=env) as proc:
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
    return ProcResult([str(c) for c in cmd], None if timed_out else proc.returncode, timed_out,
                      time.monotonic() - t0, out_p, err_p)
