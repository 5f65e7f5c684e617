"""archs: every architecture of the pin's own fixture runs under the packaged default, and window
mode gives resident's logits wherever the model's memory takes a window.

The models come from upstream's `tests/test-llama-archs.cpp`, which with `-o DIR` writes one random
model per architecture and MoE variant the pin knows (`<arch>-dense.gguf`, `<arch>-moe.gguf`;
n_embd 256, 2 layers, the "test" tokenizer of 5 characters a token). The writer is the build's own
`test-llama-archs` when it has one (`rollkv build --targets ...,test-llama-archs
--cmake-arg=-DLLAMA_BUILD_TESTS=ON` on a tree packed `--with-tests`), else `--archs-writer`, else
the gate builds it for the CPU from --llama-tree (a `rollkv source` tree keeps tests/).

Per model, with llama-logits-dump, a prompt of about 6000 tokens, -c 8192 and 8 greedy tokens:

1. resident (`-krm resident -fa on`): the reference. Where it fails the failure is upstream's
   (diffusion models, learned positions past n_ctx_train): a note, no check. The same run with
   LLAMA_KV_STAGE_EVERY_CELL=1 (patch 0007: every cache of every memory type reads staged copies,
   the prefetch included, on any backend) must give identical logits;
2. the packaged default (no residency or flash-attention flag): it must load and decode, with
   finite logits. Its `kv residency:` line (patch 0090) names the model's memory and whether it
   took a window;
3. where it did, window mode with at least 40 % of the cells in the host tail and the prompt
   reaching past the window (a `--vram-target 1` probe gives the engine's fixed part, sizing.py):
   logits bit-identical to 1 (max |diff| 0) and the same greedy tokens. A model whose KV tensors are
   too small for a tail at -c 8192 (one 2 MiB granule holds them) runs again at -c 32768 with a
   prompt 4x longer, and at -c 131072 while a cache with layers grew (DeepSeek-V4's CSA cache holds a
   quarter of the positions);
4. the same pair with `--kv-shift 512 --state-roundtrip`; where the memory cannot shift (sliding
   windows, recurrent state, M-RoPE: llama-logits-dump says so), with `--state-roundtrip` alone;
5. for the models `--archs-fa-off` matches (one plain, one iSWA and one hybrid memory by default), the
   pair of 3 again with `-fa off`: V is then stored transposed, stays whole in device memory and K
   alone takes the window (patch 0093; the engine says so per device), and the logits must again be
   bit-identical. Grok, whose flash attention upstream forces off, runs 3 and 4 that way.

A model whose attention layers are all sliding-window ones (the fixture's 2-layer LFM2) has an empty
full cache: its SWA cache stays resident by design, so no tail exists (a note).

With --archs-default-only the gate runs 1 and 2 alone for every model (CI does so on the CPU build with the CPU
standing in for a GPU, patch 0092, so auto's window path runs for every architecture).

A memory with an attention KV cache that takes no window fails its check (window mode must cover
every such memory); recurrent state alone has nothing to window (a note). Models run `--archs-jobs`
at a time; each row of `results.rows` is {arch, memory, resident_ok, auto_ok, window_tail_mib,
tail_fraction, max_abs_diff, tokens_equal, shift_max_abs_diff, shift_tokens_equal (shifted: whether
the pair shifted, or only round-tripped the state), note}, also
written to `archs.json` in the gate's work folder.
"""

from __future__ import annotations

import json
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollkv_dist import log
from rollkv_dist.errors import LogParseError, UsageError
from rollkv_dist.gates import logparse, sizing
from rollkv_dist.gates.base import Gate, option
from rollkv_dist.gates.context import (LOG_ARGS, GateContext, GateResult, find_test_program, preflight, run_timeout_option)
from rollkv_dist.gates.sizing import WindowRefused, probe_fixed, search_vram_target, window_outcome
from rollkv_dist.gates.process import run_logged
from rollkv_dist.gates.resident_parity import compare, make_prompt

NAME = "archs"
BINARIES = ("llama-logits-dump",)
WRITER = "test-llama-archs"
KV_SHIFT = 512
MIN_TAIL = 0.4  # fraction of the cells in the host tail
WORDS_PER_CTX = 5000 / 8192  # ~6000 tokens of the test tokenizer at -c 8192
LARGE_CTX_FACTOR = 4
MAX_CTX_STEPS = 2  # -c up to 16x --archs-ctx, while a cache with layers grows with it
NO_ATTN_KV = "no attention KV cache"  # how patch 0090 names a memory with nothing to window
STAGE_EVERY_CELL = "LLAMA_KV_STAGE_EVERY_CELL"  # patch 0007: the staging graph on any backend
CANNOT_SHIFT = "this model's memory cannot shift"  # llama-logits-dump (0011) where the memory has no K-shift
FA_OFF_MODELS = r"^(llama|gemma3|qwen35)-dense$"  # a plain, an iSWA and a hybrid memory, whose V -fa off transposes


def writer_option() -> Any:
    """--archs-writer, which every gate that writes fixture models shares."""
    return option("the fixture's test-llama-archs program (default: the build's, else built for the CPU from "
                  "--llama-tree)", metavar="PATH")


@dataclass(frozen=True)
class Options:
    archs_filter: str = option("regular expression: only the fixture models whose name (<arch>-dense, "
                               "<arch>-moe) it matches", "")
    archs_ctx: int = option("context (-c) of the runs; a model without a tail there runs again at 4x", 8192)
    archs_gen: int = option("greedy tokens generated after the prompt", 8)
    archs_jobs: int = option("models run at a time", 8)
    archs_fa_off: str = option("regular expression: the models whose window pair runs again with -fa off (V "
                               "transposed, K alone in the window); '' for none", FA_OFF_MODELS)
    archs_writer: str | None = writer_option()
    archs_default_only: bool = option("run only 1 and 2 for every model (resident, then the packaged default: loads "
                                      "and decodes), no staging graph and no window pairs", False)
    run_timeout: float = run_timeout_option()


def find_writer(ctx: GateContext) -> Path:
    """The build's test-llama-archs, --archs-writer, or one built for the CPU from --llama-tree."""
    return find_test_program(ctx, WRITER, ctx.options.archs_writer, "cpu", option="--archs-writer")


def write_models(ctx: GateContext, res: GateResult, writer: Path) -> list[Path]:
    out = ctx.work / "models"
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.gguf"):
        old.unlink()
    with log.step(f"Writing the fixture's models ({writer.name} -o {out})"):
        p = run_logged([writer, "-o", out], ctx.work / "writer", ctx.options.run_timeout, env=ctx.child_env(),
                       result=res)
    models = sorted(out.glob("*.gguf"))
    flt = re.compile(ctx.options.archs_filter) if ctx.options.archs_filter else None
    chosen = [m for m in models if flt is None or flt.search(m.stem)]
    res.check(f"{writer.name} writes the fixture's models", p.rc == 0 and bool(models),
              f"rc={p.rc} timed_out={p.timed_out}, {len(models)} models; log {p.stdout_path}")
    if flt is not None:
        res.check(f"--archs-filter {ctx.options.archs_filter!r} matches a model", bool(chosen),
                  f"{len(chosen)} of {len(models)} models")
    return chosen


def describe_outcome(h: dict[str, Any]) -> str:
    """One search attempt (search_vram_target's history) in words: the main cache's window or the failure."""
    w = h["window"]
    if not h["ok"]:
        return "failed to boot"
    if w is None:
        return "no window line"
    if w["fully_resident"]:
        return f"fully resident ({w['kv_size']} cells)"
    return f"{w['cells_resident']} of {w['kv_size']} cells on the device ({w['host_tail_mib']} MiB tail)"


def only_sliding_window(log: logparse.LlamaLog, n_ctx: int) -> bool:
    """Every cache of n_ctx cells has no layer: the attention layers are all sliding-window ones (an iSWA memory
    whose full cache is empty, as the fixture's 2-layer LFM2 is), and the SWA cache stays resident by design."""
    full = [c for c in log.kv_caches if c[1] >= n_ctx]
    return bool(full) and all(layers == 0 for _, _, layers in full)


def grows_with_context(smaller: logparse.LlamaLog, larger: logparse.LlamaLog) -> bool:
    """A cache with layers has more cells in the run at the larger context: more context gives it larger
    tensors (a sliding-window cache keeps its size)."""
    before = sorted(cells for _, cells, layers in smaller.kv_caches if layers > 0)
    after = sorted(cells for _, cells, layers in larger.kv_caches if layers > 0)
    return len(before) == len(after) and any(b > a for a, b in zip(before, after))


def _kind(memory: str | None) -> str:
    if memory is None:
        return "unknown"
    return "none" if memory.startswith("none") or NO_ATTN_KV in memory else "attention"


class _Model:
    """One fixture model's runs; its own GateResult (checks, commands) is merged in model order."""

    def __init__(self, ctx: GateContext, dump: Path, model: Path) -> None:
        self.ctx, self.dump, self.model = ctx, dump, model
        self.name = model.stem
        self.work = ctx.work / self.name
        self.res = GateResult(gate=NAME, gpu=None)
        self.row: dict[str, Any] = {"arch": self.name, "memory": None, "resident_ok": False, "auto_ok": False,
                                    "window_tail_mib": None, "tail_fraction": None, "max_abs_diff": None,
                                    "tokens_equal": None, "shift_max_abs_diff": None, "shift_tokens_equal": None,
                                    "staged_max_abs_diff": None, "fa_off_tail_fraction": None,
                                    "fa_off_max_abs_diff": None, "fa_off_tokens_equal": None,
                                    "note": ""}
        self.notes: list[str] = []

    def args(self, n_ctx: int, prompt: Path, extra: list[str]) -> list[str]:
        return [self.dump, "-m", self.model, "-f", prompt, "-n", str(self.ctx.options.archs_gen), "-c", str(n_ctx),
                *extra, *LOG_ARGS]

    def run(self, tag: str, n_ctx: int, prompt: Path, extra: list[str]) -> tuple[Any, logparse.LlamaLog, Path]:
        prefix = self.work / tag
        p = run_logged([*self.args(n_ctx, prompt, extra), "--logits-out", prefix], prefix,
                       self.ctx.options.run_timeout, env=self.ctx.child_env(), result=self.res)
        try:
            parsed = logparse.parse_log(p.log, source=str(p.stdout_path))
        except LogParseError as e:
            # a line the parser does not know fails the gate (as every gate does): the checks that read this log
            # would otherwise be skipped, and a run without them must not pass
            self.res.check(f"{self.name}: the {tag} run's log parses", False, str(e))
            parsed = logparse.LlamaLog(source=str(p.stdout_path))
        return p, parsed, prefix

    def prompt(self, n_ctx: int) -> Path:
        path = self.ctx.work / f"prompt-{n_ctx}.txt"
        if not path.is_file():  # written once per context before the models run (see run())
            raise RuntimeError(f"{path} was not written")
        return path

    def go(self) -> None:
        o, name = self.ctx.options, self.name
        n_ctx = o.archs_ctx
        ref = ["-fa", "on", "-ngl", "99", "--kv-unified"]
        r, rlog, rp = self.run("resident", n_ctx, self.prompt(n_ctx), [*ref, "-krm", "resident"])
        self.row["resident_ok"] = r.rc == 0
        d, dlog, dp = self.run("default", n_ctx, self.prompt(n_ctx), [])
        if r.rc == 0 and not o.archs_default_only:
            self.staged(n_ctx, ref, rp)
        res_line = dlog.residency
        self.row["memory"] = res_line.memory if res_line else None
        if r.rc != 0:
            why = rlog.context_failed or f"rc={r.rc}"
            self.notes.append(f"upstream: resident fails too ({why}); log {r.stdout_path}")
            self.row["auto_ok"] = d.rc == 0
            return
        ok = d.rc == 0 and dp.with_suffix(".json").is_file()
        if ok:
            meta = json.loads(dp.with_suffix(".json").read_text())
            cmp = compare(rp, dp)  # shapes and finiteness (flash attention may differ: no identity asked)
            ok = cmp["finite"] and meta.get("n_rows") == o.archs_gen + 1
        self.row["auto_ok"] = ok
        self.res.check(f"{name}: the packaged default loads and decodes", ok,
                       f"rc={d.rc}; {dlog.context_failed or ''} log {d.stdout_path}")
        if res_line is None or res_line.to != "window":
            kind = _kind(self.row["memory"])
            why = res_line.detail if res_line else "no `kv residency:` line"
            if kind == "attention":
                self.res.check(f"{name}: its memory takes a window", False, why)
            else:  # nothing to window, or a requirement of window mode decided (e.g. the KV not offloaded)
                self.notes.append(f"no window: {why}")
            if kind == "none" and not o.archs_default_only:
                self.explicit_window_runs_resident(n_ctx, ref)
            return
        if not o.archs_default_only:
            self.window(n_ctx, ref, rlog, rp)

    def staged(self, n_ctx: int, ref: list[str], rp: Path) -> None:
        """The staging graph (patch 0007: every layer of every cache reads a staged copy, the prefetch included,
        as if all of its cells were in a host tail; any backend) against the plain resident run: identical."""
        prefix = self.work / "staged"
        env = {**self.ctx.child_env(), STAGE_EVERY_CELL: "1"}
        p = run_logged([*self.args(n_ctx, self.prompt(n_ctx), [*ref, "-krm", "resident"]), "--logits-out", prefix],
                       prefix, self.ctx.options.run_timeout, env=env, result=self.res, show_env=(STAGE_EVERY_CELL,))
        ok = p.rc == 0 and prefix.with_suffix(".json").is_file()
        cmp = compare(rp, prefix) if ok else {}
        self.row["staged_max_abs_diff"] = cmp.get("max_abs_diff")
        self.res.check(f"{self.name}: the staging graph ({STAGE_EVERY_CELL}=1) gives the resident logits",
                       ok and cmp["finite"] and cmp.get("max_abs_diff") == 0.0 and cmp["tokens_equal"],
                       f"rc={p.rc}, max_abs_diff={cmp.get('max_abs_diff')}; log {p.stdout_path}")

    def explicit_window_runs_resident(self, n_ctx: int, ref: list[str]) -> None:
        """A memory with nothing to window runs resident under an explicit -krm window too, saying so."""
        w, wlog, _ = self.run("window-explicit", n_ctx, self.prompt(n_ctx), [*ref, "-krm", "window"])
        line = wlog.residency
        self.res.check(f"{self.name}: -krm window runs resident, with a line", w.rc == 0 and line is not None
                       and line.origin == "window" and line.to == "resident",
                       f"rc={w.rc}; line={line}; log {w.stdout_path}")

    def window(self, n_ctx: int, ref: list[str], rlog: logparse.LlamaLog, rp: Path) -> None:
        name = self.name
        found = self.size_window(n_ctx, ref, rlog)
        grew = False  # a cache with layers grew with the context: not a sliding-window-only memory
        for step in range(1, MAX_CTX_STEPS + 1):
            if found is not None:
                break
            # one granule holds a whole K/V tensor at this context: more cells, while a cache with layers grows
            # with the context (a cache of a fraction of the positions, as DeepSeek-V4's CSA cache, needs more)
            prev = rlog
            n_ctx *= LARGE_CTX_FACTOR
            tag = "resident-large" if step == 1 else f"resident-x{LARGE_CTX_FACTOR ** step}"
            r, rlog, rp = self.run(tag, n_ctx, self.prompt(n_ctx), [*ref, "-krm", "resident"])
            if r.rc != 0:
                self.res.check(f"{name}: resident at -c {n_ctx} (for a tail)", False, f"rc={r.rc}; log {r.stdout_path}")
                return
            self.notes.append(f"-c {n_ctx}: no tail of >= {MIN_TAIL:.0%} at -c {n_ctx // LARGE_CTX_FACTOR}")
            found = self.size_window(n_ctx, ref, rlog)
            grows = grows_with_context(prev, rlog)
            grew = grew or grows
            if found is None and not grows:
                break
        if found is None and not grew and only_sliding_window(rlog, n_ctx):
            self.notes.append(f"no tail: every attention layer is a sliding-window layer, whose cache stays resident "
                              f"(the full cache of {n_ctx} cells has no layer)")
            return
        if not self.res.check(f"{name}: a window with >= {MIN_TAIL:.0%} of the cells in the host tail", found is not None,
                              f"-c {n_ctx}: " + ("no --vram-target gave one" if found is None else
                                                 f"{found[1].kv_size - found[1].cells_resident} of {found[1].kv_size} "
                                                 f"cells at --vram-target {found[0]}")):
            return
        target, win, wp, wlog = found
        if wlog.v_on_device_mib:  # flash attention off whatever -fa says (upstream forces it off for Grok)
            self.notes.append("flash attention is off: V stays in device memory, K alone takes the window")
        self.row.update(window_tail_mib=win.host_tail_mib, tail_fraction=round(win.tail_fraction, 4), n_ctx=n_ctx,
                        vram_target=target)
        cmp = compare(rp, wp)
        self.row.update(max_abs_diff=cmp.get("max_abs_diff"), tokens_equal=cmp["tokens_equal"])
        n_prompt = cmp["n_prompt"][1] or 0
        self.res.check(f"{name}: the prompt reaches into the host tail", n_prompt > win.cells_resident,
                       f"n_prompt={n_prompt}, window C={win.cells_resident}")
        self.res.check(f"{name}: window logits identical to resident (max |diff| == 0)",
                       cmp["finite"] and cmp.get("max_abs_diff") == 0.0,
                       f"max_abs_diff={cmp.get('max_abs_diff')}, n_diff={cmp.get('n_diff')}")
        self.res.check(f"{name}: greedy tokens identical", cmp["tokens_equal"])
        self.shift_state(n_ctx, ref, target)
        if self.ctx.options.archs_fa_off and re.search(self.ctx.options.archs_fa_off, name):
            self.fa_off(n_ctx)

    def fa_off(self, n_ctx: int) -> None:
        """The window pair with -fa off (patch 0093): V transposed stays whole on the device, K alone takes the
        window; the logits are still resident's, bit for bit."""
        name, ref = f"{self.name} -fa off", ["-fa", "off", "-ngl", "99", "--kv-unified"]
        r, rlog, rp = self.run(f"resident-{n_ctx}-fa-off", n_ctx, self.prompt(n_ctx), [*ref, "-krm", "resident"])
        if not self.res.check(f"{name}: resident runs", r.rc == 0, f"rc={r.rc}; log {r.stdout_path}"):
            return
        found = self.size_window(n_ctx, ref, rlog, tag="fa-off-")
        if not self.res.check(f"{name}: a window with >= {MIN_TAIL:.0%} of the cells in the host tail",
                              found is not None, f"-c {n_ctx}: no --vram-target gave one" if found is None else ""):
            return
        _, win, wp, wlog = found
        cmp = compare(rp, wp)
        self.row.update(fa_off_tail_fraction=round(win.tail_fraction, 4), fa_off_max_abs_diff=cmp.get("max_abs_diff"),
                        fa_off_tokens_equal=cmp["tokens_equal"])
        self.res.check(f"{name}: V stays in device memory and K alone takes the window", bool(wlog.v_on_device_mib),
                       f"V kept whole: {wlog.v_on_device_mib or 'no line'}; window {win}")
        self.res.check(f"{name}: window logits identical to resident (max |diff| == 0)",
                       cmp["finite"] and cmp.get("max_abs_diff") == 0.0,
                       f"max_abs_diff={cmp.get('max_abs_diff')}, n_diff={cmp.get('n_diff')}")
        self.res.check(f"{name}: greedy tokens identical", cmp["tokens_equal"])

    def size_window(self, n_ctx: int, ref: list[str], rlog: logparse.LlamaLog, tag: str = ""
                    ) -> tuple[str, logparse.Window, Path, logparse.LlamaLog] | None:
        """(--vram-target, window, dump prefix, log) of a window run with a tail of >= MIN_TAIL, or None; tag
        prefixes the runs' names."""
        prompt = self.prompt(n_ctx)
        try:
            devs = sizing.devices_of(rlog)
        except LogParseError as e:
            self.notes.append(f"-c {n_ctx}: {e}")
            return None
        kv_mib = sum(dv.kv_mib for dv in devs)
        _, plog, _ = self.run(f"{tag}probe-{n_ctx}", n_ctx, prompt, [*ref, "-krm", "window", "--vram-target", "1"])
        try:
            fixed = probe_fixed(plog, [dv.device for dv in devs])
        except (WindowRefused, LogParseError) as e:
            self.notes.append(f"-c {n_ctx}: {e}")
            return None
        prefixes: dict[int, tuple[str, Path, logparse.LlamaLog]] = {}

        def attempt(t: int) -> tuple[bool, logparse.Window | None]:
            arg = sizing.target_arg(sizing.targets(fixed, devs, t))
            w, wlog, wp = self.run(f"{tag}window-{n_ctx}-vt{arg}", n_ctx, prompt,
                                   [*ref, "-krm", "window", "--vram-target", arg])
            prefixes[t] = (arg, wp, wlog)
            return window_outcome(wlog, w.rc == 0)

        tried: list[dict[str, Any]] = []
        try:
            t, win = search_vram_target(attempt, 0.4 * kv_mib, kv_mib, lo=MIN_TAIL, hi=0.9, tries=5, history=tried)
        except WindowRefused as e:
            self.notes.append(f"-c {n_ctx}: {e}")
            return None
        if t is None or win is None:
            # what each target gave, so that a report says why no window was found
            self.notes.append(f"-c {n_ctx}: tried " + ", ".join(
                f"--vram-target {prefixes[h['vram_target']][0]}: {describe_outcome(h)}" for h in tried))
            return None
        arg, wp, wlog = prefixes[t]
        return arg, win, wp, wlog

    def shift_state(self, n_ctx: int, ref: list[str], target: str) -> None:
        """The pair with --kv-shift and --state-roundtrip; where the memory cannot shift (llama-logits-dump says
        so), the state round trip alone."""
        extra = ["--kv-shift", str(KV_SHIFT), "--state-roundtrip"]
        r, _, rp = self.run(f"resident-{n_ctx}-shift", n_ctx, self.prompt(n_ctx), [*ref, *extra, "-krm", "resident"])
        tag, shift = f"{self.name} shift+state", KV_SHIFT
        if r.rc != 0 and CANNOT_SHIFT in r.log:
            self.notes.append("the memory cannot shift: the state round trip alone")
            extra, tag, shift = ["--state-roundtrip"], f"{self.name} state", 0
            r, _, rp = self.run(f"resident-{n_ctx}-state", n_ctx, self.prompt(n_ctx), [*ref, *extra, "-krm", "resident"])
        if r.rc != 0:
            self.notes.append(f"{tag}: resident fails (rc={r.rc}); log {r.stdout_path}")
            return
        w, wlog, wp = self.run(f"window-{n_ctx}-{'shift' if shift else 'state'}", n_ctx, self.prompt(n_ctx),
                               [*ref, *extra, "-krm", "window", "--vram-target", target])
        if not self.res.check(f"{tag}: window run succeeds", w.rc == 0, f"rc={w.rc}; log {w.stdout_path}"):
            return
        win = wlog.window
        cmp = compare(rp, wp)
        self.row.update(shift_max_abs_diff=cmp.get("max_abs_diff"), shift_tokens_equal=cmp["tokens_equal"],
                        shifted=bool(shift))
        self.res.check(f"{tag}: a host tail", win is not None and not win.fully_resident, f"window={win}")
        self.res.check(f"{tag}: logits identical (max |diff| == 0)", cmp["finite"] and cmp.get("max_abs_diff") == 0.0,
                       f"max_abs_diff={cmp.get('max_abs_diff')}, n_diff={cmp.get('n_diff')}")
        self.res.check(f"{tag}: greedy tokens identical", cmp["tokens_equal"])
        self.res.check(f"{tag}: both dumps did {'the shift and ' if shift else ''}the round trip",
                       cmp["kv_shift"] == [shift, shift] and cmp["state_roundtrip"] == [True, True],
                       f"kv_shift={cmp['kv_shift']}, state_roundtrip={cmp['state_roundtrip']}")


def run(ctx: GateContext) -> GateResult:
    res, o = ctx.res, ctx.options
    if o.archs_jobs < 1 or o.archs_ctx < 512 or o.archs_gen < 1:
        raise UsageError(f"archs: --archs-jobs {o.archs_jobs}, --archs-ctx {o.archs_ctx}, --archs-gen {o.archs_gen}: "
                         "need >= 1, >= 512 and >= 1")
    for flag, rx in (("--archs-filter", o.archs_filter), ("--archs-fa-off", o.archs_fa_off)):
        try:
            re.compile(rx)
        except re.error as e:
            raise UsageError(f"archs: {flag} {rx!r} is not a regular expression: {e}") from e
    dump = ctx.bin("llama-logits-dump")
    if not preflight(ctx, res, dump, ("--logits-out", "--kv-shift", "--state-roundtrip")):
        return res
    models = write_models(ctx, res, find_writer(ctx))
    if not models:
        return res
    for n_ctx in (o.archs_ctx * LARGE_CTX_FACTOR ** k for k in range(MAX_CTX_STEPS + 1)):
        (ctx.work / f"prompt-{n_ctx}.txt").write_text(make_prompt(int(WORDS_PER_CTX * n_ctx)))
    runs = [_Model(ctx, dump, m) for m in models]
    bar = log.progress("archs: models done", total=len(runs))
    with ThreadPoolExecutor(max_workers=o.archs_jobs) as pool:
        futures = {pool.submit(m.go): m for m in runs}
        for i, fut in enumerate(as_completed(futures), 1):
            m = futures[fut]
            try:
                fut.result()
            except (OSError, ValueError, subprocess.SubprocessError) as e:  # one model's crash is its row
                m.res.check(f"{m.name}: the gate's runs completed", False, f"{type(e).__name__}: {e}")
            bar.update(i)
    bar.finish()
    rows = []
    for m in runs:  # model order, whatever the order they finished in
        m.row["note"] = "; ".join(m.notes)
        rows.append(m.row)
        res.checks += m.res.checks
        res.commands += m.res.commands
        res.logs += m.res.logs
    res.results["rows"] = rows
    res.results["summary"] = summarize(rows)
    (ctx.work / "archs.json").write_text(json.dumps(rows, indent=1) + "\n")
    return res


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts over the rows: what the issue's "done means" asks for, in numbers."""
    resident = [r for r in rows if r["resident_ok"]]
    windowed = [r for r in resident if r["max_abs_diff"] is not None]
    return {
        "models": len(rows),
        "resident_ok": len(resident),
        "upstream_failures": sorted(r["arch"] for r in rows if not r["resident_ok"]),
        "auto_fails_where_resident_runs": sorted(r["arch"] for r in resident if not r["auto_ok"]),
        "window_exact": len([r for r in windowed if r["max_abs_diff"] == 0.0 and r["tokens_equal"]]),
        "window_not_exact": sorted(r["arch"] for r in windowed if not (r["max_abs_diff"] == 0.0 and r["tokens_equal"])),
        "no_window": sorted(r["arch"] for r in resident if r["max_abs_diff"] is None),
        "fa_off_exact": sorted(r["arch"] for r in rows if r.get("fa_off_max_abs_diff") == 0.0
                               and r.get("fa_off_tokens_equal")),
    }


def report_rows(results: dict[str, Any]) -> list[str]:
    rows = results.get("rows") or []
    if not rows:
        return []
    s = results.get("summary") or summarize(rows)
    out = [f"{s['models']} models: resident runs {s['resident_ok']}; the packaged default fails where resident runs: "
           f"{len(s['auto_fails_where_resident_runs'])}; window exact with a tail: {s['window_exact']}; no window: "
           f"{len(s['no_window'])}; upstream failures (resident fails too): {len(s['upstream_failures'])}; "
           f"-fa off window (K alone) exact: {', '.join(s.get('fa_off_exact', [])) or 'none run'}", "",
           "| arch | memory | resident | default | tail % | tail MiB | max abs diff | tokens | shift+state diff | "
           "-fa off diff | note |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]

    def f(v: Any) -> str:
        return "-" if v is None else str(v)

    for r in rows:
        tail = "-" if r["tail_fraction"] is None else f"{100 * r['tail_fraction']:.0f}"
        out.append(f"| {r['arch']} | {f(r['memory'])} | {'ok' if r['resident_ok'] else 'FAIL'} | "
                   f"{'ok' if r['auto_ok'] else 'FAIL'} | {tail} | {f(r['window_tail_mib'])} | {f(r['max_abs_diff'])} | "
                   f"{'equal' if r['tokens_equal'] else '-' if r['tokens_equal'] is None else 'DIFFER'} | "
                   f"{f(r['shift_max_abs_diff'])} | {f(r.get('fa_off_max_abs_diff'))} | {r['note'].replace('|', '/')} |")
    return out


GATE = Gate(name=NAME, order=35, run=run, options=Options, report_rows=report_rows, binaries=BINARIES)
