"""--vram-target for a wanted window, from what the engine logged it keeps on each device.

The sizer (patch 0006) keeps, on every device, the model's share, the KV of caches placed before,
the compute reserve (measured by 0089's pass 1 + its safety, or --kv-compute-reserve) and a margin
before any KV cell, and logs all four: in its budget line (every window-mode cache on a GPU logs
one, even one that fits) and, when nothing is left, in the "no device memory left for the KV
window" error. A window-mode run at `--vram-target 1` (a probe) fails right there, before any
depth fill or prompt. The engine stops at the first device it cannot size, so for the devices
after it the parts come from the lines logged before sizing: the model buffer, 0089's pass 2
reserve (one per device) and the margin (one for all devices).

So the gates never copy the engine's numbers: a target is the logged fixed part + the KV the
device should hold + one 2 MiB granule per K/V tensor (the sizer sets that aside for rounding each
tensor's segment to the VMM granularity). The logged MiB are rounded down, so such a target leaves
a few MiB less than asked; the sizer rounds each device segment up to whole granules (and logs the
cells that hold), so a C that was logged before comes back exactly. With a draft (patch 0096) the
main context's budget is the target less the draft's part, which the engine logs before the main
context: it is part of the fixed part.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

from rollkv_dist.errors import LogParseError, RollkvError
from rollkv_dist.gates import logparse

GRANULE_MIB = 2  # CUDA VMM granularity of the window's segments on the GPUs rollkv targets


@dataclass(frozen=True)
class Fixed:
    """What the engine keeps on one device before any KV cell of the cache it sizes (MiB)."""

    device: str
    model: float
    other_kv: float
    compute_reserve: float
    margin: float
    source: str  # the line it was read from
    draft: float = 0.0  # patch 0096: the draft's part of the target (-md, MTP), taken before the main context

    @property
    def mib(self) -> float:
        return self.model + self.other_kv + self.compute_reserve + self.margin + self.draft


def fixed_parts(log: logparse.LlamaLog) -> dict[str, Fixed]:
    """Per device, the fixed part the engine logged (the last budget line of a device wins: an iSWA
    model's main cache is sized after its SWA cache, llama-bench's last context after the others)."""
    out: dict[str, Fixed] = {}
    for b in log.budgets:
        out[b["device"]] = Fixed(b["device"], b["model"], b["other_kv"], b["compute_reserve"], b["margin"],
                                 "budget line")
    nw = log.no_window
    if nw is not None and nw["device"] not in out:
        out[nw["device"]] = Fixed(nw["device"], nw["model"], 0.0, nw["compute_reserve"], nw["margin"],
                                  "no-window line")
    margins = {f.margin for f in out.values()}
    if len(margins) == 1:  # one margin for every device (llama_kv_residency.margin)
        margin = margins.pop()
        r = log.reserve
        for dev, model in log.model_buffers.items():
            if dev in out or not dev.startswith("CUDA"):
                continue
            reserve = (r.by_device.get(dev) or {}).get("reserve_mib", r.fixed_mib)
            if reserve is not None:
                out[dev] = Fixed(dev, model, 0.0, reserve, margin, "model buffer, pass 2 reserve and margin lines")
    for dev, part in log.draft_room.items():  # the main context's budget is the target less the draft's part
        if dev in out:
            out[dev] = replace(out[dev], draft=float(part))
    return out


def require_fixed(log: logparse.LlamaLog, devices: list[str]) -> dict[str, Fixed]:
    """fixed_parts for `devices`, or a LogParseError naming the lines that are missing (never a
    guessed or copied number)."""
    parts = fixed_parts(log)
    missing = [d for d in devices if d not in parts]
    if missing:
        raise LogParseError(f"{log.source}: the engine logged no fixed part for {', '.join(missing)} (no "
                            f"`<device>: free ... -> window budget` line, no `no device memory left for the KV window` "
                            f"line, nor model buffer + pass 2 reserve lines), so the gate cannot size its window")
    return {d: parts[d] for d in devices}


def vram_target(fixed: Fixed, device_kv_mib: float, n_kv_tensors: int) -> int:
    """The --vram-target (MiB) that leaves `device_kv_mib` of KV on the device."""
    return max(1, int(fixed.mib + max(0.0, device_kv_mib) + n_kv_tensors * GRANULE_MIB))


@dataclass(frozen=True)
class DeviceKV:
    """One device's share of a cache, from a resident run's log."""

    device: str
    kv_mib: float  # the device's KV (all its caches)
    n_tensors: int  # K/V tensors on the device (2 per layer)


def devices_of(log: logparse.LlamaLog) -> list[DeviceKV]:
    """The GPUs that hold KV in a run (CUDA0, CUDA1, ... in order), each with its KV MiB and its K/V
    tensors (2 per layer of the largest cache, split like its KV)."""
    kv = {d: m for d, m in log.kv_buffers.items() if d.startswith("CUDA")}
    if not kv and log.stand_in:  # the CPU standing in for a GPU (patch 0092, tests): its KV is the window's
        kv = {d: m for d, m in log.kv_buffers.items() if d == "CPU"}
    if not kv:
        log.require_mib("kv")  # the LogParseError naming the missing line
    layers = max(log.kv_caches, key=lambda c: c[1])[2] if log.kv_caches else 0
    total = sum(kv.values())
    return [DeviceKV(d, kv[d], round(2 * layers * kv[d] / total) if total else 0)
            for d in sorted(kv, key=lambda x: int(x[4:]) if x[4:].isdigit() else 0)]


def targets(fixed: dict[str, Fixed], devices: list[DeviceKV], device_kv_mib: float) -> list[int]:
    """Per device, the --vram-target that keeps `device_kv_mib` of KV on the devices together, split
    like their KV."""
    total = sum(d.kv_mib for d in devices) or 1.0
    return [vram_target(fixed[d.device], device_kv_mib * d.kv_mib / total, d.n_tensors) for d in devices]


def target_arg(values: list[int]) -> str:
    """--vram-target's value: one number, or the comma list of one per device."""
    return ",".join(str(v) for v in values)


def device_records(log: logparse.LlamaLog, n_cells: int | None = None) -> list[dict[str, object]]:
    """One record per device of the main cache (or of the context for n_cells): its window (C of
    the cells), host tail, device MiB, the compute reserve it was sized with (0089's pass 2, or the
    fixed one) and its budget line's numbers. The reports of all-GPU runs keep these."""
    main = log.window if n_cells is None else log.window_for(n_cells)
    if main is None:
        return []
    lines = [w for w in log.windows if w.kv_size == main.kv_size]
    budgets = {b["device"]: b for b in log.budgets}
    r = log.reserve
    out: list[dict[str, object]] = []
    for w in lines:
        dev = w.device or "CUDA0"
        if any(x["device"] == dev for x in out):
            continue  # llama-bench: a second context of the same size
        reserve = (r.by_device.get(dev) or {}).get("reserve_mib", r.fixed_mib)
        out.append({"device": dev, "cells_resident": w.cells_resident, "kv_size": w.kv_size,
                    "fully_resident": w.fully_resident, "device_mib": w.device_mib, "host_tail_mib": w.host_tail_mib,
                    "tail_fraction": round(w.tail_fraction, 4), "compute_reserve_mib": reserve,
                    "budget": budgets.get(dev)})
    return out


def device_table(records: list[dict[str, object]]) -> list[str]:
    """The per-device sizing of a run as Markdown: one line per device."""
    out = ["| device | window (C / cells) | tail % | device MiB | host tail MiB | compute reserve MiB | budget MiB |",
           "|---|---|---|---|---|---|---|"]
    for d in records:
        b = d.get("budget") or {}
        out.append(f"| {d['device']} | {d['cells_resident']} / {d['kv_size']} | {100 * float(d['tail_fraction']):.1f} | "
                   f"{float(d['device_mib']):.2f} | {float(d['host_tail_mib']):.2f} | {d['compute_reserve_mib']} | "
                   f"{b.get('budget', '-')} |")
    return out


# ----------------------------------------------------------------------------- finding a --vram-target

class WindowRefused(RollkvError):
    """Window mode was refused for a reason no --vram-target can change (no GPU, flags, backend)."""


def window_outcome(log: logparse.LlamaLog, ok: bool, n_cells: int | None = None
                   ) -> tuple[bool, logparse.Window | None]:
    """(ok, window) for search_vram_target from a run's log; raises WindowRefused.

    window: the main cache's (on several GPUs: its lines combined, LlamaLog.caches), or with n_cells
    the one of the context sized for n_cells (llama-bench logs one context per test)."""
    if log.window_refused:
        raise WindowRefused(f"window mode refused: {log.window_refused}")
    return ok, (log.window if n_cells is None else log.window_for(n_cells))


def probe_fixed(log: logparse.LlamaLog, devices: list[str]) -> dict[str, Fixed]:
    """The engine's fixed part per device from a `--vram-target 1` probe's log (sizing.py); raises
    WindowRefused for a refusal no target can change, LogParseError when the lines are missing."""
    if log.window_refused:
        raise WindowRefused(f"window mode refused: {log.window_refused}")
    return require_fixed(log, devices)


def search_vram_target(run: Callable[[int], tuple[Any, ...]], estimate: float,
                       kv_mib: float, lo: float = 0.5, hi: float = 0.97, tries: int = 6,
                       history: list[dict[str, Any]] | None = None) -> tuple[int | None, logparse.Window | None]:
    """Find a --vram-target whose window puts a tail fraction in [lo, hi] of the KV in host memory.

    run(target) -> (booted_ok, window[, hint]). The sizer's own margin is not known here, so start from
    an estimate, correct from the logged window, and bisect once a too-low target (boot failed,
    no window, empty window, tail > hi) and a too-high one (fully resident, tail < lo) are known.
    Steps grow when no bracket exists yet, so small and large KVs both converge.
    """
    mid = (lo + hi) / 2
    t = max(1, int(estimate))
    too_low: int | None = None  # largest target known to give too much tail (or no boot)
    too_high: int | None = None  # smallest target known to give too little tail
    up = down = max(4.0, mid * kv_mib)
    seen: set[int] = set()
    for _ in range(tries):
        seen.add(t)
        out = run(t)
        ok, w = out[0], out[1]
        hint = out[2] if len(out) > 2 else None
        if history is not None:
            history.append({"vram_target": t, "ok": ok, "window": None if w is None else asdict(w)})
        has_tail = ok and w is not None and not w.fully_resident and w.cells_resident > 0
        if has_tail and lo <= w.tail_fraction <= hi:
            return t, w
        if has_tail and w.tail_fraction < lo or (ok and w is not None and w.fully_resident):
            too_high = t if too_high is None else min(too_high, t)
            # window known: move by the missing tail; fully resident: the edge is below by >= mid * KV
            cand = int(t - max(1.0, (mid - w.tail_fraction) * kv_mib)) if has_tail else int(t - down)
            if not has_tail:
                down *= 2
            if too_low is not None and (too_high - too_low > 2 * kv_mib or cand <= too_low):
                cand = (too_low + too_high) // 2
            nt = cand
        else:
            too_low = t if too_low is None else max(too_low, t)
            cand = int(t + max(1.0, (w.tail_fraction - mid) * kv_mib)) if has_tail else int(t + up)
            if not has_tail:
                up *= 2
            if too_high is not None and (too_high - too_low > 2 * kv_mib or cand >= too_high):
                cand = (too_low + too_high + 1) // 2
            nt = cand
        if hint is not None and hint not in seen and (too_high is None or hint < too_high):
            nt = hint  # the engine logged its own model/reserve/margin: no guessing
        nt = max(1, nt)
        if nt in seen or (too_low is not None and too_high is not None and too_high - too_low <= 1):
            break  # the bracket is one MiB wide: granularity leaves no target in [lo, hi]
        t = nt
    return None, None
