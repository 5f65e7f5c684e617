"""server: the packaged llama-server, at its own defaults and on the paths those defaults take, gives the
resident answers with a host tail (issue 26).

The slots gate sets `-np 4 --kv-unified` itself and asks two waves. This gate leaves the slot count and the
unified KV at the packaged defaults (it reads the slots from /props), keeps the host prompt cache at its default
(`--cache-ram`, which also holds the idle-slot saves), and runs a dense model of upstream's fixture at a
realistic shape (patch 0091; a dense cache can shift, so cache reuse runs) through cases. Each case is a
resident server against a window server with the same flags, 40-90 % of the cells in the host tail
and the cells used past the window; every answer (greedy tokens and `n_probs` log-probabilities) must equal
the resident one:

- defaults: wave 1, one array request of a prompt per slot; wave 2 extends each slot's prompt (its cached
  prefix); wave 3 brings new prompts, so every slot saves its state to the host prompt cache; wave 4 asks the
  wave-2 prompts again, and each restores from the prompt cache (>= 90 % of every prompt cached);
- cache-reuse (`--cache-reuse 16`): after wave 2, each prompt without its tokens from 50 to 60 %, one
  request at a time: the server restores the slot's state from the prompt cache where it was saved and moves
  the cached rest back to its new position by shifting its KV (a K-shift over cells in the host tail); cached
  tokens > the common prefix + 16 for every request;
- slot-file (`--slot-save-path`): after wave 2, the last slot (its cells allocated last, in the host tail) is
  saved to a file, erased and restored from it, then its prompt runs on it again; the window server's file is byte for byte the resident server's;
- short-ubatch (`-ub 16 -ctk q8_0 -ctv f16`): waves 1 and 2 in ubatches of 16 tokens with a quantized K, where
  the staged and zero-copy graphs alternate; its window is sized for its own memory.
- draft (`-md MODEL --spec-type draft-simple --spec-draft-n-max 8`): waves 1 and 2 with speculative decoding, the
  model drafting for itself (every answer drafted, drafts accepted); its window is sized with the draft
  context beside it, and the two contexts together keep to its --vram-target (their budget lines);
- context-shift (`--context-shift --kv-unified-per-slot <a quarter of -c> -ctk q8_0 -ctv f16`): after wave 2, one
  array request whose first prompt is 2 cells short of its slot's context: that slot shifts its context (half its
  cells discarded, the rest K-shifted, in the host tail) early in its answer while the other slots answer beside
  it. Its K is quantized, so the shift goes through f32 copies of the cells: they go in chunks within the compute
  buffer (patch 0098, its `kv shift:` line), and no shift fails (0001's error).

The planted faults are the fake programs' (tests/test_gates_server.py); on a GPU the resident server of each
case is its control.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from rollkv_dist import log
from rollkv_dist.errors import RollkvError, UsageError
from rollkv_dist.gates import logparse
from rollkv_dist.gates.archs import writer_option
from rollkv_dist.gates.base import Gate, option
from rollkv_dist.gates.context import (LOG_ARGS, GateContext, GateResult, boot_timeout_option, preflight, run_timeout_option)
from rollkv_dist.gates.llama_server import LlamaServer
from rollkv_dist.gates.slots import (WAVE1_SHARE, ask, fill_waves, model_line, prompt_of, request, same_answer,
                                     search_window, write_fixture)

NAME = "server"
BINARIES = ("llama-server",)
REUSE_CHUNK = 16  # --cache-reuse: the shortest cached chunk the server moves


@dataclass(frozen=True)
class Case:
    name: str
    args: tuple[str, ...]
    own_window: bool  # its flags change the memory: the window is sized for this case, not taken from defaults

    def argv(self, model: Path, o: Any) -> list[str]:
        """The case's flags, "{model}" standing for the model's path and "{slot_ctx}" for slot_ctx(o)."""
        sub = {"{model}": str(model), "{slot_ctx}": str(slot_ctx(o))}
        return [sub.get(a, a) for a in self.args]


def slot_ctx(o: Any) -> int:
    """The context-shift case's slot context (--kv-unified-per-slot): a quarter of the context, above any slot's
    wave-2 prompt at the packaged four slots (--server-fill <= 0.9 fills at most 0.225 of it a slot)."""
    return o.server_ctx // 4


CASES = {c.name: c for c in (
    Case("defaults", (), False),
    Case("cache-reuse", ("--cache-reuse", str(REUSE_CHUNK)), False),
    Case("slot-file", (), False),  # --slot-save-path is added per server
    Case("short-ubatch", ("-ub", "16", "-ctk", "q8_0", "-ctv", "f16"), True),
    # the model drafts for itself: every draft is accepted, so the verification batches run
    Case("draft", ("-md", "{model}", "--spec-type", "draft-simple", "--spec-draft-n-max", "8"), True),
    # a quantized K shifts through f32 copies of its cells (0098 chunks them); -ctk changes the memory
    Case("context-shift", ("--context-shift", "--kv-unified-per-slot", "{slot_ctx}", "-ctk", "q8_0", "-ctv", "f16"),
         True),
)}
SHIFT_AFTER = 2  # cells of its slot the long prompt leaves: it shifts before token 2 is decoded (--server-gen >= 3)


@dataclass(frozen=True)
class Options:
    server_arch: str = option("architecture of the model (dense, so that its cache can shift; test-llama-archs -a)",
                              "llama")
    server_layers: int = option("layers of the model", 16)
    server_embd: int = option("embedding width of the model", 2048)
    server_heads: int = option("attention heads of the model (head size = width / heads)", 16)
    server_ff: int = option("feed-forward width of the model", 5632)
    server_ctx: int = option("context (-c)", 32768)
    server_gen: int = option("greedy tokens per answer", 16)
    server_fill: float = option("fraction of the context the slots' prompts fill together after wave 2", 0.7)
    server_cases: str = option(f"comma-separated cases ({', '.join(CASES)}; default all)", ",".join(CASES))
    archs_writer: str | None = writer_option()
    boot_timeout: float = boot_timeout_option(600.0)
    run_timeout: float = run_timeout_option()


Answers = dict[str, list[dict[str, Any]]]  # step name -> one result per prompt


def prompts_for(o: Any, n_slots: int) -> dict[str, list[str]]:
    """The prompts of every step: wave 1, wave 2 (each extends its slot's wave-1 prompt), wave 3 (new ones, as
    long as wave 1's)."""
    first, second = fill_waves(o.server_fill, o.server_ctx, n_slots)
    per_slot = o.server_fill * o.server_ctx / n_slots
    return {"wave 1": first, "wave 2": second,
            "wave 3": [prompt_of(int(per_slot * WAVE1_SHARE), seed=300 + i) for i in range(n_slots)]}


def ask_on(srv: LlamaServer, o: Any, prompt: str | list[int], slot: int | None = None) -> dict[str, Any]:
    """One prompt, on `slot` (None: the server picks)."""
    return srv.post("/completion", request(prompt, o.server_gen, **({} if slot is None else {"id_slot": slot})))


def steps_defaults(srv: LlamaServer, o: Any, p: dict[str, list[str]], _: Path) -> tuple[Answers, dict[str, Any]]:
    a = {w: ask(srv, p[w], o.server_gen) for w in ("wave 1", "wave 2", "wave 3")}
    a["wave 4"] = ask(srv, p["wave 2"], o.server_gen)
    return a, {}


def slots_of(results: list[dict[str, Any]]) -> list[int]:
    """The slot each prompt of an array request ran on (the server picks them, not in prompt order)."""
    ids = [r.get("id_slot") for r in results]
    if not all(isinstance(i, int) and i >= 0 for i in ids):
        raise RollkvError(f"/completion results without the slot they ran on (id_slot): {ids}")
    return ids  # type: ignore[return-value]


def moved(ids: list[int]) -> tuple[list[int], int]:
    """(the prompt's tokens without those from 50 to 60 % of it, the length of the common prefix kept). The
    server keeps the common prefix and, with --cache-reuse, moves the cached rest back to its new position by
    shifting its KV (its chunk search walks the cache ahead of the prompt: it finds what a new prompt left out,
    not what it put in). Tokens, not text: the fixture's tokenizer does not split text at words."""
    k, d = len(ids) // 2, len(ids) // 10
    return ids[:k] + ids[k + d:], k


def steps_cache_reuse(srv: LlamaServer, o: Any, p: dict[str, list[str]], _: Path) -> tuple[Answers, dict[str, Any]]:
    """The moved prompts one at a time, on the slot the server picks: an idle slot's state was saved to the prompt
    cache and cleared when another slot started a task, so it is loaded back first (LCP similarity)."""
    a = {"wave 2": ask(srv, p["wave 2"], o.server_gen)}
    cuts = [moved(srv.tokenize(q)) for q in p["wave 2"]]
    a["moved"] = [ask_on(srv, o, ids) for ids, _ in cuts]
    return a, {"prefix_tokens": [k for _, k in cuts]}


def steps_slot_file(srv: LlamaServer, o: Any, p: dict[str, list[str]], save_dir: Path
                    ) -> tuple[Answers, dict[str, Any]]:
    """The server fills a batch from its slots in order, so the last slot's cells are allocated last: past the
    window, in the host tail."""
    a = {"wave 2": ask(srv, p["wave 2"], o.server_gen)}
    ids = slots_of(a["wave 2"])
    last = max(ids)
    saved = srv.post(f"/slots/{last}?action=save", {"filename": "slot.bin"})
    erased = srv.post(f"/slots/{last}?action=erase", {})
    restored = srv.post(f"/slots/{last}?action=restore", {"filename": "slot.bin"})
    a["after restore"] = [ask_on(srv, o, p["wave 2"][ids.index(last)], last)]
    f = save_dir / "slot.bin"
    return a, {"slot": last, "n_saved": saved.get("n_saved"), "n_erased": erased.get("n_erased"),
               "n_restored": restored.get("n_restored"), "file_bytes": f.stat().st_size if f.is_file() else None,
               "file_sha256": hashlib.sha256(f.read_bytes()).hexdigest() if f.is_file() else None}


def steps_context_shift(srv: LlamaServer, o: Any, p: dict[str, list[str]], _: Path
                        ) -> tuple[Answers, dict[str, Any]]:
    """Wave 2 fills the slots; then one array request whose first prompt (wave 2's first, its slot's cells
    allocated last, so in the host tail, extended with wave 3's) is SHIFT_AFTER cells short of a slot's context:
    that slot shifts its context early in its answer (upstream discards half of its cells and K-shifts the rest)
    while the other slots generate their answers in the same batches."""
    a = {"wave 2": ask(srv, p["wave 2"], o.server_gen)}
    n = slot_ctx(o) - SHIFT_AFTER
    ids, more = srv.tokenize(p["wave 2"][0]), srv.tokenize(p["wave 3"][0], add_special=False) or [1]
    long = (ids + more * (n // len(more) + 1))[:n]
    a["shift"] = ask(srv, [long, *p["wave 2"][1:]], o.server_gen)
    return a, {"long_prompt_tokens": n, "slot_ctx": slot_ctx(o)}


def steps_short_ubatch(srv: LlamaServer, o: Any, p: dict[str, list[str]], _: Path) -> tuple[Answers, dict[str, Any]]:
    return {w: ask(srv, p[w], o.server_gen) for w in ("wave 1", "wave 2")}, {}


STEPS: dict[str, Callable[[LlamaServer, Any, dict[str, list[str]], Path], tuple[Answers, dict[str, Any]]]] = {
    "defaults": steps_defaults, "cache-reuse": steps_cache_reuse, "slot-file": steps_slot_file,
    "short-ubatch": steps_short_ubatch, "draft": steps_short_ubatch, "context-shift": steps_context_shift}


def window_of(case: Case) -> Callable[[logparse.LlamaLog], logparse.Window | None]:
    """The window a case sizes and checks: the main context's. A draft context sizes its own window (a
    4096-cell stand-in beside the main one, patch 0096) after the main one: the first cache."""
    if case.name == "draft":
        return lambda log: log.caches[0] if log.caches else None
    return lambda log: log.window


def share_of(case: Case, rlog: logparse.LlamaLog) -> float:
    """The part of the resident server's KV that the window sized holds: all of it, but beside a draft model the
    main cache's (the first `llama_kv_cache: size` line: the draft context is made after the main one)."""
    sizes = [c[0] for c in rlog.kv_caches]
    if case.name != "draft" or len(sizes) < 2 or not sum(sizes):
        return 1.0
    return sizes[0] / sum(sizes)


def cases_of(o: Any) -> list[Case]:
    names = [n.strip() for n in o.server_cases.split(",") if n.strip()]
    unknown = [n for n in names if n not in CASES]
    if unknown or not names:
        raise UsageError(f"server: --server-cases {o.server_cases!r}: choose from {', '.join(CASES)}")
    return [CASES[n] for n in names]


class Runner:
    """Boots the servers of one gate run: the model, the flags every server has, a log per label."""

    def __init__(self, ctx: GateContext, model: Path):
        self.ctx, self.res, self.o, self.model = ctx, ctx.res, ctx.options, model

    def base(self) -> list[str]:
        """The model and the context; the fixture's training context (256) is overridden to -c, or the server
        would cap a slot there. The slot count and the unified KV are left at the packaged defaults."""
        o = self.o
        return ["-m", str(self.model), "--override-kv", f"{o.server_arch}.context_length=int:{o.server_ctx}",
                "-c", str(o.server_ctx), "-ngl", "99", "-fa", "on"]

    def server(self, label: str, args: list[str]) -> LlamaServer:
        return LlamaServer(self.ctx.bin("llama-server"), [*self.base(), *args, *LOG_ARGS],
                           self.ctx.work / f"{label}.log", env=self.ctx.child_env(), boot_timeout=self.o.boot_timeout,
                           request_timeout=self.o.run_timeout, result=self.res)

    def boot_only(self, label: str, args: list[str]) -> tuple[bool, logparse.LlamaLog]:
        with self.server(label, args) as srv:
            booted = srv.booted
            parsed = srv.parsed()
        return booted, parsed

    def session(self, case: Case, label: str, args: list[str], prompts: dict[str, list[str]] | None
                ) -> tuple[logparse.LlamaLog, Answers | None, dict[str, Any], int | None]:
        """Boot, run the case's steps (prompts None: read the slot count only), stop. (log, answers, facts, slots)"""
        save_dir = self.ctx.work / f"{label}-slots"
        extra = ["--slot-save-path", str(save_dir)] if case.name == "slot-file" else []
        if extra:
            save_dir.mkdir(parents=True, exist_ok=True)
            for old in save_dir.iterdir():
                old.unlink()
        answers: Answers | None = None
        facts: dict[str, Any] = {}
        n_slots = None
        with self.server(label, [*case.argv(self.model, self.o), *args, *extra]) as srv:
            if srv.booted:
                n_slots = int(srv.get("/props").get("total_slots") or 0) or None
                if prompts is not None:
                    with log.step(f"{label}: {case.name}"):
                        answers, facts = STEPS[case.name](srv, self.o, prompts, save_dir)
            parsed = srv.parsed()
        return parsed, answers, facts, n_slots


def compare(res: GateResult, case: str, ref: Answers, got: Answers) -> list[dict[str, Any]]:
    rows = []
    for step, results in ref.items():
        for i, (a, b) in enumerate(zip(results, got.get(step) or [])):
            rows.append({"case": case, "step": step, "prompt": i,
                         "cache_n": (b.get("timings") or {}).get("cache_n"),
                         "resident_cache_n": (a.get("timings") or {}).get("cache_n"),
                         **same_answer(res, f"{case}, {step}, prompt {i}", a, b)})
        res.check(f"{case}, {step}: the window server answered every prompt",
                  len(got.get(step) or []) == len(results), f"{len(got.get(step) or [])} of {len(results)}")
    return rows


def mostly_cached(results: list[dict[str, Any]]) -> tuple[bool, list[tuple[Any, Any]]]:
    """Whether every answer took at least 90 % of its prompt from the cache; (cached, evaluated) per answer."""
    n = [((r.get("timings") or {}).get("cache_n"), (r.get("timings") or {}).get("prompt_n")) for r in results]
    ok = bool(n) and all(isinstance(c, int) and isinstance(e, int) and c >= 0.9 * (c + e) > 0 for c, e in n)
    return ok, n


def case_checks(res: GateResult, case: str, ans: Answers, facts: dict[str, Any], who: str,
                slog: logparse.LlamaLog) -> None:
    """What a case must show beside equal answers, on each server (`who`: resident or window; `slog` its log)."""
    if case == "defaults":
        ok, n = mostly_cached(ans.get("wave 4") or [])
        res.check(f"defaults, {who}: wave 4 restores every slot's prompt from the prompt cache (>= 90 % of its "
                  f"tokens cached)", ok, f"(cached, evaluated) {n}")
    elif case == "cache-reuse":
        pre = facts.get("prefix_tokens") or []
        got = [(r.get("timings") or {}).get("cache_n") for r in ans.get("moved") or []]
        res.check(f"cache-reuse, {who}: every moved prompt reuses its cached chunks beyond the common prefix "
                  f"(cached tokens > prefix + {REUSE_CHUNK})",
                  bool(got) and len(pre) == len(got) and all((n or 0) > k + REUSE_CHUNK for n, k in zip(got, pre)),
                  f"cache_n {got}, common prefixes {pre}")
    elif case == "draft":
        t = [r.get("timings") or {} for step in ans.values() for r in step]
        res.check(f"draft, {who}: every answer was drafted and verified (draft tokens accepted > 0)",
                  bool(t) and all((x.get("draft_n") or 0) > 0 and (x.get("draft_n_accepted") or 0) > 0 for x in t),
                  f"(drafted, accepted) {[(x.get('draft_n'), x.get('draft_n_accepted')) for x in t]}")
    elif case == "context-shift":
        sh = ans.get("shift") or []
        res.check(f"context-shift, {who}: the long prompt's slot shifted its context (truncated) while the other "
                  f"slots answered beside it",
                  len(sh) > 1 and sh[0].get("truncated") is True
                  and all((r.get("timings") or {}).get("predicted_n", 0) > 0 for r in sh),
                  f"truncated {[r.get('truncated') for r in sh]}, predicted "
                  f"{[(r.get('timings') or {}).get('predicted_n') for r in sh]}")
        res.check(f"context-shift, {who}: the quantized K shifted in chunks within the compute buffer, and no "
                  f"shift failed", bool(slog.kv_shifts) and not slog.kv_shift_failed
                  and all(k["chunk"] < k["cells"] for k in slog.kv_shifts),
                  f"kv shift lines {slog.kv_shifts[:2]} ({len(slog.kv_shifts)}), a shift failed: {slog.kv_shift_failed}")
    elif case == "slot-file":
        ok = bool(facts.get("n_saved")) and facts.get("n_restored") == facts.get("n_saved") and bool(
            facts.get("file_bytes"))
        res.check(f"slot-file, {who}: the last slot is saved, erased and restored (the tokens restored = saved)", ok,
                  str(facts))
        ok, n = mostly_cached(ans.get("after restore") or [])
        res.check(f"slot-file, {who}: the restored slot's prompt comes from the file (>= 90 % of its tokens cached)",
                  ok, f"(cached, evaluated) {n}")


def run(ctx: GateContext) -> GateResult:
    res, o = ctx.res, ctx.options
    if o.server_ctx < 1024 or o.server_gen < 1 or not 0.1 <= o.server_fill <= 0.9:
        raise UsageError(f"server: --server-ctx {o.server_ctx}, --server-gen {o.server_gen}, --server-fill "
                         f"{o.server_fill}: need >= 1024, >= 1 and 0.1-0.9")
    cases = cases_of(o)
    if CASES["context-shift"] in cases and o.server_gen <= SHIFT_AFTER:
        raise UsageError(f"server: --server-gen {o.server_gen}: the context-shift case needs >= {SHIFT_AFTER + 1} "
                         f"tokens an answer (its slot shifts before token {SHIFT_AFTER} is decoded)")
    if not preflight(ctx, res, ctx.bin("llama-server"), ("--kv-residency-mode", "--vram-target")):
        return res
    model = write_fixture(ctx, res, "server-model", o.server_arch, o.server_embd, o.server_heads, o.server_ff,
                          o.server_layers)
    if model is None:
        return res
    r = Runner(ctx, model)
    res.results["model"] = {"arch": o.server_arch, "layers": o.server_layers, "n_embd": o.server_embd,
                            "n_head": o.server_heads, "n_ff": o.server_ff, "bytes": model.stat().st_size}
    res.results["n_ctx"] = o.server_ctx
    targets: dict[bool, str] = {}  # own_window -> the defaults' target (False) is shared
    rows: list[dict[str, Any]] = []
    summary: list[dict[str, Any]] = []
    prompts: dict[str, list[str]] | None = None
    for case in cases:
        if prompts is None:  # the slot count is the packaged default's: ask a resident server
            _, _, _, n_slots = r.session(CASES["defaults"], "slots-probe", ["-krm", "resident"], None)
            if not res.check("a resident server at the packaged defaults boots and reports its slots",
                             n_slots is not None, f"log {ctx.work / 'slots-probe.log'}"):
                return res
            res.results["n_slots"] = n_slots
            prompts = prompts_for(o, n_slots)
        rlog, ref, rfacts, _ = r.session(case, f"{case.name}-resident", ["-krm", "resident"], prompts)
        if not res.check(f"{case.name}: the resident server boots and answers", ref is not None,
                         rlog.context_failed or f"log {ctx.work / f'{case.name}-resident.log'}"):
            continue
        assert ref is not None
        case_checks(res, case.name, ref, rfacts, "resident", rlog)
        key = case.own_window
        if key not in targets or case.own_window:
            def boot(label: str, target: str, case: Case = case) -> tuple[bool, logparse.LlamaLog]:
                return r.boot_only(label, [*case.argv(model, o), "-krm", "window", "--vram-target", target])

            found = search_window(res, boot, rlog, f"{case.name}: ", which=window_of(case),
                                  share=share_of(case, rlog))
            if found is None:
                continue
            targets[key] = found[0]
        wlog, got, wfacts, _ = r.session(case, f"{case.name}-window", ["-krm", "window", "--vram-target",
                                                                      targets[key]], prompts)
        win = window_of(case)(wlog)
        if not res.check(f"{case.name}: the window server boots and answers", got is not None and win is not None,
                         wlog.context_failed or f"window={win}"):
            continue
        assert got is not None and win is not None
        case_checks(res, case.name, got, wfacts, "window", wlog)
        cells = max(sum((a.get("timings") or {}).get("prompt_n", 0) + (a.get("timings") or {}).get("cache_n", 0)
                        + o.server_gen for a in step) for step in got.values())
        res.check(f"{case.name}: the cells used reach past the window into the host tail", cells > win.cells_resident,
                  f"about {cells} cells used, window C = {win.cells_resident} of {win.kv_size}")
        if case.name == "slot-file":
            res.check("slot-file: the window server's slot file is the resident server's, byte for byte",
                      bool(rfacts.get("file_sha256")) and wfacts.get("file_sha256") == rfacts.get("file_sha256"),
                      f"resident {rfacts.get('file_sha256')}, window {wfacts.get('file_sha256')}")
        rows += compare(res, case.name, ref, got)
        if case.name == "draft":
            res.notes.append("draft: the window server's caches (C of cells): "
                             f"{[(w.cells_resident, w.kv_size) for w in wlog.caches]} (the main one first)")
            # patch 0096: the main and the draft context keep to one --vram-target together; each one's budget
            # line bounds what it holds (model + window + compute reserve + margin)
            held = [b["model"] + (w.device_mib or 0) + b["compute_reserve"] + b["margin"]
                    for b, w in zip(wlog.budgets, wlog.caches)]
            target = float(targets[key])
            res.check("draft: the main and the draft context together keep to the --vram-target",
                      len(held) >= 2 and sum(held) <= target + len(held),  # 1 MiB of rounding per context
                      f"main {held[0] if held else 0:.0f} MiB + draft {sum(held[1:]):.0f} MiB = {sum(held):.0f} MiB "
                      f"against --vram-target {targets[key]} (budget lines: {len(held)}, vram targets "
                      f"{[b['vram_target'] for b in wlog.budgets]})")
        summary.append({"case": case.name, "flags": " ".join(case.argv(Path("MODEL"), o)),
                        "vram_target": targets[key],
                        "cells_resident": win.cells_resident, "kv_size": win.kv_size,
                        "tail_fraction": round(win.tail_fraction, 4), "host_tail_mib": win.host_tail_mib,
                        "cells_used": cells, "prompt_cache": wlog.prompt_cache, **wfacts})
    res.results["cases"], res.results["rows"] = summary, rows
    return res


def report_rows(results: dict[str, Any]) -> list[str]:
    m = results.get("model") or {}
    out = []
    if m:
        out.append(model_line(m, f"-c {results.get('n_ctx')}, the packaged defaults' {results.get('n_slots')} slots."))
    cases = results.get("cases") or []
    rows = results.get("rows") or []
    if cases:
        out += ["", "| case | flags | --vram-target | window C / cells | host tail | cells used | answers equal |",
                "|---|---|---|---|---|---|---|"]
        for c in cases:
            mine = [r for r in rows if r["case"] == c["case"]]
            eq = sum(r["tokens_equal"] and r["max_abs_diff"] == 0.0 for r in mine)
            out.append(f"| {c['case']} | `{c['flags'] or '(defaults)'}` | {c['vram_target']} | {c['cells_resident']} / "
                       f"{c['kv_size']} | {100 * c['tail_fraction']:.0f} % ({c['host_tail_mib']:.0f} MiB) | "
                       f"{c['cells_used']} | {eq} of {len(mine)} |")
    if rows:
        out += ["", "| case | step | prompt | cached tokens (window / resident) | tokens | log-probs | max abs diff |",
                "|---|---|---|---|---|---|---|"]
        for r in rows:
            out.append(f"| {r['case']} | {r['step']} | {r['prompt']} | {r['cache_n']} / {r['resident_cache_n']} | "
                       f"{'equal' if r['tokens_equal'] else 'DIFFER'} | {r['n_logprobs']} | {r['max_abs_diff']} |")
    return out


GATE = Gate(name=NAME, order=37, run=run, options=Options, report_rows=report_rows, binaries=BINARIES)
