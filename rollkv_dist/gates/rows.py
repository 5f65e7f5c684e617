"""The result rows of the speed, curve and resident-ab gates: one definition that the gates write and that
every reader of their reports (the gates' own Markdown, `rollkv docs`) reads.

A gate keeps its rows as these dataclasses in GateResult.results. The report holds their JSON (`to_json`, via
`jsonable` over the whole results), and a reader parses it back with `from_json`, so a field is named once:
a row field the JSON lacks reads as None (a report written before the field existed); a JSON key the row
does not know, or a missing field that has no default, is a ReportFormatError naming the row and the key.
The tail-staging pair is `after`/`before` in Python and the staging values `auto`/`off` in the JSON (the
llama-bench `-kts` values the reports have always been keyed by).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, TypeVar

from rollkv_dist.errors import ReportFormatError
from rollkv_dist.gates import logparse

R = TypeVar("R", bound="Row")
_MISSING = dataclasses.MISSING


def nested(parse: Callable[[Any], Any], *, key: str | None = None, many: bool = False) -> Any:
    """A field holding another row (or a list of them: many), parsed from JSON by `parse`; `key`: its JSON name
    where it differs from the attribute's."""
    meta = {"parse": parse, "key": key, "many": many}
    return field(default_factory=list, metadata=meta) if many else field(default=None, metadata=meta)


def key_of(f: dataclasses.Field) -> str:
    return f.metadata.get("key") or f.name


def checked_object(name: str, d: Any, known: set[str]) -> Mapping[str, Any]:
    """d as the JSON object of a `name`, whose keys are all among `known` (a ReportFormatError otherwise)."""
    if not isinstance(d, Mapping):
        raise ReportFormatError(f"{name}: expected an object, got {type(d).__name__}")
    extra = sorted(set(d) - known)
    if extra:
        raise ReportFormatError(f"{name}: unknown field(s) {', '.join(extra)}")
    return d


def window_from_json(d: Any) -> logparse.Window:
    """A logparse.Window from its JSON (asdict); a field an older report lacks reads as None."""
    known = {f.name for f in fields(logparse.Window)}
    d = checked_object("Window", d, known)
    return logparse.Window(**{k: d.get(k) for k in known})


def jsonable(value: Any) -> Any:
    """`value` as JSON data: rows by their to_json, other dataclasses by asdict, containers element-wise."""
    if isinstance(value, Row):
        return value.to_json()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, Mapping):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


@dataclass(kw_only=True)
class Row:
    """Base of the result rows: JSON in and out, one name per field. DERIVED: keys that older reports carry
    and that are computed from the row's fields, read past rather than refused."""

    DERIVED: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def from_json(cls: type[R], d: Any) -> R:
        fs = fields(cls)
        d = checked_object(cls.__name__, d, {key_of(f) for f in fs} | cls.DERIVED)
        kw: dict[str, Any] = {}
        for f in fs:
            k = key_of(f)
            if k not in d:
                if f.default is _MISSING and f.default_factory is _MISSING:
                    raise ReportFormatError(f"{cls.__name__}: required field {k!r} missing")
                continue
            v, parse = d[k], f.metadata.get("parse")
            if parse is not None and v is not None:
                v = [parse(x) for x in v] if f.metadata.get("many") else parse(v)
            kw[f.name] = v
        return cls(**kw)

    @classmethod
    def maybe(cls: type[R], d: Any) -> R | None:
        return None if d is None else cls.from_json(d)

    def to_json(self) -> dict[str, Any]:
        return {key_of(f): jsonable(getattr(self, f.name)) for f in fields(self)}


# ----------------------------------------------------------------------------- speed and curve


@dataclass(kw_only=True)
class Rates(Row):
    """Decode and prefill t/s of a tg and a pp llama-bench row (the median of each row's repetitions,
    tail.TPS_STATISTIC) and the repetitions themselves; None where that test did not run."""

    decode_tps: float | None = None
    decode_samples_ts: list[float] | None = None
    prefill_tps: float | None = None
    prefill_samples_ts: list[float] | None = None

    @classmethod
    def of(cls, tg: logparse.BenchRow | None, pp: logparse.BenchRow | None) -> Rates:
        return cls(decode_tps=None if tg is None else tg.median_ts, decode_samples_ts=None if tg is None else tg.samples_ts,
                   prefill_tps=None if pp is None else pp.median_ts,
                   prefill_samples_ts=None if pp is None else pp.samples_ts)


@dataclass(kw_only=True)
class Staged(Rates):
    """One tail staging's measurement (tail.by_staging): decode and prefill t/s with each test's own window
    (decode: depth + n_gen cells, prefill: depth + n_prompt), its host tail, the share of the window's cells
    in the tail (decode) and of the cells the prefill uses, the tail MiB a decoded token reads and the
    effective tail GB/s. prefill_over_resident: the curve's before points."""

    # the curve plot of reports before 2026-12-07 wrote 100 x prefill_tail_fraction into its points
    DERIVED: ClassVar[frozenset[str]] = frozenset({"prefill_tail_pct"})

    window: logparse.Window | None = nested(window_from_json)
    host_tail_mib: float | None = None
    tail_fraction: float | None = None
    prefill_window: logparse.Window | None = nested(window_from_json)
    prefill_host_tail_mib: float | None = None
    prefill_tail_fraction: float | None = None
    tail_read_mib_per_token: float | None = None
    effective_tail_gbps: float | None = None
    prefill_over_resident: float | None = None


@dataclass(kw_only=True)
class SpeedWindow(Row):
    """A speed row's window run: its --vram-target and the stagings it compared side by side."""

    vram_target: int | None = None
    stagings: list[str] = field(default_factory=list)
    after: Staged | None = nested(Staged.from_json, key="auto")
    before: Staged | None = nested(Staged.from_json, key="off")


@dataclass(kw_only=True)
class SpeedRatios(Row):
    prefill_after_over_resident: float | None = None
    prefill_after_over_nkvo: float | None = None
    decode_after_over_link_bound: float | None = None
    decode_after_over_overlap_bound: float | None = None
    decode_after_over_nkvo: float | None = None
    prefill_before_over_resident: float | None = None
    prefill_before_over_nkvo: float | None = None
    prefill_after_over_before: float | None = None
    decode_before_over_link_bound: float | None = None
    decode_after_over_before: float | None = None


@dataclass(kw_only=True)
class SpeedRow(Row):
    """One depth and K/V type of the speed gate: resident, the window run, -nkvo, bounds and ratios."""

    depth: int
    kv_type: str
    resident: Rates | None = nested(Rates.from_json)
    kv_mib: float | None = None
    kv_mib_per_tensor: float | None = None
    kv_tensors: int | None = None
    kv_mib_per_cell: float | None = None
    window: SpeedWindow | None = nested(SpeedWindow.from_json)
    nkvo: Rates | None = nested(Rates.from_json)
    link_probe: Staged | None = nested(Staged.from_json)
    link_bound_decode_tps: float | None = None
    overlap_bound_decode_tps: float | None = None
    ratios: SpeedRatios | None = nested(SpeedRatios.from_json)

    @property
    def after(self) -> Staged | None:
        return None if self.window is None else self.window.after

    @property
    def before(self) -> Staged | None:
        return None if self.window is None else self.window.before


@dataclass(kw_only=True)
class UbatchPoint(Row):
    n_ubatch: int
    fixed_mib: float | None = None
    vram_target: int | None = None
    window: logparse.Window | None = nested(window_from_json)
    tail_fraction: float | None = None
    prefill_tps: float | None = None
    rc: int | None = None
    compute_mib: float | None = None
    prefill_samples_ts: list[float] | None = None


@dataclass(kw_only=True)
class UbatchSweep(Row):
    """Window prefill per ubatch at the speed run's window C (speed._ubatch_sweep)."""

    depth: int
    n_prompt: int
    n_batch: int
    kv_type: str
    staging: str
    cells_resident: int
    points: list[UbatchPoint] = nested(UbatchPoint.from_json, many=True)


@dataclass(kw_only=True)
class CurveResident(Rates):
    kv_mib: float | None = None
    kv_mib_per_cell: float | None = None
    model_mib: float | None = None
    compute_mib: float | None = None


@dataclass(kw_only=True)
class CurvePoint(Staged):
    """One --vram-target of the curve: the primary staging's measurement (its own fields), the before
    staging's beside it where both ran, and the decode lines at its tail."""

    vram_target: int
    fraction: float | None = None
    rc: int | None = None
    before: Staged | None = nested(Staged.from_json, key="off")
    limit_decode_tps: float | None = None
    decode_over_limit: float | None = None
    overlap_decode_tps: float | None = None


@dataclass(kw_only=True)
class CurveLinkProbe(Staged):
    """The curve's decode-only -kts off run that measures the link where no point ran before."""

    vram_target: int
    fraction: float | None = None
    fixed_mib: float | None = None


# ----------------------------------------------------------------------------- resident-ab


@dataclass(kw_only=True)
class Pooled(Row):
    n: int
    mean: float
    stdev: float

    @classmethod
    def of(cls, samples: list[float]) -> Pooled:
        n = len(samples)
        return cls(n=n, mean=statistics.fmean(samples), stdev=statistics.stdev(samples) if n > 1 else 0.0)


@dataclass(kw_only=True)
class AbRow(Row):
    """One test and depth of resident-ab: the series' pooled samples against upstream's, the difference,
    its noise band and the verdict."""

    test: str
    depth: int
    series: Pooled = nested(Pooled.from_json)
    upstream: Pooled = nested(Pooled.from_json)
    diff_tps: float
    diff_pct: float
    noise_band_tps: float
    sigma_diff_tps: float
    within_noise: bool


# ----------------------------------------------------------------------------- speed, all GPUs


@dataclass(kw_only=True)
class AloneRun(Row):
    """One GPU alone in the all-GPU speed run: resident, then window with the GPUs' total tail."""

    gpu: str
    index: int
    resident_tps: float | None = None
    vram_target: int | None = None
    window_tps: float | None = None
    window: logparse.Window | None = nested(window_from_json)
    tail_read_mib_per_token: float | None = None
    effective_gbps: float | None = None


@dataclass(kw_only=True)
class SplitRow(Row):
    """One depth of the all-GPU speed run (speed_split.py). devices: sizing.device_records of the window."""

    depth: int
    resident_tps: float | None = None
    kv_mib: dict[str, float] | None = None
    vram_target: int | None = None
    window_tps: float | None = None
    devices: list[dict[str, Any]] | None = None
    tail_read_mib_per_token: dict[str, float] | None = None
    tail_read_total_mib: float | None = None
    effective_gbps: float | None = None
    one_gpu: list[AloneRun] | None = nested(AloneRun.from_json, many=True)
    per_device_gbps: dict[str, float | None] | None = None
    sum_gbps: float | None = None
    together_over_sum: float | None = None
    links_add_up: bool | None = None
    bound_tps: float | None = None
    window_over_bound: float | None = None
    window_over_one_gpu: float | None = None


@dataclass(kw_only=True)
class SplitRun(Row):
    gpus: list[str]
    kv_type: str
    staging: str
    n_gen: int
    add_up_share: float
    rows: list[SplitRow] = nested(SplitRow.from_json, many=True)
