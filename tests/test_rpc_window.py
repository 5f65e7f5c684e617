"""Rolling KV over llama.cpp's RPC backend (patches 0102, 0103) with the CPU build: window buffers on the
rpc-server's device, the host tail in the server host's memory, the host check with the server's numbers, and a
server that answers bad window requests with an error and keeps the connection.

A build without a GPU has no device that maps host memory, so the servers here run with
GGML_RPC_TEST_WINDOW_STAND_IN=1: their CPU device serves a window buffer as one plain buffer of the same layout,
which is what the client-side sizer, the protocol and the server's checks need (the GPU run of the rpc gate
shows the CUDA window buffers)."""

from __future__ import annotations

import math
import re
import socket
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest

from test_tool_integration import _rpc_server

pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("llama-cpu-build")]

STAND_IN = {"GGML_RPC_TEST_WINDOW_STAND_IN": "1"}

# ggml-rpc's command numbers (ggml-rpc.cpp: enum rpc_cmd; 18-20 are protocol 7.1's)
HELLO, WINDOW_GRANULARITY, ALLOC_WINDOW_BUFFER, GET_HOST_MEMORY = 14, 18, 19, 20
CONN_CAPS = 24  # transport.h: RPC_CONN_CAPS_SIZE
ERR = 256  # RPC_WINDOW_ERR_SIZE


class Rpc:
    """A minimal client of the RPC protocol: | cmd (1 byte) | size (8 bytes) | data |, answered by
    | size (8 bytes) | data |."""

    def __init__(self, port: int):
        self.s = socket.create_connection(("127.0.0.1", port), timeout=30)
        major, minor, _patch = struct.unpack("<3Bx", self.call(HELLO, bytes(CONN_CAPS), 4 + CONN_CAPS)[:4])
        self.version = (major, minor)

    def _recv(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = self.s.recv(n - len(out))
            if not chunk:
                raise ConnectionError(f"the server closed the connection ({len(out)} of {n} bytes)")
            out += chunk
        return out

    def call(self, cmd: int, data: bytes, size: int) -> bytes:
        self.s.sendall(struct.pack("<BQ", cmd, len(data)) + data)
        (n,) = struct.unpack("<Q", self._recv(8))
        assert n == size, f"reply of {n} bytes to command {cmd}, expected {size}"
        return self._recv(n)

    def granularity(self, device: int) -> tuple[int, str]:
        out = self.call(WINDOW_GRANULARITY, struct.pack("<I", device), 8 + ERR)
        return struct.unpack("<Q", out[:8])[0], out[8:].split(b"\0", 1)[0].decode()

    def alloc_window(self, payload: bytes) -> tuple[int, int, str]:
        out = self.call(ALLOC_WINDOW_BUFFER, payload, 16 + ERR)
        ptr, size = struct.unpack("<QQ", out[:16])
        return ptr, size, out[16:].split(b"\0", 1)[0].decode()

    def host_memory(self) -> tuple[int, int, int]:
        return struct.unpack("<QQB", self.call(GET_HOST_MEMORY, b"", 17))

    def close(self) -> None:
        self.s.close()


def window_request(device: int, segs: list[tuple[int, int]]) -> bytes:
    """ALLOC_WINDOW_BUFFER's request: | device | n_seg | sizes (8 bytes each) | host flags (1 byte each) |."""
    return (struct.pack("<II", device, len(segs)) + b"".join(struct.pack("<Q", s) for s, _ in segs)
            + bytes(h for _, h in segs))


def _servers(prefix: Path, tmp_path: Path, envs: list[dict[str, str]]) -> list[tuple[subprocess.Popen, int]]:
    return [_rpc_server(prefix, tmp_path / f"rpc-server-{i}.log", env) for i, env in enumerate(envs)]


def _stop(servers: list[tuple[subprocess.Popen, int]]) -> None:
    for proc, _ in servers:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=30)


def _dump(prefix: Path, model: Path, tmp_path: Path, name: str, ports: list[int], extra: list[str]
          ) -> subprocess.CompletedProcess:
    """llama-logits-dump on the RPC devices of `ports` (the tiny model's layer 0 on the first, layer 1 and the
    output on the second where there are two), -c 32768: 2 MiB, one granule, per K or V tensor."""
    prompt = tmp_path / "p.txt"
    if not prompt.exists():
        prompt.write_text(" ".join(["river mountain window garden engine signal"] * 60))
    devs = ",".join(f"RPC{i}" for i in range(len(ports)))
    split = ["-ts", "1,3"] if len(ports) == 2 else []
    return subprocess.run(
        [str(prefix / "bin" / "llama-logits-dump"), "-m", str(model), "-f", str(prompt), "-n", "8", "-t", "2",
         "-c", "32768", "-fa", "on", "-ngl", "99", "--rpc", ",".join(f"127.0.0.1:{p}" for p in ports),
         "-dev", devs, *split, "-lv", "4", *extra, "--logits-out", str(tmp_path / name)],
        capture_output=True, text=True, timeout=600)


def _tail_targets(prefix: Path, model: Path, tmp_path: Path, ports: list[int]) -> str:
    """--vram-target per node that leaves each a window budget of 2-3 MiB: less than its K and V tensors' two
    granules, so every cell of its KV is in the host tail (C = 0). From a `--vram-target 1` probe: the model
    buffer on each node and the reserve pass 2 sizes it with, plus the margin."""
    probe = _dump(prefix, model, tmp_path, "probe", ports, ["-krm", "window", "--vram-target",
                                                           ",".join("1" for _ in ports)])
    said = probe.stderr
    reserves = [float(x) for x in re.findall(r"pass 2 sizes the window with reserve = ([0-9.]+) MiB", said)]
    models = {int(p): float(m) for p, m in re.findall(r"RPC\d+\[127\.0\.0\.1:(\d+)\] model buffer size = +([0-9.]+) MiB", said)}
    margin = re.search(r"margin (\d+) MiB", said)
    assert len(reserves) == len(ports) and set(models) == set(ports) and margin, said[-3000:]
    return ",".join(str(math.ceil(models[p] + r + int(margin.group(1))) + 2) for p, r in zip(ports, reserves))


def _logits(tmp_path: Path, name: str) -> np.ndarray:
    return np.fromfile(tmp_path / f"{name}.f32", dtype=np.float32)


def test_a_host_tail_on_each_of_two_rpc_nodes_gives_resident_logits(cpu_build, tiny_model, tmp_path):
    """Two rpc-servers on loopback, the tiny model's two layers split over them. Window mode with a
    --vram-target per node below its KV: each server allocates a window buffer whose cells are all in its host
    tail, the client sizes each node from that node's budget and host memory, and the logits and greedy tokens
    equal resident's over the same nodes bit for bit. Auto at those targets takes the same windows."""
    prefix = cpu_build["prefix"]
    servers = _servers(prefix, tmp_path, [STAND_IN, STAND_IN])
    ports = [p for _, p in servers]
    try:
        resident = _dump(prefix, tiny_model, tmp_path, "resident", ports, ["-krm", "resident"])
        assert resident.returncode == 0, resident.stderr[-3000:]
        kv = re.findall(r"RPC0\[127\.0\.0\.1:(\d+)\] KV buffer size = +([0-9.]+) MiB", resident.stderr)
        assert sorted(int(p) for p, _ in kv) == sorted(ports), resident.stderr[-3000:]
        targets = _tail_targets(prefix, tiny_model, tmp_path, ports)
        for mode in ("window", "auto"):
            run = _dump(prefix, tiny_model, tmp_path, mode, ports, ["-krm", mode, "--vram-target", targets])
            said = run.stderr
            assert run.returncode == 0, said[-3000:]
            tails = re.findall(r"position window = 0 / 32768 cells resident \(device 0\.00 MiB, host tail 4\.00 MiB\) "
                               r"on (RPC\d)", said)
            assert sorted(tails) == ["RPC0", "RPC1"], said[-3000:]
            for dev in ("RPC0", "RPC1"):
                assert re.search(rf"host tail 4 MiB, host memory available \d+ MiB of \d+ MiB on the rpc-server host "
                                 rf"of {dev}", said), said[-3000:]
            w, r = _logits(tmp_path, mode), _logits(tmp_path, "resident")
            assert w.size > 0 and w.shape == r.shape and float(np.abs(w - r).max()) == 0.0, mode
        for i in range(2):
            log = (tmp_path / f"rpc-server-{i}.log").read_text()
            assert log.count("rpc-server: window buffer on CPU: 4 MiB, of them 0 MiB in device memory and 4 MiB host "
                             "tail") == 2, log[-2000:]
        assert all(p.poll() is None for p, _ in servers)
    finally:
        _stop(servers)


def test_the_host_check_of_a_remote_tail_uses_the_server_hosts_memory(cpu_build, tiny_model, tmp_path):
    """The server host has 1 MiB available (its test hook; this host has plenty): window mode over RPC refuses
    the tail with the server host's numbers, naming it. A server that answers as protocol 7.0 gets no window
    request: window mode refuses naming the rpc-server, auto keeps the KV whole."""
    prefix = cpu_build["prefix"]
    servers = _servers(prefix, tmp_path, [{**STAND_IN, "GGML_RPC_TEST_HOST_AVAILABLE_MIB": "1"},
                                          {**STAND_IN, "GGML_RPC_TEST_PROTO_MINOR": "0"}])
    try:
        small_port, old_port = servers[0][1], servers[1][1]
        target = _tail_targets(prefix, tiny_model, tmp_path, [small_port])
        small = _dump(prefix, tiny_model, tmp_path, "small", [small_port], ["-krm", "window", "--vram-target", target])
        assert small.returncode != 0
        assert re.search(r"window mode: the KV host tail needs 8 MiB of pinned host memory, but only 1 MiB is "
                         r"available on the rpc-server host of RPC0 \(MemAvailable", small.stderr), small.stderr[-3000:]
        old = _dump(prefix, tiny_model, tmp_path, "old", [old_port], ["-krm", "window", "--vram-target", target])
        assert old.returncode != 0
        assert "cannot hold a KV host tail: its rpc-server speaks protocol 7.0, window buffers need 7.1" in old.stderr
        assert re.search(r"does not fit the device budget of RPC0 \(\d+ MiB\), and its rpc-server cannot map host "
                         r"memory", old.stderr), old.stderr[-3000:]
        auto = _dump(prefix, tiny_model, tmp_path, "auto", [old_port], ["-krm", "auto", "--vram-target", target])
        assert auto.returncode == 0, auto.stderr[-3000:]
        assert "kv residency: auto -> resident on RPC0" in auto.stderr
        assert all(p.poll() is None for p, _ in servers)
    finally:
        _stop(servers)


def test_bad_window_requests_get_an_error_reply_and_the_connection_stays(cpu_build, tmp_path):
    """Protocol 7.1 spoken by hand: each malformed ALLOC_WINDOW_BUFFER gets a reply saying what is wrong, on the
    same connection, which then allocates a good one; a server device without window buffers says why."""
    prefix = cpu_build["prefix"]
    servers = _servers(prefix, tmp_path, [STAND_IN, {}])
    mib2 = 2 << 20
    try:
        rpc = Rpc(servers[0][1])
        assert rpc.version == (7, 1)
        assert rpc.granularity(0) == (mib2, "")
        assert rpc.granularity(9)[0] == 0 and "no device 9" in rpc.granularity(9)[1]
        bad = {
            "truncated": (b"\x00\x00\x00", "malformed window buffer request"),
            "no segments": (struct.pack("<II", 0, 0), "malformed window buffer request: 0 segments"),
            "too many segments": (struct.pack("<II", 0, 5000), "5000 segments (1 to 4096)"),
            "short of its segments": (window_request(0, [(mib2, 0), (mib2, 1)])[:-1], "malformed"),
            "no such device": (window_request(7, [(mib2, 0)]), "the server has no device 7"),
            "not a granule": (window_request(0, [(1000, 0)]), "segments are positive multiples of 2097152 bytes"),
            "empty segment": (window_request(0, [(0, 1)]), "segment 0 of 0 bytes"),
            "host flag 2": (window_request(0, [(mib2, 2)]), "(host flag 2)"),
            "sizes overflow": (window_request(0, [(1 << 63, 0), (1 << 63, 1)]), "larger than the device CPU can address"),
        }
        for name, (payload, says) in bad.items():
            ptr, size, err = rpc.alloc_window(payload)
            assert ptr == 0 and size == 0 and says in err, (name, err)
        ptr, size, err = rpc.alloc_window(window_request(0, [(mib2, 0), (2 * mib2, 1)]))
        assert ptr != 0 and size >= 3 * mib2 and err == "", err
        available, total, _ = rpc.host_memory()
        assert 0 < available <= total
        rpc.close()

        plain = Rpc(servers[1][1])
        gran, reason = plain.granularity(0)
        assert gran == 0 and "the server's device CPU (CPU backend) has no window buffers" in reason
        ptr, _, err = plain.alloc_window(window_request(0, [(mib2, 0)]))
        assert ptr == 0 and "has no window buffers" in err
        plain.close()
        assert all(p.poll() is None for p, _ in servers)
    finally:
        _stop(servers)
