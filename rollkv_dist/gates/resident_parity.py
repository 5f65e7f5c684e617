"""resident-parity: window mode with a host tail gives bit-identical logits to resident mode.

Random qwen2-1.5B-shape Q8_0 model, a prompt of ~20k tokens, `llama-logits-dump` resident vs
window. In an all-GPU run (every GPU in one process, layer split) the resident run spans the GPUs
(where it fits, parity holds against it), the window run gets one --vram-target per device, each
device must hold a host tail, and the report keeps each device's window, reserve and tail.
The window's --vram-target is the engine's logged fixed part (a --vram-target 1 probe; sizing.py)
+ the share of the resident run's KV that should stay on the device, so that the host tail holds
>= 50 % of the cells, then verified from the window line (the gate fails when the tail is < 50 %). Compares max |logit difference| (must be 0), greedy
tokens (identical), finiteness. Done for f16 KV and for `-ctk q8_0 -ctv q8_0`.

Per K/V type a second pair, "shift+state", runs both modes with `--kv-shift 512
--state-roundtrip` (patch 0011: after the prompt, sequence 0's state is saved, the memory cleared
and the state restored, then the 512 cells after the first 4 are dropped and the rest shifted
back: a K-shift), the window at the plain pair's --vram-target (no new search), compared the same
way. State I/O and the shift graph touch every cell, host tail included; with q8_0 K the shift
graph casts K to F32 and back. Both dumps' metadata must say the shift and the round trip
happened.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rollkv_dist.gates import logparse
from rollkv_dist.gates.base import Gate, option
from rollkv_dist.gates import sizing
from rollkv_dist.gates.context import (LOG_ARGS, GateContext, GateResult, ensure_random_model, model_option, preflight, run_timeout_option, shape_option)
from rollkv_dist.gates.sizing import probe_fixed, search_vram_target, window_outcome
from rollkv_dist.gates.process import run_logged

NAME = "resident-parity"
BINARIES = ("llama-logits-dump",)
KV_SHIFT = 512  # cells the shift+state pair drops after the first 4 (llama-logits-dump --kv-shift)
SHIFT = "shift+state"

WORDS = ("the of and to in is was for on that with as by at from his her an which are this be had "
         "river mountain window garden engine signal pattern market harbor letter winter summer "
         "station morning evening bridge castle forest village silver copper thunder quiet rapid "
         "ancient modern gentle bright narrow distant hollow golden frozen hidden ").split()


def make_prompt(n_words: int, seed: int = 0) -> str:
    """Deterministic English-like text (~1.1 qwen2 tokens per word)."""
    rng = random.Random(seed)
    out, sent = [], []
    for i in range(n_words):
        sent.append(rng.choice(WORDS))
        if len(sent) >= rng.randint(8, 16) or i == n_words - 1:
            s = " ".join(sent)
            out.append(s[0].upper() + s[1:] + ".")
            sent = []
    return " ".join(out)


def read_dump(prefix: Path) -> tuple[Any, dict[str, Any]]:
    import numpy as np

    meta = json.loads(prefix.with_suffix(".json").read_text())
    arr = np.fromfile(prefix.with_suffix(".f32"), dtype=np.float32)
    n_vocab = int(meta["n_vocab"])
    return arr.reshape(-1, n_vocab), meta


def compare(a_prefix: Path, b_prefix: Path) -> dict[str, Any]:
    import numpy as np

    a, ma = read_dump(a_prefix)
    b, mb = read_dump(b_prefix)
    out: dict[str, Any] = {"rows": [int(a.shape[0]), int(b.shape[0])], "n_vocab": int(a.shape[1]),
                           "n_prompt": [ma.get("n_prompt"), mb.get("n_prompt")],
                           "kv_shift": [ma.get("kv_shift"), mb.get("kv_shift")],
                           "state_roundtrip": [ma.get("state_roundtrip"), mb.get("state_roundtrip")],
                           "tokens_equal": ma.get("tokens") == mb.get("tokens"),
                           "tokens": [ma.get("tokens"), mb.get("tokens")],
                           "finite": bool(np.isfinite(a).all() and np.isfinite(b).all())}
    if a.shape != b.shape:
        out["max_abs_diff"] = None
        out["shape_mismatch"] = [list(a.shape), list(b.shape)]
        return out
    d = np.abs(a.astype(np.float64) - b.astype(np.float64))
    out["max_abs_diff"] = float(d.max()) if d.size else 0.0
    out["n_diff"] = int((d != 0).sum())
    out["first_diff_row"] = None if out["n_diff"] == 0 else int(np.argwhere(d != 0)[0][0])
    return out


def _compare_checks(res: GateResult, tag: str, rp: Path, wp: Path, case: dict[str, Any]) -> dict[str, Any]:
    """Resident dump rp against window dump wp: results into case, the identity checks named `tag: ...`."""
    cmp = compare(rp, wp)
    case["compare"] = {k: v for k, v in cmp.items() if k != "tokens"}
    case["greedy_tokens"] = cmp["tokens"][0]
    res.check(f"{tag}: logits finite", cmp["finite"])
    res.check(f"{tag}: logits identical (max |diff| == 0)", cmp.get("max_abs_diff") == 0.0,
              f"max_abs_diff={cmp.get('max_abs_diff')}, n_diff={cmp.get('n_diff')}, "
              f"first_diff_row={cmp.get('first_diff_row')}")
    res.check(f"{tag}: greedy tokens identical", cmp["tokens_equal"])
    return cmp


@dataclass(frozen=True)
class Options:
    model: str | None = model_option()
    parity_shape: str = shape_option("qwen2-1.5b")
    parity_words: int = option("words of the prompt (~1.1 tokens each)", 18000)
    parity_gen: int = option("greedy tokens generated after the prompt", 16)
    parity_ctx: int = option("context (-c)", 24576)
    parity_mode: str = option("residency mode of the runs with a host tail (auto: the packaged default, which "
                              "takes a window when the --vram-target leaves no room for the whole KV)", "window",
                              choices=("window", "auto"))
    run_timeout: float = run_timeout_option()


def run(ctx: GateContext) -> GateResult:
    res, o = ctx.res, ctx.options
    dump = ctx.bin("llama-logits-dump")
    if not preflight(ctx, res, dump, ("--logits-out", "--kv-shift", "--state-roundtrip")):
        return res
    model = str(o.model or ensure_random_model(ctx, o.parity_shape, "q8_0"))
    n_words, n_gen, n_ctx = o.parity_words, o.parity_gen, o.parity_ctx
    prompt = ctx.work / "prompt.txt"
    prompt.write_text(make_prompt(n_words))
    res.results["model"] = model
    res.results["kv_shift"] = KV_SHIFT
    timeout = o.run_timeout

    for kv in ("f16", "q8_0"):
        common = ["-m", model, "-f", str(prompt), "-n", str(n_gen), "-c", str(n_ctx), "-fa", "on",
                  "-ngl", "99", "--kv-unified", "-ctk", kv, "-ctv", kv, *LOG_ARGS]
        case: dict[str, Any] = {}
        res.results[f"kv_{kv}"] = case
        rp = ctx.work / f"resident-{kv}"
        r = run_logged([dump, *common, "--logits-out", rp, "-krm", "resident"], ctx.work / f"resident-{kv}",
                       timeout, env=ctx.child_env(), result=res)
        rlog = logparse.parse_log(r.log, source=str(r.stdout_path))
        case["resident"] = {"rc": r.rc, "timed_out": r.timed_out, "seconds": round(r.seconds, 1),
                            "model_mib": rlog.model_buffers.get("CUDA0"), "kv_mib": rlog.kv_buffers.get("CUDA0"),
                            "compute_mib": rlog.compute_mib("CUDA0")}
        if not res.check(f"{kv}: resident run succeeds", r.rc == 0, f"rc={r.rc} timed_out={r.timed_out}"):
            continue
        if ctx.split:  # the resident run fits every GPU together: parity holds against it
            case["resident"]["devices"] = {d: {"model_mib": rlog.model_buffers.get(d), "kv_mib": rlog.kv_buffers.get(d),
                                               "compute_mib": rlog.compute_mib(d)}
                                           for d in sorted(rlog.kv_buffers) if d.startswith("CUDA")}
        _auto_fits(ctx, res, dump, kv, common, rp, case, timeout)
        devs = sizing.devices_of(rlog)
        kv_mib = sum(d.kv_mib for d in devs)
        wp = ctx.work / f"window-{kv}"
        attempts: list[dict[str, Any]] = []
        # what the engine keeps on each device before any KV cell: a --vram-target 1 probe logs it
        pp = ctx.work / f"window-{kv}-probe"
        probe = run_logged([dump, *common, "--logits-out", pp, "-krm", "window", "--vram-target", "1"], pp, timeout,
                           env=ctx.child_env(), result=res)
        attempts.append({"vram_target": 1, "probe": True, "rc": probe.rc, "seconds": round(probe.seconds, 1)})
        fixed = probe_fixed(logparse.parse_log(probe.log, source=str(probe.stdout_path)), [d.device for d in devs])
        case["fixed_mib"] = {d: round(f.mib, 2) for d, f in fixed.items()}
        arg_of: dict[int, str] = {}
        logs: dict[int, logparse.LlamaLog] = {}

        def attempt(t: int, kv: str = kv, wp: Path = wp, common: list[str] = common, devs: list = devs,
                    fixed: dict = fixed, attempts: list[dict[str, Any]] = attempts, arg_of: dict = arg_of,
                    logs: dict = logs) -> tuple[bool, logparse.Window | None]:
            """A window run that keeps t MiB of the KV on the device(s)."""
            arg = arg_of[t] = sizing.target_arg(sizing.targets(fixed, devs, t))
            w = run_logged([dump, *common, "--logits-out", wp, "-krm", o.parity_mode, "--vram-target", arg],
                           ctx.work / f"window-{kv}-vt{arg.replace(',', '-')}", timeout, env=ctx.child_env(),
                           result=res)
            wl = logs[t] = logparse.parse_log(w.log, source=str(w.stdout_path))
            attempts.append({"vram_target": int(arg) if arg.isdigit() else arg, "rc": w.rc,
                             "seconds": round(w.seconds, 1)})
            return window_outcome(wl, w.rc == 0)

        t, win = search_vram_target(attempt, (1 - 0.735) * kv_mib, kv_mib, lo=0.5, hi=0.97, tries=6)
        target = None if t is None else arg_of[t]
        case["window_attempts"] = attempts
        case["vram_target"] = None if target is None else int(target) if target.isdigit() else target
        case["window"] = None if win is None else {**win.__dict__, "tail_fraction": round(win.tail_fraction, 4)}
        if not res.check(f"{kv}: window run with host tail >= 50% of the KV",
                         win is not None and win.tail_fraction >= 0.5,
                         f"window={case['window']}, attempts={attempts}"):
            continue
        wl = logs[t]
        over = wl.reserve.overruns(wl.compute_buffers)
        res.check(f"{kv}: the compute buffer allocated after pass 2 is no larger than pass 1 measured",
                  wl.reserve.two_pass and not over,
                  "no two-pass reserve in the window run's log" if not wl.reserve.two_pass else
                  "; ".join(f"{d}: {a:.2f} MiB allocated, {m:.2f} MiB measured" for d, (m, a) in over.items())
                  or "held")
        if ctx.split:
            per = case["devices"] = sizing.device_records(wl)
            res.check(f"{kv}: a host tail on every GPU ({len(devs)})",
                      len(per) == len(devs) and all(not d["fully_resident"] for d in per),
                      "; ".join(f"{d['device']}: {d['cells_resident']} / {d['kv_size']}" for d in per))
        cmp = _compare_checks(res, kv, rp, wp, case)
        res.check(f"{kv}: prompt of ~20k tokens", (cmp["n_prompt"][0] or 0) >= 15000, f"n_prompt={cmp['n_prompt']}")
        case[SHIFT] = _shift_state(ctx, res, dump, kv, common, target, timeout)
    return res


def _auto_fits(ctx: GateContext, res: GateResult, dump: Path, kv: str, common: list[str], rp: Path,
               case: dict[str, Any], timeout: float) -> None:
    """`-krm auto` with no --vram-target, where the whole KV fits: auto must keep it resident and give
    the resident run's logits (the packaged programs default to auto)."""
    ap = ctx.work / f"auto-{kv}"
    a = run_logged([dump, *common, "--logits-out", ap, "-krm", "auto"], ap, timeout, env=ctx.child_env(), result=res)
    aw = logparse.parse_log(a.log, source=str(a.stdout_path)).window
    case["auto_fits"] = {"rc": a.rc, "seconds": round(a.seconds, 1), "window": None if aw is None else asdict(aw)}
    tag = f"{kv} auto (fits)"
    # a host tail always logs its window line; auto that stays resident (a requirement unmet) may log none
    if res.check(f"{tag}: auto runs with no host tail", a.rc == 0 and (aw is None or aw.fully_resident),
                 f"rc={a.rc}, window={case['auto_fits']['window']}"):
        case["auto_fits"]["compare"] = {k: v for k, v in _compare_checks(res, tag, rp, ap, {}).items() if k != "tokens"}


def _shift_state(ctx: GateContext, res: GateResult, dump: Path, kv: str, common: list[str], target: str,
                 timeout: float) -> dict[str, Any]:
    """The shift+state pair of one K/V type: resident and window (at the plain pair's target), both
    with --kv-shift KV_SHIFT --state-roundtrip, compared like the plain pair."""
    tag = f"{kv} {SHIFT}"
    extra = ["--kv-shift", str(KV_SHIFT), "--state-roundtrip"]
    case: dict[str, Any] = {"vram_target": int(target) if target.isdigit() else target}
    runs = {}
    for mode, args in (("resident", ["-krm", "resident"]), ("window", ["-krm", ctx.options.parity_mode, "--vram-target", str(target)])):
        prefix = ctx.work / f"{mode}-{kv}-shift"
        p = run_logged([dump, *common, *extra, "--logits-out", prefix, *args], prefix, timeout,
                       env=ctx.child_env(), result=res)
        log = logparse.parse_log(p.log, source=str(p.stdout_path))
        case[mode] = {"rc": p.rc, "timed_out": p.timed_out, "seconds": round(p.seconds, 1),
                      "window": None if log.window is None else asdict(log.window)}
        runs[mode] = (p, log, prefix)
    ok = True
    for mode, (p, _, _) in runs.items():
        ok = res.check(f"{tag}: {mode} run succeeds", p.rc == 0,
                       f"rc={p.rc} timed_out={p.timed_out}; log {p.stdout_path}") and ok
    if not ok:
        return case
    w = runs["window"][1].window
    if not res.check(f"{tag}: window run at the plain pair's --vram-target with host tail >= 50% of the KV",
                     w is not None and w.tail_fraction >= 0.5,
                     f"--vram-target {target}: window={case['window']['window']}"):
        return case
    cmp = _compare_checks(res, tag, runs["resident"][2], runs["window"][2], case)
    res.check(f"{tag}: both dumps say the shift and the state round trip happened",
              cmp["kv_shift"] == [KV_SHIFT, KV_SHIFT] and cmp["state_roundtrip"] == [True, True],
              f"kv_shift={cmp['kv_shift']} (want {KV_SHIFT}), state_roundtrip={cmp['state_roundtrip']} "
              f"(resident, window)")
    return case


def report_rows(results: dict[str, Any]) -> list[str]:
    """An all-GPU run: each K/V type's window per device (one line per device)."""
    out: list[str] = []
    for kv in ("f16", "q8_0"):
        devices = (results.get(f"kv_{kv}") or {}).get("devices")
        if devices:
            out += [f"{kv}: --vram-target {results[f'kv_{kv}'].get('vram_target')}", "",
                    *sizing.device_table(devices), ""]
    return out


GATE = Gate(name=NAME, order=30, run=run, options=Options, report_rows=report_rows, binaries=BINARIES,
            multi_gpu=True)
