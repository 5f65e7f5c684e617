"""Error types of the rollkv tool. Each carries the exit code the CLI returns.

Messages name the cause and what to change.
"""

from __future__ import annotations


class RollkvError(Exception):
    """Base class; exit code 1. A subclass names its own: `class X(RollkvError, code=N)`."""

    exit_code = 1

    def __init_subclass__(cls, code: int | None = None, **kw: object) -> None:
        super().__init_subclass__(**kw)
        if code is not None:
            cls.exit_code = code


class UsageError(RollkvError, code=2):
    """Bad command-line input or options."""


class FetchError(RollkvError, code=3):
    """The upstream sdist (or a model package) could not be fetched."""


class HashMismatchError(FetchError, code=4):
    """A download did not match its pinned sha256."""


class PatchError(RollkvError, code=5):
    """A patch did not apply, or the result does not match the manifest."""


class TargetError(RollkvError, code=6):
    """The target directory is not usable (not empty, not writable, disk full)."""


class BuildError(RollkvError, code=7):
    """Configuring, building or installing failed."""


class NoGPUError(RollkvError, code=8):
    """No NVIDIA GPU could be used; the message carries NVML's reason."""


class GateFailure(RollkvError, code=9):
    """At least one GPU gate failed."""


class LogParseError(RollkvError, code=10):
    """A line of the engine's output mentions a field rollkv reads but does not have its format
    (or a number in it makes no sense); the message names the line. The gates fail on it rather
    than read the field as 0 or missing."""


class ReportFormatError(RollkvError, code=11):
    """A gate report's rows are not in the format this rollkv reads (a required field missing, a field it
    does not know, a value of the wrong kind); the message names the row type and the field."""
