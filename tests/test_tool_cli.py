"""The rollkv CLI: registration, error mapping, and the log output."""

from __future__ import annotations

import io
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from rollkv_dist import cli, log
from rollkv_dist.errors import PatchError


def test_command_modules_register_their_commands():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name in ("source", "patches", "build", "pack"):
        assert name in sub.choices
        assert sub.choices[name].get_default("handler") is not None or name == "patches"
    assert isinstance(cli.COMMAND_MODULES, list)
    assert all(isinstance(m, str) for m in cli.COMMAND_MODULES)


def test_every_command_is_added_one_way():
    """The `rollkv` commands and their actions are added by rollkv_dist.commands.add_command alone, and no command
    module imports the command line back (the registration style of issue 27). `python -m rollkv_dist.series`
    is a standard-library tool of its own (the recipe and the flake run it without rollkv installed)."""
    import importlib

    pkg = Path(cli.__file__).resolve().parent
    modules = [Path(importlib.import_module(m).__file__) for m in cli.COMMAND_MODULES]
    modules += sorted((pkg / "gates").glob("*.py")) + [pkg / "rebase.py"]
    direct = [f"{p.relative_to(pkg)}:{i}" for p in modules
              for i, line in enumerate(p.read_text().splitlines(), 1) if ".add_parser(" in line
              or "from rollkv_dist.cli import" in line]
    assert direct == [], direct
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert set(sub.choices) >= {"source", "patches", "build", "pack", "doctor", "model", "gates", "smoke", "recipe",
                                "channel", "docs"}
    actions = next(a for a in sub.choices["patches"]._actions if a.dest == "patches_command")
    for name in ("edit", "export", "check", "rebase"):
        assert actions.choices[name].get_default("handler") is not None, name


def _source_into_non_empty_target(tmp_path: Path) -> list[str]:
    """`rollkv source` arguments that must fail: the target holds a file (exit 6)."""
    target = tmp_path / "t"
    target.mkdir()
    (target / "x").write_text("x")
    series = tmp_path / "p"
    series.mkdir()
    (series / "series").write_text("")
    return ["source", str(target), "--patches", str(series)]


def test_error_is_one_line_with_exit_code(tmp_path, capsys):
    rc = cli.main(_source_into_non_empty_target(tmp_path))
    err = capsys.readouterr().err
    assert rc == 6
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines == [lines[-1]] and lines[-1].startswith("rollkv: error: ")
    assert "not empty" in err and "Traceback" not in err


def test_debug_shows_the_traceback(tmp_path, capsys):
    rc = cli.main(["--debug", *_source_into_non_empty_target(tmp_path)])
    assert rc == 6
    assert "Traceback" in capsys.readouterr().err


def test_usage_errors_exit_2(capsys):
    assert cli.main(["build", "--variant", "tpu", "--prefix", "x"]) == 2
    assert "rollkv: error:" in capsys.readouterr().err
    assert cli.main([]) == 2


def test_registered_module_handler_errors_map_to_their_codes(monkeypatch, capsys):
    """A module in COMMAND_MODULES adds a command; its RollkvError becomes exit code + line."""
    mod = types.ModuleType("rollkv_test_boom")

    def boom(args):
        raise PatchError(f"patch {args.name} does not apply: file a.c, hunk #2")

    def register(subparsers):
        p = subparsers.add_parser("boom")
        p.add_argument("name")
        p.set_defaults(handler=boom)

    mod.register = register
    monkeypatch.setitem(sys.modules, "rollkv_test_boom", mod)
    monkeypatch.setattr(cli, "COMMAND_MODULES", [*cli.COMMAND_MODULES, "rollkv_test_boom"])
    assert cli.main(["boom", "0001-x.patch"]) == 5
    err = capsys.readouterr().err
    assert err == "rollkv: error: patch 0001-x.patch does not apply: file a.c, hunk #2\n"


def test_python_dash_m_works():
    out = subprocess.run([sys.executable, "-m", "rollkv_dist", "--version"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.startswith("rollkv ")


def test_step_prints_start_and_duration():
    buf = io.StringIO()
    lg = log.Logger(stream=buf)
    with lg.step("Building llama.cpp"):
        lg.info("inside")
    text = buf.getvalue().splitlines()
    assert text[0] == "==> Building llama.cpp"
    assert text[1] == "    inside"
    assert text[2].startswith("    done in ") and text[2].endswith(" s")


def test_failed_step_says_so_and_reraises():
    buf = io.StringIO()
    lg = log.Logger(stream=buf)
    with pytest.raises(ValueError), lg.step("Configuring"):
        raise ValueError("x")
    assert "failed after" in buf.getvalue()


def test_ninja_progress_lines():
    assert log.parse_ninja_progress("[12/218] Building CXX object src/x.o") == (12, 218)
    assert log.parse_ninja_progress("FAILED: src/x.o") is None
    assert log.parse_ninja_progress("-- Configuring done") is None


def test_progress_in_a_log_prints_each_tenth_once():
    buf = io.StringIO()
    lg = log.Logger(stream=buf)
    bar = lg.progress("build")
    for i in range(1, 201):
        bar.update(i, 200)
    bar.finish()
    lines = buf.getvalue().splitlines()
    # the step, N/M and the elapsed time (issue 31: a long step says how far it is and how long it took)
    assert re.fullmatch(r"    build: 1/200 \(0 %\), \d+\.\d s", lines[0]), lines[0]
    assert re.fullmatch(r"    build: 200/200 \(100 %\), \d+\.\d s", lines[-1]), lines[-1]
    assert len(lines) == 11


def test_byte_progress_format():
    buf = io.StringIO()
    bar = log.Logger(stream=buf).progress("downloading x", unit="bytes")
    bar.update(38_000_000, 76_600_000)
    assert re.fullmatch(r"downloading x: 36\.2 MiB / 73\.1 MiB \(50 %\), \d+\.\d s", buf.getvalue().strip())
    assert log.format_bytes(512) == "512 B"
