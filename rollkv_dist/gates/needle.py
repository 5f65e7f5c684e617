"""needle: a real model (Gemma 3 270M) finds a pass key placed inside the host tail.

llama-server over HTTP, resident and window. The window's --vram-target is searched so that
most of the (non-SWA) KV lives in the host tail; the needle's token position, measured with the
server's /tokenize, must lie beyond the window's C from the log line. `--plant-failure` checks
the answers against a wrong key, so the gate must fail (proof that it can).
"""

from __future__ import annotations

import random
from typing import Any

from . import logparse
from .common import (LOG_ARGS, GateContext, GateResult, LlamaServer, preflight, search_vram_target,
                     window_outcome)

NAME = "needle"

HEADER = ("There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
          "I will quiz you about the pass key.")
FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
QUESTION = " What is the pass key? The pass key is"


def needle_text(key: int) -> str:
    return f" The pass key is {key}. Remember it. {key} is the pass key."


def build_prompt(n_before: int, n_after: int, key: int) -> tuple[str, str]:
    """(prompt, prefix before the needle)."""
    prefix = HEADER + FILLER * n_before
    return prefix + needle_text(key) + FILLER * n_after + QUESTION, prefix


def answer_has(content: str, key: int) -> bool:
    """The key appears in the first answer tokens (before any other number)."""
    import re

    nums = re.findall(r"\d+", content)
    return bool(nums) and nums[0] == str(key)


NEEDLE_CTX = 12288
NEEDLE_DEPTHS = "0.3,0.6,0.9"


def place(srv: Any, n_target: int, n_total: int, key: int) -> dict[str, Any]:
    """Prompt with the needle starting near token n_target and about n_total tokens overall."""
    unit = len(srv.tokenize(FILLER * 20, add_special=False)) / 20.0
    head = len(srv.tokenize(HEADER, add_special=True))
    tail_fixed = len(srv.tokenize(needle_text(key) + QUESTION, add_special=False))
    n_before = max(0, int((n_target - head) / unit))
    n_after = max(0, int((n_total - head - tail_fixed) / unit) - n_before)
    for _ in range(4):  # BPE merges make the unit count approximate: trim until it fits n_total
        prompt, prefix = build_prompt(n_before, n_after, key)
        n_prompt = len(srv.tokenize(prompt, add_special=True))
        if n_prompt <= n_total or n_after == 0:
            break
        n_after = max(0, n_after - int((n_prompt - n_total) / unit) - 1)
    pos = len(srv.tokenize(prefix, add_special=True))
    return {"prompt": prompt, "needle_pos": pos, "n_prompt": n_prompt, "n_before": n_before, "n_after": n_after}


def server_args(model: str, n_ctx: int, extra: list[str] | None = None) -> list[str]:
    return ["-m", model, "-c", str(n_ctx), "-fa", "on", "-ngl", "99", "-np", "1", "--kv-unified",
            "--no-warmup", *LOG_ARGS, *(extra or [])]


def run(ctx: GateContext, res: GateResult) -> GateResult:
    if ctx.gemma is None or not ctx.gemma.is_file():
        res.verdict = "skip"
        res.notes.append("no Gemma GGUF: pass --gemma PATH (rollkv model gemma -o DIR; on a host without "
                         "network: --from-parts)")
        return res
    model = str(ctx.gemma)
    server = ctx.bin("llama-server")
    if not preflight(ctx, res, server, ("--kv-residency-mode", "--vram-target")):
        return res
    # defaults from the H200 runs of 2026-11-29 (reports/2026-11-29-h200): at 8192 cells Gemma's base cache
    # is a few 2 MiB granules per tensor, too few for a >= 50 % tail; Gemma 3 270M misses keys near the start
    # of 12k-16k prompts in resident mode too, which says nothing about the engine
    n_ctx = int(ctx.opt("needle_ctx", NEEDLE_CTX))
    fracs = [float(x) for x in str(ctx.opt("needle_depths", NEEDLE_DEPTHS)).split(",")]
    plant = bool(ctx.opt("plant_failure", False))
    rng = random.Random(int(ctx.opt("seed", 0)))
    keys = [rng.randint(10000, 99999) for _ in fracs]
    keys[0] = 68421
    res.results.update({"model": model, "n_ctx": n_ctx, "plant_failure": plant, "rows": []})
    env = ctx.child_env()
    n_total = n_ctx - 64
    timeout = float(ctx.opt("boot_timeout", 300))

    # resident boot: sizes for the window search, and the resident answers
    with LlamaServer(server, server_args(model, n_ctx), ctx.work / "resident.log", env=env,
                     boot_timeout=timeout, result=res) as srv:
        if not res.check("resident server boots", srv.booted, f"exit={srv.exit_code}"):
            return res
        rlog = srv.parsed()
        _ask_all(srv, res, "resident", fracs, keys, n_total, None, plant)

    kv = sum(rlog.kv_buffers.values()) or 1.0
    estimate = (rlog.model_buffers.get("CUDA0") or 0.0) + (rlog.compute_mib("CUDA0") or 0.0) + 256 + 0.3 * kv
    attempts: list[dict[str, Any]] = []

    def probe(target: int) -> tuple[bool, logparse.Window | None, int | None]:
        with LlamaServer(server, server_args(model, n_ctx, ["-krm", "window", "--vram-target", str(target)]),
                         ctx.work / f"window-probe-vt{target}.log", env=env, boot_timeout=timeout,
                         result=res) as s:
            booted = s.booted
        attempts.append({"vram_target": target, "booted": booted})
        return window_outcome(s.parsed(), booted, kv)

    target, win = search_vram_target(probe, estimate, kv, lo=0.5, hi=0.97, tries=10, history=attempts)
    res.results["window_search"] = attempts
    if not res.check("window with a host tail >= 50% of the main cache", target is not None and win is not None,
                     f"attempts={attempts}"):
        return res
    res.results["vram_target"] = target
    res.results["window"] = {**win.__dict__, "tail_fraction": round(win.tail_fraction, 4)}
    with LlamaServer(server, server_args(model, n_ctx, ["-krm", "window", "--vram-target", str(target)]),
                     ctx.work / "window.log", env=env, boot_timeout=timeout, result=res) as srv:
        if not res.check("window server boots", srv.booted, f"exit={srv.exit_code}"):
            return res
        w = srv.parsed().window
        _ask_all(srv, res, "window", fracs, keys, n_total, w, plant)
    return res


def _ask_all(srv: LlamaServer, res: GateResult, mode: str, fracs: list[float], keys: list[int], n_total: int,
             window: logparse.Window | None, plant: bool) -> None:
    C = window.cells_resident if window is not None else None
    for frac, key in zip(fracs, keys, strict=True):
        # window: depth measured inside the tail region [C, n_total); resident: over the whole prompt
        lo = C if C is not None else 0
        n_target = int(lo + frac * (n_total - lo))
        p = place(srv, n_target, n_total, key)
        resp = srv.completion(p["prompt"], n_predict=8)
        content, t = logparse.parse_completion(resp)
        expect = key + 1 if plant else key
        found = answer_has(content, expect)
        in_tail = None if C is None else p["needle_pos"] > C
        row = {"mode": mode, "depth": frac, "key": key, "expected": expect, "needle_pos": p["needle_pos"],
               "n_prompt": p["n_prompt"], "window_C": C, "in_tail": in_tail, "answer": content[:60],
               "found": found, "prompt_tps": None if t is None else round(t.prompt_per_second, 1),
               "decode_tps": None if t is None else round(t.predicted_per_second, 1)}
        res.results["rows"].append(row)
        if in_tail is not None:
            res.check(f"{mode} depth {frac}: needle at token {p['needle_pos']} lies in the host tail (C={C})",
                      in_tail)
        res.check(f"{mode} depth {frac}: key {expect} found", found, f"answer={content[:60]!r}")


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| mode | depth | needle pos | prompt tokens | C | in tail | expected | answer | found |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['mode']} | {r['depth']} | {r['needle_pos']} | {r['n_prompt']} | {r['window_C'] or '-'} | "
                   f"{'-' if r['in_tail'] is None else r['in_tail']} | {r['expected']} | "
                   f"{r['answer'].strip()[:30]!s} | {'yes' if r['found'] else 'NO'} |")
    return "\n".join(out)
