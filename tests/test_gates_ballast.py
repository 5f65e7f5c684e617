"""The ballast's allocation loop (fake driver) and its process handling (fake child)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from rollkv_dist import ballast
from rollkv_dist.errors import NoGPUError, RollkvError

MiB = ballast.MiB


class FakeDriver:
    def __init__(self, free_mib, total_mib=143771, max_alloc_mib=None):
        self.free = free_mib * MiB
        self.total = total_mib * MiB
        self.max_alloc = None if max_alloc_mib is None else max_alloc_mib * MiB
        self.allocs = []

    def mem_info(self):
        return self.free, self.total

    def alloc(self, size):
        if size > self.free or (self.max_alloc and size > self.max_alloc):
            return False
        self.free -= size
        self.allocs.append(size)
        return True


def test_hold_leaves_the_requested_free_memory():
    d = FakeDriver(140000)
    held = ballast.hold(d, 90000 * MiB)
    assert 90000 * MiB <= d.free <= 90000 * MiB + 64 * MiB
    assert held == sum(d.allocs) and all(a % ballast.GRAN == 0 for a in d.allocs)
    assert max(d.allocs) <= ballast.CHUNK


def test_hold_with_fragmentation_uses_smaller_pieces():
    d = FakeDriver(20000, max_alloc_mib=300)
    ballast.hold(d, 5000 * MiB)
    assert d.free <= 5000 * MiB + 64 * MiB
    assert max(d.allocs) <= 300 * MiB


def test_hold_when_already_below_target_holds_nothing():
    d = FakeDriver(8000)
    assert ballast.hold(d, 90000 * MiB) == 0 and d.allocs == []


def test_missing_libcuda_is_a_no_gpu_error():
    with pytest.raises(NoGPUError, match="cannot load"):
        ballast.CudaDriver("libcuda-does-not-exist.so.1")


class FakeBallast(ballast.Ballast):
    def __init__(self, script, **kw):
        super().__init__(1000, **kw)
        self.script = script

    def command(self):
        return [sys.executable, "-c", self.script]


# both lines in one write: a reader that select()s on a buffered pipe would miss the second
READY = ("import subprocess, sys, time\n"
         "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
         "sys.stdout.write('child %d\\nrollkv-ballast: ready held=52000 MiB free=90012 MiB total=143771 MiB\\n'"
         " % c.pid)\n"
         "sys.stdout.flush()\n"
         "time.sleep(120)\n")


def _running(pid):
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


def test_ballast_context_manager_kills_its_group(tmp_path):
    log = tmp_path / "ballast.log"
    with FakeBallast(READY, log_path=log, timeout=20) as b:
        assert (b.held_mib, b.free_mib, b.total_mib) == (52000, 90012, 143771)
        child = int(b.lines[0].split()[1])
        assert _running(b.proc.pid) and _running(child)
    time.sleep(0.2)
    assert not _running(b.proc.pid) and not _running(child)
    assert "ready held=52000" in log.read_text()


def test_ballast_that_dies_raises():
    with pytest.raises(RollkvError, match="ballast exited"):
        with FakeBallast("import sys; print('cuInit failed: no device'); sys.exit(3)"):
            pass


def test_ballast_not_ready_in_time_is_killed():
    b = FakeBallast("import time; time.sleep(60)", timeout=1.0)
    with pytest.raises(RollkvError, match="not ready"):
        b.__enter__()
    assert b.proc.poll() is not None


def test_ballast_group_is_registered_for_the_nothing_left_check():
    from rollkv_dist import proc

    with FakeBallast(READY, timeout=20) as b:
        assert b.proc.pid in proc.STARTED_GROUPS
        assert proc.group_alive(b.proc.pid)
    assert not proc.group_alive(b.proc.pid)
