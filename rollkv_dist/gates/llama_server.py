"""llama-server for the gates: started on a free loopback port in its own process group, healthy or not within
a time limit, asked over HTTP, stopped as a group; its log saved and its command line recorded."""

from __future__ import annotations

import shlex
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from rollkv_dist import proc as proc_mod
from rollkv_dist.proc import kill_group
from rollkv_dist.errors import RollkvError
from rollkv_dist.gates import logparse
from rollkv_dist.gates.context import GateResult


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LlamaServer:
    """llama-server as a context manager: start, wait for /health, HTTP calls, clean kill."""

    def __init__(self, binary: Path, args: list[str], log_path: Path, env: dict[str, str] | None = None,
                 boot_timeout: float = 300.0, request_timeout: float = 600.0,
                 result: GateResult | None = None):
        self.binary, self.args, self.log_path, self.env = binary, list(args), log_path, env
        self.boot_timeout, self.request_timeout = boot_timeout, request_timeout
        self.result = result
        self.port = free_port()
        self.proc: subprocess.Popen[Any] | None = None
        self.booted = False
        self.boot_seconds: float | None = None
        self.exit_code: int | None = None
        self._log_f: Any = None

    @property
    def cmd(self) -> list[str]:
        return [str(self.binary), *self.args, "--host", "127.0.0.1", "--port", str(self.port)]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        if self._log_f:
            self._log_f.flush()
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def parsed(self) -> logparse.LlamaLog:
        return logparse.parse_log(self.log(), source=str(self.log_path))

    def __enter__(self) -> LlamaServer:
        import requests

        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if self.result is not None:
            self.result.commands.append(shlex.join(self.cmd))
            self.result.logs.append(str(self.log_path))
        self._log_f = open(self.log_path, "w")
        t0 = time.monotonic()
        self.proc = proc_mod.popen(self.cmd, stdout=self._log_f, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, env=self.env)
        try:
            while time.monotonic() - t0 < self.boot_timeout:
                if self.proc.poll() is not None:
                    self.exit_code = self.proc.returncode
                    return self
                try:
                    r = requests.get(self.url + "/health", timeout=2)
                    if r.status_code == 200:
                        self.booted = True
                        self.boot_seconds = time.monotonic() - t0
                        return self
                except requests.RequestException:
                    pass
                time.sleep(0.25)
        except BaseException:
            self.close()
            raise
        self.close()
        raise RollkvError(f"llama-server did not become healthy within {self.boot_timeout:.0f} s "
                          f"(log: {self.log_path})")

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        import requests

        r = requests.post(self.url + path, json=body, timeout=self.request_timeout)
        if r.status_code != 200:
            raise RollkvError(f"{path} returned HTTP {r.status_code}: {r.text[:500]}")
        return r.json()

    def get(self, path: str) -> dict[str, Any]:
        import requests

        r = requests.get(self.url + path, timeout=self.request_timeout)
        if r.status_code != 200:
            raise RollkvError(f"{path} returned HTTP {r.status_code}: {r.text[:500]}")
        return r.json()

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        resp = self.post("/tokenize", {"content": text, "add_special": add_special})
        return [t if isinstance(t, int) else t["id"] for t in resp["tokens"]]

    def completion(self, prompt: str, n_predict: int = 16) -> dict[str, Any]:
        return self.post("/completion", {"prompt": prompt, "n_predict": n_predict, "temperature": 0.0,
                                         "top_k": 1, "cache_prompt": False, "seed": 0})

    def close(self) -> None:
        if self.proc is not None:
            kill_group(self.proc)
            if self.exit_code is None:
                self.exit_code = self.proc.returncode
        if self._log_f:
            self._log_f.close()
            self._log_f = None

    def __exit__(self, *exc: Any) -> None:
        self.close()
