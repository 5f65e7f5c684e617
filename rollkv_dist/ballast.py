"""GPU memory ballast: hold device memory so that only `--leave-free MiB` stays free.

Emulates a smaller card on a bigger one (the boot-repro gate: a 96 GB card on an H200).
Only `libcuda.so.1` through ctypes (cuInit, cuDeviceGet, primary context, cuMemGetInfo,
cuMemAlloc); no CUDA toolkit, no Python GPU package. Run as a child process:

    python -m rollkv_dist.ballast --leave-free 90000 [--device 0]

It prints one line `rollkv-ballast: ready held=H MiB free=F MiB total=T MiB` when the
memory is held, then waits; SIGTERM/SIGINT (or stdin closing with --watch-stdin) frees the
memory and exits 0. Parents use `Ballast(...)` as a context manager, which always kills the
child's process group on exit (started and registered through rollkv_dist.proc, so the gates'
"nothing left running" check covers it). Select the GPU with CUDA_VISIBLE_DEVICES=<UUID> (gpu.child_env).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from rollkv_dist import proc as proc_mod
from rollkv_dist.errors import NoGPUError, RollkvError

MiB = 1024 * 1024
CHUNK = 1024 * MiB
GRAN = 2 * MiB
READY_RE = re.compile(r"rollkv-ballast: ready held=(\d+) MiB free=(\d+) MiB total=(\d+) MiB")


class CudaDriver:
    """The few driver API calls the ballast needs."""

    def __init__(self, libname: str = "libcuda.so.1"):
        try:
            self.lib = ctypes.CDLL(libname)
        except OSError as e:
            raise NoGPUError(f"cannot load {libname}: {e} (NVIDIA driver not installed?)") from e
        self.ptrs: list[int] = []
        self.dev = ctypes.c_int(0)
        self.ctx = ctypes.c_void_p()

    def _check(self, name: str, rc: int) -> None:
        if rc != 0:
            s = ctypes.c_char_p()
            self.lib.cuGetErrorString(rc, ctypes.byref(s))
            msg = s.value.decode() if s.value else f"CUresult {rc}"
            raise RollkvError(f"{name} failed: {msg}")

    def init(self, ordinal: int = 0) -> None:
        self._check("cuInit", self.lib.cuInit(0))
        self._check("cuDeviceGet", self.lib.cuDeviceGet(ctypes.byref(self.dev), ordinal))
        self._check("cuDevicePrimaryCtxRetain",
                    self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(self.ctx), self.dev))
        self._check("cuCtxSetCurrent", self.lib.cuCtxSetCurrent(self.ctx))

    def mem_info(self) -> tuple[int, int]:
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        self._check("cuMemGetInfo", self.lib.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)))
        return free.value, total.value

    def alloc(self, size: int) -> bool:
        p = ctypes.c_uint64()
        rc = self.lib.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(size))
        if rc != 0:
            return False
        self.ptrs.append(p.value)
        return True

    def free_all(self) -> None:
        while self.ptrs:
            self.lib.cuMemFree_v2(ctypes.c_uint64(self.ptrs.pop()))
        if self.ctx:
            self.lib.cuDevicePrimaryCtxRelease_v2(self.dev)
            self.ctx = ctypes.c_void_p()


def hold(drv: Any, leave_free: int, slack: int = 64 * MiB) -> int:
    """Allocate until free <= leave_free + slack; returns bytes held. Works with a fake driver."""
    held = 0
    for _ in range(100000):
        free, _total = drv.mem_info()
        excess = free - leave_free
        if excess <= slack:
            break
        size = min(CHUNK, excess) // GRAN * GRAN
        if size <= 0:
            break
        if not drv.alloc(size):
            # fragmentation or a race: try smaller pieces, give up below the granularity
            size //= 2
            while size >= GRAN and not drv.alloc(size // GRAN * GRAN):
                size //= 2
            if size < GRAN:
                break
            size = size // GRAN * GRAN
        held += size
    return held


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rollkv_dist.ballast", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--leave-free", type=int, required=True, metavar="MiB")
    ap.add_argument("--device", type=int, default=0, help="CUDA ordinal (after CUDA_VISIBLE_DEVICES)")
    ap.add_argument("--watch-stdin", action="store_true", help="also exit when stdin closes")
    a = ap.parse_args(argv)
    stop = threading.Event()

    def on_signal(_sig: int, _frm: Any) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    drv = CudaDriver()
    try:
        drv.init(a.device)
        held = hold(drv, a.leave_free * MiB)
        free, total = drv.mem_info()
        print(f"rollkv-ballast: ready held={held // MiB} MiB free={free // MiB} MiB total={total // MiB} MiB",
              flush=True)
        while not stop.is_set():
            if a.watch_stdin:
                r, _, _ = select.select([sys.stdin], [], [], 0.5)
                if r and not sys.stdin.read(1):
                    break
            else:
                stop.wait(0.5)
    finally:
        drv.free_all()
    print("rollkv-ballast: released", flush=True)
    return 0


class Ballast:
    """Context manager: start the ballast child, wait for its ready line, kill it on exit."""

    def __init__(self, leave_free_mib: int, env: dict[str, str] | None = None, device: int = 0,
                 timeout: float = 180.0, log_path: str | os.PathLike[str] | None = None):
        self.leave_free_mib = leave_free_mib
        self.env = env
        self.device = device
        self.timeout = timeout
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.held_mib = self.free_mib = self.total_mib = None
        self.lines: list[str] = []

    def command(self) -> list[str]:
        return [sys.executable, "-m", "rollkv_dist.ballast", "--leave-free", str(self.leave_free_mib),
                "--device", str(self.device), "--watch-stdin"]

    def __enter__(self) -> Ballast:
        env = dict(os.environ if self.env is None else self.env)
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.proc = proc_mod.popen(self.command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + self.timeout
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        pending = b""
        try:
            while True:
                if time.monotonic() > deadline:
                    raise RollkvError(f"ballast not ready after {self.timeout:.0f} s: {''.join(self.lines)[-1000:]}")
                # raw reads: a buffered readline() could hold the ready line while select() waits
                r, _, _ = select.select([fd], [], [], 0.5)
                if not r:
                    if self.proc.poll() is not None and not pending:
                        raise RollkvError(f"ballast exited ({self.proc.returncode}): {''.join(self.lines)[-1000:]}")
                    continue
                chunk = os.read(fd, 65536)
                if not chunk:
                    self.proc.wait(timeout=10)
                    if pending:
                        self.lines.append(pending.decode(errors="replace"))
                    raise RollkvError(f"ballast exited ({self.proc.returncode}): {''.join(self.lines)[-1000:]}")
                pending += chunk
                ready = False
                while b"\n" in pending:
                    line, pending = pending.split(b"\n", 1)
                    text = line.decode(errors="replace") + "\n"
                    self.lines.append(text)
                    m = READY_RE.search(text)
                    if m:
                        self.held_mib, self.free_mib, self.total_mib = (int(x) for x in m.groups())
                        ready = True
                        break
                if ready:
                    if pending:
                        self.lines.append(pending.decode(errors="replace"))
                    break
        except BaseException:
            self._kill()
            raise
        return self

    def _kill(self) -> None:
        if self.proc is not None:
            proc_mod.kill_group(self.proc, grace=15.0)
        self._save()

    def _save(self) -> None:
        if self.proc is not None and self.proc.stdout is not None:
            try:
                rest = self.proc.stdout.read() if self.proc.poll() is not None else b""
            except (OSError, ValueError):
                rest = b""
            if rest:
                self.lines.append(rest.decode(errors="replace"))
        if self.log_path:
            with open(self.log_path, "w") as f:
                f.write("".join(self.lines))

    def __exit__(self, *exc: Any) -> None:
        self._kill()


if __name__ == "__main__":
    raise SystemExit(main())
