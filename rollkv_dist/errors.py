"""Error types of the rollkv tool. Each carries the exit code the CLI returns.

Messages name the cause and what to change.
"""

from __future__ import annotations


class RollkvError(Exception):
    """Base class; exit code 1."""

    exit_code = 1


class UsageError(RollkvError):
    """Bad command-line input or options."""

    exit_code = 2


class FetchError(RollkvError):
    """The upstream sdist (or a model package) could not be fetched."""

    exit_code = 3


class HashMismatchError(FetchError):
    """A download did not match its pinned sha256."""

    exit_code = 4


class PatchError(RollkvError):
    """A patch did not apply, or the result does not match the manifest."""

    exit_code = 5


class TargetError(RollkvError):
    """The target directory is not usable (not empty, not writable, disk full)."""

    exit_code = 6


class BuildError(RollkvError):
    """Configuring, building or installing failed."""

    exit_code = 7


class NoGPUError(RollkvError):
    """No NVIDIA GPU could be used; the message carries NVML's reason."""

    exit_code = 8


class GateFailure(RollkvError):
    """At least one GPU gate failed."""

    exit_code = 9


class LogParseError(RollkvError):
    """A line of the engine's output mentions a field rollkv reads but does not have its format
    (or a number in it makes no sense); the message names the line. The gates fail on it rather
    than read the field as 0 or missing."""

    exit_code = 10
