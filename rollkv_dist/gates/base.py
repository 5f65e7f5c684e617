"""What a gate is, and the registry of gates.

A gate is one module in this package that defines ``GATE = Gate(...)``:

- ``name``: what `--gates`, `ROLLKV_GATES`, the reports and the nox ids call it;
- ``order``: its place in the default list (`--gates all`, `nox -s gpu_gates`);
- ``options``: a frozen dataclass of its options, every field made with ``option()``. The
  `rollkv gates` flags are generated from these dataclasses (one flag per field name; gates that
  share a field share its flag), a value no gate has is a UsageError, and a gate reads its options
  as attributes (`ctx.options.reps`), so a misspelt name is an AttributeError, never a default;
- ``run(ctx) -> GateResult``: runs against ``ctx`` (rollkv_dist.gates.context.GateContext), fills
  ``ctx.result`` and returns it;
- ``report_rows(results) -> list[str]``: the Markdown the gate's report shows below its checks;
- ``binaries``: the programs of the build it runs (checked before any gate runs, as are those of
  the extra builds in ``needs``);
- ``needs``: inputs beyond `--build` (``BASELINE_BUILD``, ``UPSTREAM_BUILD``, ``GEMMA``), which nox
  makes when the environment does not name them;
- ``multi_gpu``: it also has an all-GPU run (every GPU in one process, layer split:
  `rollkv gates --split-gpus`, the `gpu_gates(<gate>-all-<artifact>)` entries).

The registry finds the gates by importing the package's modules: adding a gate is one new file
(and its test).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import pkgutil
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rollkv_dist.errors import UsageError

# inputs a gate may need beyond --build (GateContext attribute = `rollkv gates` option dest)
BASELINE_BUILD = "baseline_build"  # the series before its compute-reserve patch (rollkv source --before)
UPSTREAM_BUILD = "upstream_build"  # the pin with no patch
GEMMA = "gemma"  # Gemma 3 270M GGUF


def option(help: str, default: Any = None, *, flag: str | None = None, metavar: str | None = None,
           choices: Iterable[str] | None = None) -> Any:
    """A field of a gate's options dataclass: its default, and what its `rollkv gates` flag says.
    The flag is `--<name with dashes>` unless `flag` names it; a bool that defaults to True needs
    a `flag` (a switch that turns it off)."""
    meta = {"help": help, "flag": flag, "metavar": metavar, "choices": None if choices is None else tuple(choices)}
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class NoOptions:
    """A gate without options."""


def _no_rows(results: dict[str, Any]) -> list[str]:
    return []


@dataclass(frozen=True)
class Gate:
    name: str
    order: int
    run: Callable[[Any], Any]  # (GateContext) -> GateResult
    options: type = NoOptions
    report_rows: Callable[[dict[str, Any]], list[str]] = _no_rows
    binaries: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()
    multi_gpu: bool = False

    def make_options(self, values: Mapping[str, Any]) -> Any:
        """The gate's options from `values` (option name -> value, None = the gate's default).
        Names no gate has are a UsageError (check_option_names); names of other gates' options are
        left to them; a value of the wrong type is a UsageError naming the option."""
        check_option_names(values)
        hints = typing.get_type_hints(self.options)
        mine = {}
        for f in dataclasses.fields(self.options):
            v = values.get(f.name)
            if v is None:
                continue
            mine[f.name] = _checked(f.name, v, hints[f.name], f.metadata.get("choices"))
        return self.options(**mine)


def _base_type(t: Any) -> type:
    """int for `int`, `int | None`, `Optional[int]`."""
    if isinstance(t, types.UnionType) or typing.get_origin(t) is typing.Union:
        args = [a for a in typing.get_args(t) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"option type {t} is not one type or None")
        t = args[0]
    if t not in (int, float, str, bool):
        raise TypeError(f"option type {t} is not int, float, str or bool")
    return t


def _checked(name: str, v: Any, t: Any, choices: tuple[str, ...] | None) -> Any:
    base = _base_type(t)
    ok = (isinstance(v, bool) if base is bool else
          isinstance(v, (int, float)) and not isinstance(v, bool) if base is float else
          isinstance(v, base) and not (base is int and isinstance(v, bool)))
    if not ok:
        raise UsageError(f"gate option {name}={v!r}: expected a value of type {base.__name__}")
    if choices and v not in choices:
        raise UsageError(f"gate option {name}={v!r}: choose one of {', '.join(choices)}")
    return float(v) if base is float else v


# ----------------------------------------------------------------------------- registry

_REGISTRY: dict[str, Gate] | None = None


def registry() -> dict[str, Gate]:
    """Every gate of the package (modules defining GATE), by name, in their order."""
    global _REGISTRY
    if _REGISTRY is None:
        pkg = importlib.import_module("rollkv_dist.gates")
        found: list[Gate] = []
        for m in pkgutil.iter_modules(pkg.__path__):
            mod = importlib.import_module(f"rollkv_dist.gates.{m.name}")
            gate = getattr(mod, "GATE", None)
            if isinstance(gate, Gate):
                found.append(gate)
        names = [g.name for g in found]
        if len(set(names)) != len(names):
            raise RuntimeError(f"two gates share a name: {sorted(names)}")
        _REGISTRY = {g.name: g for g in sorted(found, key=lambda g: (g.order, g.name))}
        _option_fields(_REGISTRY.values())  # two gates defining one option differently fail here
    return _REGISTRY


def get(name: str) -> Gate:
    gates = registry()
    if name not in gates:
        raise UsageError(f"unknown gate {name!r}; known: {', '.join(gates)}")
    return gates[name]


# ----------------------------------------------------------------------------- options and flags

@dataclass
class _Flag:
    name: str
    type: type
    meta: Mapping[str, Any]
    defaults: dict[str, Any] = field(default_factory=dict)  # gate -> default


def _option_fields(gates: Iterable[Gate]) -> dict[str, _Flag]:
    out: dict[str, _Flag] = {}
    for g in gates:
        hints = typing.get_type_hints(g.options)
        for f in dataclasses.fields(g.options):
            t = _base_type(hints[f.name])
            meta = dict(f.metadata)
            if t is bool and f.default is True and not meta.get("flag"):
                raise TypeError(f"gate {g.name}: option {f.name} defaults to True and needs a flag that turns it off")
            known = out.get(f.name)
            if known is None:
                out[f.name] = known = _Flag(f.name, t, meta)
            elif known.type is not t or known.meta != meta:
                raise TypeError(f"gate {g.name} defines option {f.name} unlike another gate ({known.type.__name__}, "
                                f"{known.meta}): share one definition")
            known.defaults[g.name] = f.default
    return out


def option_names() -> list[str]:
    """Every gate option's name (the `rollkv gates` dests the gates read)."""
    return list(_option_fields(registry().values()))


def check_option_names(values: Mapping[str, Any]) -> None:
    unknown = sorted(set(values) - set(option_names()))
    if unknown:
        raise UsageError(f"unknown gate option(s) {', '.join(unknown)}; known: {', '.join(sorted(option_names()))}")


def _default_text(flag: _Flag) -> str:
    if flag.type is bool:  # a switch: its help says what it turns on or off
        return ""
    vals = {g: d for g, d in flag.defaults.items() if d is not None}
    if not vals:
        return ""
    if len(set(map(repr, vals.values()))) == 1:
        return f" (default {next(iter(vals.values()))})"
    return " (default " + ", ".join(f"{d} {g}" for g, d in vals.items()) + ")"


def add_option_flags(parser: Any) -> None:
    """One flag per gate option, generated from the gates' options dataclasses. Every flag defaults
    to None (the gate's own default applies); the help names the gates and their defaults."""
    for flag in _option_fields(registry().values()).values():
        meta = flag.meta
        name = meta.get("flag") or "--" + flag.name.replace("_", "-")
        who = ", ".join(flag.defaults)
        help_ = f"{who}: {meta['help']}{_default_text(flag)}".replace("%", "%%")
        kw: dict[str, Any] = {"dest": flag.name, "default": None, "help": help_}
        if flag.type is bool:
            kw["action"] = "store_false" if any(d is True for d in flag.defaults.values()) else "store_true"
        else:
            kw["type"] = flag.type
            if meta.get("metavar"):
                kw["metavar"] = meta["metavar"]
            if meta.get("choices"):
                kw["choices"] = meta["choices"]
        parser.add_argument(name, **kw)


def option_values(args: argparse.Namespace) -> dict[str, Any]:
    """The gate options given on the command line (name -> value; flags not given are left out)."""
    return {k: getattr(args, k) for k in option_names() if getattr(args, k, None) is not None}
