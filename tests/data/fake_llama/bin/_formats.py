"""The engine's own log formats, read from the patch series (patches/*.patch, in series order).

The fake programs print their rolling-KV lines through render(), and tests/test_log_formats.py
renders every line rollkv_dist/gates/logparse.py reads from these same format strings, so a patch
that changes one of those lines fails a test instead of drifting away from the parser.

A format is found by a fragment of its C string literal on the `+` lines of the series; where a
later patch rewrites the line, its version wins (the series applied in order). Adjacent literals
("..." "...") are joined; C conversions become Python ones (%zu, %lld, %u -> %d).
"""
import functools
import re
from pathlib import Path

PATCHES = Path(__file__).resolve().parents[4] / "patches"

# name -> a fragment of the format string that identifies it
FRAGMENTS = {
    "window": "position window = %u / %u cells resident",
    "window_full": "position window = FULLY RESIDENT (",
    "budget": "-> window budget %lld MiB",
    "no_window": "no device memory left for the KV window on %s",
    "vram_target_count": "--vram-target has %zu values but the model uses",
    "refuse_gpu": "--kv-residency-mode window needs a GPU backend",
    "pass1": "kv compute reserve: pass 1 measured %s",
    "pass2_sizes": "kv compute reserve: pass 2 sizes the window",
    "pass2_done": "kv compute reserve: pass 2 done",
    "single_pass": "kv compute reserve: single pass (full KV",
    "scratch": "scratch outside the compute buffers = %.2f MiB",
    "single_pass_short": "kv compute reserve: single pass short: %s needs",
    "fixed_reserve": "kv compute reserve: fixed %.2f MiB",
    "staging": "kv tail staging = %s",
    "v_on_device": "flash attention is off, so V is stored transposed",
    "v_whole_refused": "with flash attention off, V (stored transposed, no cell prefix) stays",
    "prompt_cache_lowered": "rolling KV: prompt cache limit %s -> %lld MiB%s",
    "prompt_cache_fits": "rolling KV: prompt cache limit %d MiB fits beside",
    "draft_room": "rolling KV: leaving %lld MiB on %s for the draft (weights",
    "draft_refused": "is what the main and the draft context hold together, and",
    "residency_requirement": "kv residency: auto -> resident: %s",
    "residency_window": "kv residency: auto -> window mode: this model's memory is %s",
    "residency_resident": "kv residency: %s -> resident: this model's memory is %s, %s",
    "host_tail": "kv host tail: %.2f MiB reserved, %.2f MiB pinned%s",
    "host_tail_grow": "kv host tail: pinned %zu MiB more on %s, cells up to %u of %u backed",
    "host_tail_failed": "the KV host tail on %s needs %zu MiB more pinned host memory",
    "wt_pass": "PASS %s",
    "wt_fail": "FAIL %s: %s",
    "wt_skip": "SKIP %s: %s",
    "wt_summary": "window-test: %d device(s) with window buffers",
}

_LITERAL = re.compile(r'"((?:[^"\\]|\\.)*)"')
_CONV = re.compile(r"%([-+ #0]*\d*(?:\.\d+)?)(hh|h|ll|l|z|j|t)?([diouxXfFeEgGcs%])")


def _series() -> list[Path]:
    names = [ln.split("#", 1)[0].strip() for ln in (PATCHES / "series").read_text().splitlines()]
    return [PATCHES / n for n in names if n]


def _literals_from(lines: list[str], i: int) -> str:
    """The C string literals of the statement that starts on lines[i], joined (up to the first token
    after them that is not another literal)."""
    text = "\n".join(lines[i:i + 12])
    start = text.index('"')
    out, pos = [], start
    while True:
        m = _LITERAL.match(text, pos)
        if not m:
            break
        out.append(m.group(1))
        pos = m.end()
        nxt = re.match(r"\s*(\+\s*)?", text[pos:])  # continuation lines of the patch start with '+'
        rest = text[pos + nxt.end():]
        if not rest.startswith('"'):
            break
        pos += nxt.end()
    return bytes("".join(out), "utf-8").decode("unicode_escape")


@functools.lru_cache(maxsize=None)
def c_format(name: str) -> str:
    """The C format string of `name` (FRAGMENTS) as the series leaves it."""
    frag = FRAGMENTS[name]
    found = None
    for patch in _series():
        lines = [ln[1:] if ln.startswith("+") else None for ln in patch.read_text(errors="replace").splitlines()]
        added = [ln for ln in lines]
        hits = set()
        for i, ln in enumerate(added):
            if ln is None or frag not in ln or '"' not in ln:
                continue
            block = [x if x is not None else "" for x in added]
            hits.add(_literals_from(block, i))
        hits = {h for h in hits if frag in h}
        if len(hits) > 1:
            raise LookupError(f"{patch.name}: {len(hits)} formats contain {frag!r}: {sorted(hits)}")
        if hits:
            found = hits.pop()
    if found is None:
        raise LookupError(f"no format string with {frag!r} on the + lines of {PATCHES}")
    return found


def py_format(name: str) -> str:
    def conv(m):
        flags, _mod, c = m.groups()
        return "%" + flags + ("d" if c in "iu" else c)

    return _CONV.sub(conv, c_format(name))


def render(name: str, *args) -> str:
    """The line the engine prints for `args` (without the trailing newline)."""
    return (py_format(name) % args).rstrip("\n")
