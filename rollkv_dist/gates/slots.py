"""slots: four unified llama-server slots on a hybrid model of a realistic size give the same
answers with a host tail as with the whole KV resident.

The archs gate runs every architecture at the fixture's size (2 layers, n_embd 256) through
llama-logits-dump, one sequence. Users run llama-server, which defaults to four slots in one
unified KV cache, reuses a slot's cached prompt and restores idle slots' state. This gate writes one
hybrid model with upstream's fixture at a realistic shape (patch 0091: `test-llama-archs -a qwen35
--n-embd 2048 --n-head 16 --n-ff 6144 --n-layer 24`; its attention layers alternate with gated
delta-net layers) and runs llama-server with `-np 4 --kv-unified -c 32768` three ways:

1. resident (`-krm resident -fa on`): the reference;
2. window, with a `--vram-target` that puts 40-90 % of the cells in the host tail (a `--vram-target
   1` boot gives the engine's fixed part, sizing.py, then search_vram_target);
3. the packaged default (no residency flag);
4. with the model's MTP head as the draft (`--spec-type draft-mtp`; the model has `--slots-nextn` MTP
   blocks after its trunk), resident, and in window mode with a ballast that leaves too little free
   memory for the whole KV: the main cache and the MTP draft context's cache each get a host tail
   (patches 0090, 0096), and the answers equal the resident MTP run's.

Each server answers two waves of one array request of four prompts (one per slot, greedy,
`n_probs`). Wave 2 extends each wave-1 prompt, so a slot finds its cached prefix (`cache_prompt`),
and the four slots together fill `--slots-fill` of the context, past the window. Per wave and slot,
the generated tokens and every logged log-probability must equal the resident server's; the rows
keep the prompt and cache token counts.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from rollkv_dist import log
from rollkv_dist.errors import LogParseError, RollkvError, UsageError
from rollkv_dist.gates import logparse, sizing
from rollkv_dist.gates.archs import MIN_TAIL, find_writer, writer_option
from rollkv_dist.gates.base import Gate, option
from rollkv_dist.gates.context import (LOG_ARGS, GateContext, GateResult, boot_timeout_option, preflight, run_timeout_option)
from rollkv_dist.gates.llama_server import LlamaServer
from rollkv_dist.gates.sizing import WindowRefused, probe_fixed, search_vram_target, window_outcome
from rollkv_dist.gates.process import run_logged
from rollkv_dist.gates.resident_parity import make_prompt

NAME = "slots"
BINARIES = ("llama-server",)
CHARS_PER_TOKEN = 5  # the fixture's "test" tokenizer
N_PROBS = 8
WAVE1_SHARE = 2 / 3  # of each slot's tokens; wave 2 adds the rest


@dataclass(frozen=True)
class Options:
    slots_arch: str = option("architecture of the model (a hybrid; test-llama-archs -a)", "qwen35")
    slots_layers: int = option("layers of the model's trunk", 24)
    slots_nextn: int = option("MTP (NextN) blocks after the trunk (0: none, and no MTP runs)", 1)
    slots_mtp_room: int = option("MiB the ballast of the MTP window run leaves free beyond the window run's "
                                 "--vram-target", 1024)
    slots_embd: int = option("embedding width of the model", 2048)
    slots_heads: int = option("attention heads of the model (head size = width / heads)", 16)
    slots_ff: int = option("feed-forward width of the model", 6144)
    slots_ctx: int = option("context (-c) shared by the slots", 32768)
    slots_np: int = option("server slots (-np), one prompt each", 4)
    slots_gen: int = option("greedy tokens per answer", 16)
    slots_fill: float = option("fraction of the context the slots' prompts fill together after wave 2", 0.7)
    archs_writer: str | None = writer_option()
    boot_timeout: float = boot_timeout_option(600.0)
    run_timeout: float = run_timeout_option()


def prompt_of(n_tokens: int, seed: int) -> str:
    """Text of about n_tokens tokens of the test tokenizer (5 characters a token)."""
    n_words = max(1, n_tokens // 2)
    text = make_prompt(n_words, seed=seed)
    for _ in range(3):
        est = len(text) / CHARS_PER_TOKEN
        if abs(est - n_tokens) <= 0.02 * n_tokens:
            break
        n_words = max(1, int(n_words * n_tokens / est))
        text = make_prompt(n_words, seed=seed)
    return text


def waves(o: Any) -> list[list[str]]:
    """Two waves of one prompt per slot; each wave-2 prompt starts with the same slot's wave-1 prompt."""
    return fill_waves(o.slots_fill, o.slots_ctx, o.slots_np)


def fill_waves(fill: float, n_ctx: int, n_slots: int) -> list[list[str]]:
    """Two waves of a prompt per slot that fill `fill` of `n_ctx` together after wave 2, which extends each
    wave-1 prompt."""
    per_slot = fill * n_ctx / n_slots
    first = [prompt_of(int(per_slot * WAVE1_SHARE), seed=100 + i) for i in range(n_slots)]
    more = [prompt_of(int(per_slot * (1 - WAVE1_SHARE)), seed=200 + i) for i in range(n_slots)]
    return [first, [f"{a} {b}" for a, b in zip(first, more)]]


def write_model(ctx: GateContext, res: GateResult, nextn: int = 0) -> Path | None:
    """The model, or with nextn > 0 the same shape with nextn MTP blocks after the trunk. Two files: at the pin,
    a model with MTP blocks loads only with its MTP head (the loader skips the blocks' tensors without
    --spec-type draft-mtp and then finds too few: "done_getting_tensors: wrong number of tensors")."""
    o = ctx.options
    return write_fixture(ctx, res, f"model-mtp{nextn}" if nextn else "model", o.slots_arch, o.slots_embd,
                         o.slots_heads, o.slots_ff, o.slots_layers, nextn)


def write_fixture(ctx: GateContext, res: GateResult, tag: str, arch: str, embd: int, heads: int, ff: int,
                  layers: int, nextn: int = 0) -> Path | None:
    """Upstream's fixture model of `arch` at a shape (patch 0091), with `nextn` MTP blocks after its `layers`, in
    <work>/<tag>/ (None, with a failed check, where the writer refuses it)."""
    o = ctx.options
    out = ctx.work / tag
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.gguf"):
        old.unlink()
    writer = find_writer(ctx)
    cmd = [writer, "-a", arch, "--n-embd", str(embd), "--n-head", str(heads),
           "--n-ff", str(ff), "--n-layer", str(layers + nextn),
           *(["--n-nextn", str(nextn)] if nextn else []), "-o", out]
    what = f"{arch} model" + (f" with {nextn} MTP block(s)" if nextn else "")
    with log.step(f"Writing a {what} ({layers} layers, n_embd {embd})"):
        p = run_logged(cmd, ctx.work / f"writer-{tag}", o.run_timeout, env=ctx.child_env(), result=res)
    found = sorted(out.glob("*.gguf"))
    dense = [f for f in found if f.stem == f"{arch}-dense"] or found  # an arch with MoE variants writes both
    if not res.check(f"{writer.name} writes the {what}", p.rc == 0 and len(dense) == 1,
                     f"rc={p.rc} timed_out={p.timed_out}, files {[f.name for f in found]}; log {p.stdout_path}"):
        return None
    return dense[0]


def request(prompt: str | list[str] | list[int], n_gen: int, **extra: Any) -> dict[str, Any]:
    """A greedy /completion body with the tokens and N_PROBS log-probabilities of the answer."""
    return {"prompt": prompt, "n_predict": n_gen, "temperature": 0.0, "top_k": 1, "seed": 0,
            "n_probs": N_PROBS, "cache_prompt": True, "return_tokens": True, **extra}


def ask(srv: LlamaServer, prompts: list[str], n_gen: int) -> list[dict[str, Any]]:
    """One array request: every prompt at once, one slot each; the results in prompt order."""
    out = srv.post("/completion", request(prompts, n_gen))
    items = out if isinstance(out, list) else [out]
    if len(items) != len(prompts):
        raise RollkvError(f"/completion answered {len(items)} results for {len(prompts)} prompts")
    return sorted(items, key=lambda r: r.get("index", 0))


def logprobs(result: dict[str, Any]) -> list[float]:
    """Every log-probability the answer carries: the chosen token's and its top candidates', in order."""
    vals: list[float] = []
    for step in result.get("completion_probabilities") or []:
        vals.append(float(step.get("logprob", 0.0)))
        vals += [float(c.get("logprob", 0.0)) for c in step.get("top_logprobs") or []]
    return vals


def same_answer(res: GateResult, what: str, a: dict[str, Any], b: dict[str, Any], label: str = "window"
                ) -> dict[str, Any]:
    """Checks that answer `b` has the greedy tokens and log-probabilities of the resident answer `a` (names start
    with `what`); the comparison's row fields."""
    la, lb = logprobs(a), logprobs(b)
    diff = max((abs(x - y) for x, y in zip(la, lb)), default=0.0) if len(la) == len(lb) else None
    row = {"tokens_equal": a.get("tokens") == b.get("tokens") and bool(a.get("tokens")),
           "n_logprobs": len(lb), "max_abs_diff": diff}
    res.check(f"{what}: greedy tokens identical", row["tokens_equal"],
              f"resident {a.get('tokens')}, {label} {b.get('tokens')}")
    res.check(f"{what}: log-probabilities identical", bool(la) and diff == 0.0,
              f"{len(la)} vs {len(lb)} values, max |diff| {diff}")
    return row


def model_line(m: dict[str, Any], tail: str) -> str:
    """The report's line on the fixture model (results["model"]), then `tail`."""
    return (f"Model: {m.get('arch')}, {m.get('layers')} layers, n_embd {m.get('n_embd')}, {m.get('n_head')} heads, "
            f"n_ff {m.get('n_ff')} ({m.get('bytes', 0) / 2**30:.1f} GiB); {tail}")


def model_args(o: Any, model: Path) -> list[str]:
    """The model, the shared context and the slots. The fixture writes a training context of 256 tokens, and
    llama-server caps a slot's context there: the model's context length is overridden to -c."""
    return ["-m", str(model), "--override-kv", f"{o.slots_arch}.context_length=int:{o.slots_ctx}",
            "-c", str(o.slots_ctx), "-np", str(o.slots_np), "--kv-unified", "-ngl", "99"]


def serve(ctx: GateContext, res: GateResult, label: str, model: Path, extra: list[str],
          prompts: list[list[str]]) -> tuple[logparse.LlamaLog, list[list[dict[str, Any]]] | None]:
    """Boot a server, answer the waves (None when it did not boot; no waves: a boot only), stop it. The first
    server that answers counts the prompts' tokens."""
    o = ctx.options
    args = [*model_args(o, model), *extra, *LOG_ARGS]
    answers: list[list[dict[str, Any]]] | None = None
    with LlamaServer(ctx.bin("llama-server"), args, ctx.work / f"{label}.log", env=ctx.child_env(),
                     boot_timeout=o.boot_timeout, request_timeout=o.run_timeout, result=res) as srv:
        if srv.booted:
            with log.step(f"{label}: {len(prompts)} waves of {o.slots_np} prompts"):
                answers = [ask(srv, wave, o.slots_gen) for wave in prompts]
            if prompts and "n_prompt_tokens" not in res.results:
                res.results["n_prompt_tokens"] = [[len(srv.tokenize(p)) for p in wave] for wave in prompts]
        parsed = srv.parsed()
    return parsed, answers


def size_window(ctx: GateContext, res: GateResult, model: Path, rlog: logparse.LlamaLog
                ) -> tuple[str, logparse.Window] | None:
    def boot(label: str, target: str) -> tuple[bool, logparse.LlamaLog]:
        wlog, answered = serve(ctx, res, label, model, ["-fa", "on", "-krm", "window", "--vram-target", target], [])
        return answered is not None, wlog

    return search_window(res, boot, rlog)


def search_window(res: GateResult, boot: Callable[[str, str], tuple[bool, logparse.LlamaLog]],
                  rlog: logparse.LlamaLog, what: str = "",
                  which: Callable[[logparse.LlamaLog], logparse.Window | None] | None = None,
                  share: float = 1.0) -> tuple[str, logparse.Window] | None:
    """A --vram-target whose window puts MIN_TAIL-90 % of the cells in the host tail, and that window: a
    `--vram-target 1` boot gives the engine's fixed part (sizing.py), then the search. boot(label, target) boots a
    window server and says whether it answered; rlog is the resident server's log (its KV); `what` prefixes the
    checks' names; which(log) picks the window to size (default: the main cache's, LlamaLog.window), and `share` is
    its cache's part of the resident server's KV (a draft context's KV sits beside the main one's on its devices)."""
    if not 0.0 < share <= 1.0:
        raise ValueError(f"search_window: share {share}: need 0-1")
    try:
        devs = sizing.devices_of(rlog)
    except LogParseError as e:
        res.check(f"{what}the resident server's log gives its KV", False, str(e))
        return None
    devs = [replace(d, kv_mib=d.kv_mib * share) for d in devs]
    kv_mib = sum(d.kv_mib for d in devs)
    label = what.rstrip(": ").replace(" ", "-") + "-" if what else ""
    _, plog = boot(f"{label}probe-vt1", "1")
    if plog.draft_refused:  # patch 0096: the draft's part comes first; probe the main context with 1 MiB above it
        over = {d: need + 1 for d, need in plog.draft_refused.items()}
        vt = sizing.target_arg([over.get(d.device, 1) for d in devs])
        _, plog = boot(f"{label}probe-vt{vt}", vt)
    try:
        fixed = probe_fixed(plog, [d.device for d in devs])
    except (WindowRefused, LogParseError) as e:
        res.check(f"{what}a --vram-target 1 boot gives the engine's fixed part", False, str(e))
        return None
    args: dict[int, str] = {}

    def attempt(t: int) -> tuple[bool, logparse.Window | None]:
        args[t] = sizing.target_arg(sizing.targets(fixed, devs, t))
        ok, wlog = boot(f"{label}size-vt{args[t]}", args[t])
        ok, win = window_outcome(wlog, ok)
        return ok, win if which is None else which(wlog)

    try:
        t, win = search_vram_target(attempt, 0.5 * kv_mib, kv_mib, lo=MIN_TAIL, hi=0.9, tries=5)
    except WindowRefused as e:
        res.check(f"{what}window mode is not refused", False, str(e))
        return None
    if not res.check(f"{what}a --vram-target puts {MIN_TAIL:.0%}-90 % of the cells in the host tail",
                     t is not None and win is not None, f"KV {kv_mib:.0f} MiB; tries {sorted(args.values())}"):
        return None
    return args[t], win


def compare(res: GateResult, label: str, ref: list[list[dict[str, Any]]], got: list[list[dict[str, Any]]],
            n_tokens: list[list[int]]) -> list[dict[str, Any]]:
    rows = []
    for w, (wr, wg) in enumerate(zip(ref, got), 1):
        for s, (a, b) in enumerate(zip(wr, wg)):
            rows.append({"run": label, "wave": w, "slot": s, "n_prompt": n_tokens[w - 1][s],
                         "cache_n": (b.get("timings") or {}).get("cache_n"),
                         **same_answer(res, f"{label} wave {w} slot {s}", a, b, label)})
    return rows


def run(ctx: GateContext) -> GateResult:
    res, o = ctx.res, ctx.options
    if o.slots_np < 1 or o.slots_ctx < 1024 or o.slots_gen < 1 or not 0.1 <= o.slots_fill <= 0.9:
        raise UsageError(f"slots: --slots-np {o.slots_np}, --slots-ctx {o.slots_ctx}, --slots-gen {o.slots_gen}, "
                         f"--slots-fill {o.slots_fill}: need >= 1, >= 1024, >= 1 and 0.1-0.9")
    server = ctx.bin("llama-server")
    if not preflight(ctx, res, server, ("--kv-residency-mode", "--vram-target")):
        return res
    model = write_model(ctx, res)
    if model is None:
        return res
    prompts = waves(o)
    res.results["model"] = {"arch": o.slots_arch, "layers": o.slots_layers, "n_embd": o.slots_embd,
                            "n_head": o.slots_heads, "n_ff": o.slots_ff, "bytes": model.stat().st_size}
    res.results["n_ctx"], res.results["n_slots"] = o.slots_ctx, o.slots_np

    rlog, ref = serve(ctx, res, "resident", model, ["-fa", "on", "-krm", "resident"], prompts)
    if not res.check("the resident server boots and answers both waves", ref is not None,
                     rlog.context_failed or f"log {ctx.work / 'resident.log'}"):
        return res
    found = size_window(ctx, res, model, rlog)
    if found is None:
        return res
    target, _ = found
    wlog, got = serve(ctx, res, "window", model, ["-fa", "on", "-krm", "window", "--vram-target", target], prompts)
    win = wlog.window
    if not res.check("the window server boots and answers both waves", got is not None and win is not None,
                     wlog.context_failed or f"window={win}"):
        return res
    n_tokens = res.results["n_prompt_tokens"]
    cells = sum(n_tokens[-1]) + 2 * o.slots_gen * o.slots_np
    res.results["window"] = {"vram_target": target, "cells_resident": win.cells_resident, "kv_size": win.kv_size,
                             "tail_fraction": round(win.tail_fraction, 4), "host_tail_mib": win.host_tail_mib,
                             "device_mib": win.device_mib, "cells_used": cells}
    res.check("the slots' cells reach past the window into the host tail", cells > win.cells_resident,
              f"about {cells} cells used, window C = {win.cells_resident} of {win.kv_size}")
    rows = compare(res, "window", ref, got, n_tokens)

    dlog, dflt = serve(ctx, res, "default", model, [], prompts)
    line = dlog.residency
    res.results["default_residency"] = None if line is None else f"{line.origin} -> {line.to}: {line.detail}"
    if res.check("the packaged default boots and answers both waves", dflt is not None,
                 dlog.context_failed or f"log {ctx.work / 'default.log'}"):
        rows += compare(res, "default", ref, dflt, n_tokens)
    if o.slots_nextn:
        model_mtp = write_model(ctx, res, o.slots_nextn)
        if model_mtp is not None:
            rows += mtp_runs(ctx, res, model_mtp, prompts, target, n_tokens)
    res.results["rows"] = rows
    return res


def mtp_runs(ctx: GateContext, res: GateResult, model: Path, prompts: list[list[str]], target: str,
             n_tokens: list[list[int]]) -> list[dict[str, Any]]:
    """Speculative decoding with the model's MTP head (--spec-type draft-mtp), window against resident.

    The draft context has a budget of its own (a --vram-target would give it room for its whole KV), so the
    window run has none: a ballast leaves free the window run's --vram-target plus --slots-mtp-room MiB, the
    main window leaves the draft's measured memory free (patch 0096: its compute buffers, a stand-in KV of
    min(n_ctx, 4096) cells and what its sizer holds back), and the draft context sizes its own window in what
    is left (patch 0090). The main cache gets a host tail; the draft's gets one where its KV is larger than that
    room, and is fully resident (a note says so) where it fits."""
    from rollkv_dist import ballast

    o = ctx.options
    mtp = ["-fa", "on", "--spec-type", "draft-mtp"]
    _, ref = serve(ctx, res, "resident-mtp", model, [*mtp, "-krm", "resident"], prompts)
    if not res.check("the resident server with the MTP draft boots and answers both waves", ref is not None,
                     f"log {ctx.work / 'resident-mtp.log'}"):
        return []
    if "," in target:
        res.check("the MTP window run has one GPU (its ballast holds one device)", False, f"--vram-target {target}")
        return []
    leave = int(target) + o.slots_mtp_room
    with ballast.Ballast(leave, env=ctx.child_env(), log_path=ctx.work / "ballast.log") as b:
        res.results["mtp_ballast"] = {"leave_free_mib": leave, "held_mib": b.held_mib, "free_mib": b.free_mib}
        wlog, got = serve(ctx, res, "window-mtp", model, [*mtp, "-krm", "window"], prompts)
    caches = wlog.caches
    if not res.check("the window server with the MTP draft boots and answers both waves", got is not None,
                     wlog.context_failed or f"log {ctx.work / 'window-mtp.log'}"):
        return []
    res.results["mtp_windows"] = [{"kv_size": w.kv_size, "cells_resident": w.cells_resident,
                                   "tail_fraction": round(w.tail_fraction, 4), "host_tail_mib": w.host_tail_mib}
                                  for w in caches]
    windows = f"windows {[(w.cells_resident, w.kv_size) for w in caches]}"
    res.check("the MTP run's main cache has a host tail", bool(caches) and not caches[0].fully_resident, windows)
    if res.check("the MTP draft context sizes its cache in window mode (a window line of its own)",
                 len(caches) >= 2, windows) and caches[-1].fully_resident:
        d = caches[-1]
        res.notes.append(f"the MTP draft's cache ({d.kv_size} cells, {d.device_mib:.0f} MiB) fit the room the main "
                         f"window left it, so it is fully resident: no draft tail at this size")
    return compare(res, "window-mtp", ref, got, n_tokens)


def report_rows(results: dict[str, Any]) -> list[str]:
    rows = results.get("rows") or []
    m, w = results.get("model") or {}, results.get("window") or {}
    out = []
    if m:
        out.append(model_line(m, f"-c {results.get('n_ctx')}, -np {results.get('n_slots')} --kv-unified."))
    if w:
        out.append(f"Window: C = {w['cells_resident']} of {w['kv_size']} cells ({100 * w['tail_fraction']:.0f} % in "
                   f"the host tail, {w['host_tail_mib']:.0f} MiB) at --vram-target {w['vram_target']}; about "
                   f"{w['cells_used']} cells used.")
    for i, mw in enumerate(results.get("mtp_windows") or []):
        out.append(f"MTP run, {'main' if i == 0 else 'draft'} cache: C = {mw['cells_resident']} of {mw['kv_size']} "
                   f"({100 * mw['tail_fraction']:.0f} % in the host tail).")
    if results.get("default_residency"):
        out.append(f"Packaged default: {results['default_residency']}.")
    if rows:
        out += ["", "| run | wave | slot | prompt tokens | cached tokens | tokens | log-probs | max abs diff |",
                "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            out.append(f"| {r['run']} | {r['wave']} | {r['slot']} | {r['n_prompt']} | {r['cache_n']} | "
                       f"{'equal' if r['tokens_equal'] else 'DIFFER'} | {r['n_logprobs']} | {r['max_abs_diff']} |")
    return out


GATE = Gate(name=NAME, order=36, run=run, options=Options, report_rows=report_rows, binaries=BINARIES)
