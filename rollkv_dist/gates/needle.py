"""needle: a real model (Gemma 3 270M) finds a pass key placed inside the host tail, in window
mode and, on the very same prompts, in resident mode (the control).

llama-server over HTTP. Flow:
  1. a resident boot reads the model/compute/KV buffer sizes from the log (the search's estimate);
  2. the window's --vram-target is searched (probe boots) so that most of the (non-SWA) KV lives
     in the host tail; the window's C is the resident cell count from its log line;
  3. the window server builds ONE prompt set with its /tokenize: for each depth fraction f the
     needle starts near token C + f * (n_total - C), i.e. inside the host tail [C, n_total), and
     answers it;
  4. a second resident server answers the same prompt strings.
At most one server is alive at a time; the prompts depend on C, so they can only be built after
the search, and the resident answers need a boot of their own.

Why: the resident run is a control. A miss in window mode alone on a prompt the resident run
gets right points at the engine; a miss in both says the model cannot do that prompt, which says
nothing about the engine. Decoding is greedy (temperature 0, top_k 1) and the window mode gives
the resident logits bit for bit, so per depth the checks are: the needle lies beyond C, the key
is found by the resident run, the key is found by the window run, and the window's answer text
is identical to the resident one. The results keep each prompt's sha256 and the sha256 of the
prompt each mode was sent (not the prompt text); the prompts themselves are written under the
gate's work folder. `--plant-failure` checks the answers against a wrong key, so the "found"
checks, and the gate, must fail (proof that they can); the identical-answer check still passes.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollkv_dist.gates import logparse
from rollkv_dist.gates.base import GEMMA, Gate, option
from rollkv_dist.gates import sizing
from rollkv_dist.gates.context import LOG_ARGS, GateContext, GateResult, boot_timeout_option, preflight
from rollkv_dist.gates.llama_server import LlamaServer
from rollkv_dist.gates.sizing import probe_fixed, search_vram_target, window_outcome

NAME = "needle"
BINARIES = ("llama-server",)

HEADER = ("There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
          "I will quiz you about the pass key.")
FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
QUESTION = " What is the pass key? The pass key is"
N_PREDICT = 8


def needle_text(key: int) -> str:
    return f" The pass key is {key}. Remember it. {key} is the pass key."


def build_prompt(n_before: int, n_after: int, key: int) -> tuple[str, str]:
    """(prompt, prefix before the needle)."""
    prefix = HEADER + FILLER * n_before
    return prefix + needle_text(key) + FILLER * n_after + QUESTION, prefix


def answer_has(content: str, key: int) -> bool:
    """The key appears in the first answer tokens (before any other number)."""
    nums = re.findall(r"\d+", content)
    return bool(nums) and nums[0] == str(key)


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


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


@dataclass(frozen=True)
class NeedlePrompt:
    """One prompt of the set that both modes answer."""

    depth: float
    key: int
    text: str
    needle_pos: int
    n_prompt: int
    n_target: int

    @property
    def sha256(self) -> str:
        return sha256(self.text)


def needle_target(C: int, n_total: int, frac: float) -> int:
    """Token where the needle should start: depth frac of the host tail region [C, n_total)."""
    return int(C + frac * (n_total - C))


def build_prompts(srv: Any, C: int, n_total: int, fracs: list[float], keys: list[int]) -> list[NeedlePrompt]:
    out = []
    for frac, key in zip(fracs, keys, strict=True):
        n_target = needle_target(C, n_total, frac)
        p = place(srv, n_target, n_total, key)
        out.append(NeedlePrompt(frac, key, p["prompt"], p["needle_pos"], p["n_prompt"], n_target))
    return out


def save_prompts(prompts: list[NeedlePrompt], folder: Path) -> list[str]:
    """The prompt texts, for reproduction (the JSON report keeps only their sha256)."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for p in prompts:
        path = folder / f"needle-d{p.depth}.txt"
        path.write_text(p.text)
        paths.append(str(path))
    return paths


def ask(srv: LlamaServer, prompt: NeedlePrompt, expect: int) -> dict[str, Any]:
    """One mode's greedy answer to one prompt."""
    resp = srv.completion(prompt.text, n_predict=N_PREDICT)
    content, t = logparse.parse_completion(resp)
    return {"answer": content, "found": answer_has(content, expect), "prompt_sha256": sha256(prompt.text),
            "prompt_n": None if t is None else t.prompt_n,
            "prompt_tps": None if t is None else round(t.prompt_per_second, 1),
            "decode_tps": None if t is None else round(t.predicted_per_second, 1)}


def server_args(model: str, n_ctx: int, extra: list[str] | None = None) -> list[str]:
    return ["-m", model, "-c", str(n_ctx), "-fa", "on", "-ngl", "99", "-np", "1", "--kv-unified",
            "--no-warmup", *LOG_ARGS, *(extra or [])]


def window_args(target: int) -> list[str]:
    return ["-krm", "window", "--vram-target", str(target)]


@dataclass
class Setup:
    """What every boot of the gate shares."""

    server: Path
    model: str
    n_ctx: int
    env: dict[str, str]
    timeout: float
    work: Path

    def boot(self, res: GateResult, log_name: str, extra: list[str] | None = None) -> LlamaServer:
        return LlamaServer(self.server, server_args(self.model, self.n_ctx, extra), self.work / log_name,
                           env=self.env, boot_timeout=self.timeout, result=res)


@dataclass(frozen=True)
class Options:
    needle_ctx: int = option("context (-c)", NEEDLE_CTX)
    needle_depths: str = option("depths of the needles inside the host tail (comma list)", NEEDLE_DEPTHS)
    plant_failure: bool = option("check the answers against a wrong key (the gate must fail)", False)
    seed: int = option("seed of the pass keys", 0)
    boot_timeout: float = boot_timeout_option(300.0)


def run(ctx: GateContext) -> GateResult:
    res, o = ctx.res, ctx.options
    if ctx.gemma is None or not ctx.gemma.is_file():
        res.verdict = "skip"
        res.notes.append("no Gemma GGUF: pass --gemma PATH (rollkv model gemma -o DIR; on a host without "
                         "network: --from-parts)")
        return res
    server = ctx.bin("llama-server")
    if not preflight(ctx, res, server, ("--kv-residency-mode", "--vram-target")):
        return res
    # defaults from the H200 runs of 2026-11-29 (reports/2026-11-29-h200): at 8192 cells Gemma's base cache
    # is a few 2 MiB granules per tensor, too few for a >= 50 % tail; Gemma 3 270M misses keys near the start
    # of 12k-16k prompts in resident mode too, hence needles in the tail region only (and the resident
    # control on the same prompts, so such a miss is not blamed on the engine)
    n_ctx = o.needle_ctx
    fracs = [float(x) for x in o.needle_depths.split(",")]
    plant = o.plant_failure
    rng = random.Random(o.seed)
    keys = [rng.randint(10000, 99999) for _ in fracs]
    keys[0] = 68421
    expect = [k + 1 if plant else k for k in keys]
    model = str(ctx.gemma)
    res.results.update({"model": model, "n_ctx": n_ctx, "plant_failure": plant, "n_predict": N_PREDICT,
                        "rows": []})
    setup = Setup(server, model, n_ctx, ctx.child_env(), o.boot_timeout, ctx.work)
    n_total = n_ctx - 64

    target = _search(setup, res)
    if target is None:
        return res
    # window: build the prompt set (needles beyond its C) and answer it
    with setup.boot(res, "window.log", window_args(target)) as srv:
        w = srv.parsed().window if srv.booted else None
        ok = res.check("window server boots with a host tail", w is not None and not w.fully_resident,
                       f"exit={srv.exit_code} window={w}")
        if not ok or w is None:
            return res
        C = w.cells_resident
        prompts = build_prompts(srv, C, n_total, fracs, keys)
        window = [ask(srv, p, e) for p, e in zip(prompts, expect, strict=True)]
    res.results["prompt_files"] = save_prompts(prompts, ctx.work / "prompts")
    res.results["rows"] = [_row(p, e, C, window=a) for p, e, a in zip(prompts, expect, window, strict=True)]
    # resident: the control, on the same prompt strings
    with setup.boot(res, "resident-answers.log") as srv:
        if not res.check("resident server boots for the control answers", srv.booted, f"exit={srv.exit_code}"):
            return res
        resident = [ask(srv, p, e) for p, e in zip(prompts, expect, strict=True)]
    res.results["rows"] = [_row(p, e, C, resident=r, window=a)
                           for p, e, r, a in zip(prompts, expect, resident, window, strict=True)]
    for row in res.results["rows"]:
        _judge(res, row)
    return res


def _search(setup: Setup, res: GateResult) -> int | None:
    """Resident boot for the KV sizes, a --vram-target 1 probe boot for what the engine keeps before
    any cell, then the --vram-target search (probe boots)."""
    with setup.boot(res, "resident.log") as srv:
        if not res.check("resident server boots", srv.booted, f"exit={srv.exit_code}"):
            return None
        rlog = srv.parsed()
    kv = rlog.require_mib("kv")  # every cache on the gate's one device (Gemma: SWA + base)
    res.results["resident_kv_mib"] = kv
    # the share is of the main cache: the engine counts the SWA cache among its fixed part ("other KV")
    main = rlog.kv_mib_largest_cache or kv
    tensors = sizing.devices_of(rlog)[0].n_tensors
    with setup.boot(res, "window-probe-vt1.log", window_args(1)) as s:
        pass
    fixed = probe_fixed(s.parsed(), ["CUDA0"])["CUDA0"]
    res.results["fixed_mib"] = round(fixed.mib, 2)
    attempts: list[dict[str, Any]] = [{"vram_target": 1, "probe": True, "booted": s.booted}]

    def probe(t: int) -> tuple[bool, logparse.Window | None]:
        """A window boot that keeps t MiB of the main cache on the device."""
        target = sizing.vram_target(fixed, t, tensors)
        with setup.boot(res, f"window-probe-vt{target}.log", window_args(target)) as s:
            booted = s.booted
        attempts.append({"vram_target": target, "booted": booted})
        return window_outcome(s.parsed(), booted)

    t, win = search_vram_target(probe, 0.3 * main, main, lo=0.5, hi=0.97, tries=10)
    res.results["window_search"] = attempts
    ok = res.check("window with a host tail >= 50% of the main cache", t is not None and win is not None,
                   f"attempts={attempts}")
    if not ok or t is None or win is None:
        return None
    target = sizing.vram_target(fixed, t, tensors)
    res.results["vram_target"] = target
    res.results["window"] = {**win.__dict__, "tail_fraction": round(win.tail_fraction, 4)}
    return target


def _row(p: NeedlePrompt, expect: int, C: int, window: dict[str, Any],
         resident: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"depth": p.depth, "key": p.key, "expected": expect, "needle_target": p.n_target,
            "needle_pos": p.needle_pos, "n_prompt": p.n_prompt, "prompt_sha256": p.sha256, "window_C": C,
            "in_tail": p.needle_pos > C, "resident": resident, "window": window,
            "identical": None if resident is None else resident["answer"] == window["answer"]}


def _judge(res: GateResult, row: dict[str, Any]) -> None:
    d, e, r, w = row["depth"], row["expected"], row["resident"], row["window"]
    res.check(f"depth {d}: needle at token {row['needle_pos']} lies in the host tail (C={row['window_C']})",
              row["in_tail"])
    res.check(f"depth {d}: key {e} found by the resident run (control)", r["found"], f"answer={r['answer']!r}")
    res.check(f"depth {d}: key {e} found by the window run", w["found"], f"answer={w['answer']!r}")
    res.check(f"depth {d}: window answer identical to the resident answer", row["identical"],
              f"resident={r['answer']!r} window={w['answer']!r}")


def _cell(text: str, n: int = 30) -> str:
    return " ".join(text.split())[:n].replace("|", "\\|")


def _yes(v: bool | None) -> str:
    return "-" if v is None else ("yes" if v else "NO")


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| depth | needle pos | prompt tokens | C | expected | resident answer | resident found | "
           "window answer | window found | identical |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rr, ww = r.get("resident") or {}, r.get("window") or {}
        out.append(f"| {r['depth']} | {r['needle_pos']} | {r['n_prompt']} | {r['window_C']} | {r['expected']} | "
                   f"{_cell(rr.get('answer', '-'))} | {_yes(rr.get('found'))} | "
                   f"{_cell(ww.get('answer', '-'))} | {_yes(ww.get('found'))} | {_yes(r.get('identical'))} |")
    return "\n".join(out)


def report_rows(results: dict[str, Any]) -> list[str]:
    return [table(results["rows"])] if results.get("rows") else []


GATE = Gate(name=NAME, order=40, run=run, options=Options, report_rows=report_rows, binaries=BINARIES,
            needs=(GEMMA,))
