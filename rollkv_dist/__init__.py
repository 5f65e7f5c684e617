"""rollkv distribution tooling: pin, patch, build, gates and reports for llama.cpp with rolling KV."""

import sys

__version__ = "0.1.0"

# The one Python floor: pyproject.toml's requires-python and the README say the same (tests check it).
# Checked here, before any module with newer syntax is imported, so an older Python gets this line.
PYTHON_FLOOR = (3, 10)

if sys.version_info < PYTHON_FLOOR:
    raise SystemExit(f"rollkv needs Python {'.'.join(map(str, PYTHON_FLOOR))} or newer; this is Python "
                     f"{sys.version.split()[0]} ({sys.executable})")
