"""Console output of the rollkv tool: timed steps, notes and a small progress display.

Everything goes to stderr so that stdout stays free for machine-readable output.
Use the module-level helpers::

    from rollkv_dist import log

    with log.step("Building llama.cpp"):
        ...                      # prints "==> Building llama.cpp" ... "    done in 12.3 s"

    bar = log.progress("Downloading", total=None, unit="bytes")
    bar.update(1024)
    bar.finish()
"""

from __future__ import annotations

import contextlib
import re
import sys
import time
from collections.abc import Iterator
from typing import TextIO

_NINJA_RE = re.compile(r"^\[(\d+)/(\d+)\]\s")


def format_bytes(n: float) -> str:
    """Human-readable size: 512 B, 1.5 KiB, 76.6 MiB, 2.0 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_seconds(s: float) -> str:
    if s < 60:
        return f"{s:.1f} s"
    m, sec = divmod(s, 60)
    return f"{int(m)} min {sec:04.1f} s"


def parse_ninja_progress(line: str) -> tuple[int, int] | None:
    """(done, total) from a ninja status line such as ``[12/218] Building CXX object ...``."""
    m = _NINJA_RE.match(line)
    if not m:
        return None
    return int(m.group(1)), int(m.group(2))


class Progress:
    """A one-line progress display.

    On a terminal the line is redrawn in place; elsewhere (CI logs) a line is printed
    at every 10 % step or every 30 s, whichever comes first, so logs stay short.
    """

    def __init__(
        self,
        logger: Logger,
        label: str,
        total: float | None = None,
        unit: str = "steps",
    ) -> None:
        self._logger = logger
        self.label = label
        self.total = total
        self.unit = unit
        self.done: float = 0
        self._last_decile = -1
        self._last_print = 0.0
        self._finished = False
        self._drawn = False
        self._t0 = time.monotonic()

    def _render(self) -> str:
        if self.unit == "bytes":
            text = format_bytes(self.done)
            if self.total:
                text += f" / {format_bytes(self.total)}"
        else:
            text = f"{int(self.done)}"
            if self.total:
                text += f"/{int(self.total)}"
        if self.total:
            text += f" ({100.0 * self.done / self.total:.0f} %)"
        return f"    {self.label}: {text}, {format_seconds(time.monotonic() - self._t0)}"

    def update(self, done: float, total: float | None = None) -> None:
        self.done = done
        if total is not None:
            self.total = total
        stream = self._logger.stream
        now = time.monotonic()
        if self._logger.is_tty:
            stream.write("\r\033[K" + self._render())
            stream.flush()
            self._drawn = True
            return
        decile = int(10 * self.done / self.total) if self.total else -1
        if decile != self._last_decile or now - self._last_print >= 30:
            self._last_decile = decile
            self._last_print = now
            stream.write(self._render() + "\n")
            stream.flush()

    def finish(self) -> None:
        if self._finished:
            return
        self._finished = True
        if self._drawn:
            self._logger.stream.write("\n")
            self._logger.stream.flush()


class Logger:
    def __init__(self, stream: TextIO | None = None, verbose: bool = False) -> None:
        self._stream = stream
        self.verbose = verbose
        self._depth = 0

    @property
    def stream(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stderr

    @property
    def is_tty(self) -> bool:
        try:
            return self.stream.isatty()
        except (AttributeError, ValueError):
            return False

    def _write(self, text: str) -> None:
        self.stream.write(text + "\n")
        self.stream.flush()

    def info(self, msg: str) -> None:
        self._write(("    " * self._depth) + msg)

    def warn(self, msg: str) -> None:
        self._write(("    " * self._depth) + "warning: " + msg)

    def detail(self, msg: str) -> None:
        if self.verbose:
            self.info(msg)

    @contextlib.contextmanager
    def step(self, title: str) -> Iterator[None]:
        indent = "    " * self._depth
        self._write(f"{indent}==> {title}")
        start = time.monotonic()
        self._depth += 1
        try:
            yield
        except BaseException:
            self._depth -= 1
            self._write(f"{indent}    failed after {format_seconds(time.monotonic() - start)}")
            raise
        self._depth -= 1
        self._write(f"{indent}    done in {format_seconds(time.monotonic() - start)}")

    def progress(self, label: str, total: float | None = None, unit: str = "steps") -> Progress:
        return Progress(self, label, total, unit)


_default = Logger()


def configure(stream: TextIO | None = None, verbose: bool = False) -> Logger:
    """Reset the default logger (the CLI calls this once; tests point it at a buffer)."""
    global _default
    _default = Logger(stream=stream, verbose=verbose)
    return _default


def step(title: str) -> contextlib.AbstractContextManager[None]:
    return _default.step(title)


def info(msg: str) -> None:
    _default.info(msg)


def warn(msg: str) -> None:
    _default.warn(msg)


def detail(msg: str) -> None:
    _default.detail(msg)


def progress(label: str, total: float | None = None, unit: str = "steps") -> Progress:
    return _default.progress(label, total, unit)
