"""In-memory checkpoints: a small holder process per machine that keeps each local rank's newest checkpoint in
host memory, so a restarted worker group reloads in seconds instead of reading the disk.

Why a process of its own: when one worker fails, torch's elastic agent (and plait's launcher over it) stops
and restarts every worker of the machine, so nothing a worker holds survives a restart, and neither would a
copy kept by a peer rank. The launcher (``plait train``) outlives its workers; it starts the holder beside
them (``start``) before the first attempt and ends it with the run. The holder binds to loopback
(127.0.0.1) only and answers only requests carrying the run's random token (``PLAIT_MEMORY_TOKEN``), so
nothing off the machine and no other run on it can read or write it. It stores bytes and never interprets
them: a rank's copy is the checkpoint's tensors as ``torch.save`` bytes, loaded back with
``torch.load(weights_only=True)`` (``plait.components.memory_checkpoint``), with a CRC-32 the rank checks (the
copy crossed loopback and sat in memory: a check against damage, not against an adversary, which the token
keeps out).

The holder keeps one copy per rank, the newest (``put`` replaces it once the new bytes have arrived whole), and
ends when the launcher does (it watches its parent). The disk checkpoint stays the record and the fallback:
a worker loads from memory only when every rank's copy is there, whole, of the same step as the newest
complete checkpoint on disk (``plait.train.Trainer.resume``).

Protocol (one request per connection): a 4-byte big-endian length, a JSON header ``{"op", "token", ...}``, then
``size`` raw bytes for ``put``; the reply is the same shape. Ops: ``put`` (rank, step, world, crc32, size),
``head`` (rank: the header of its copy, or none), ``get`` (rank: header and bytes), ``ping``.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import socketserver
import struct
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path
from typing import Any

ADDRESS_ENV = "PLAIT_MEMORY_HOLDER"  # host:port of this machine's holder, for the workers
TOKEN_ENV = "PLAIT_MEMORY_TOKEN"
PID_FILE = "holder.pid"  # in the run's workers/ directory, beside the workers' pid files (tests kill it)


def _send(sock: socket.socket, header: dict[str, Any], payload: bytes | bytearray | memoryview = b"") -> None:
    head = json.dumps(header).encode()
    sock.sendall(struct.pack(">I", len(head)) + head)
    if payload:
        sock.sendall(payload)


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buffer = bytearray(n)  # received in place: no list of chunks joined afterwards
    view, got = memoryview(buffer), 0
    while got < n:
        k = sock.recv_into(view[got:], min(n - got, 1 << 24))
        if not k:
            raise ConnectionError("the holder connection closed early")
        got += k
    return buffer


def _recv(sock: socket.socket) -> tuple[dict[str, Any], bytearray]:
    (n,) = struct.unpack(">I", _recv_exact(sock, 4))
    header = json.loads(_recv_exact(sock, n))
    size = int(header.get("size", 0)) if header.get("op", "reply") in ("put", "reply") else 0
    return header, _recv_exact(sock, size) if size else bytearray()


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        server: Any = self.server
        try:
            header, payload = _recv(self.request)
        except (ConnectionError, ValueError, struct.error):
            return
        if not secrets.compare_digest(str(header.get("token", "")), server.token):
            _send(self.request, {"op": "reply", "error": "wrong token"})
            return
        op, rank = header.get("op"), header.get("rank")
        with server.lock:
            if op == "put":
                keep = {k: header[k] for k in ("rank", "step", "world", "crc32", "size")}
                server.copies[int(rank)] = (keep, payload)
                _send(self.request, {"op": "reply", "ok": True})
            elif op in ("head", "get"):
                held = server.copies.get(int(rank))
                if held is None:
                    _send(self.request, {"op": "reply", "held": False})
                else:
                    body = held[1] if op == "get" else b""
                    _send(self.request, {"op": "reply", "held": True, **held[0], "size": len(body)}, body)
            else:
                _send(self.request, {"op": "reply", "ok": True, "ranks": sorted(server.copies)})


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


def serve(token: str, parent: int) -> None:
    """Run the holder on an ephemeral loopback port (printed as ``PORT <n>``) until ``parent`` is gone."""
    server = _Server(("127.0.0.1", 0), _Handler)
    server.token, server.lock, server.copies = token, threading.Lock(), {}
    print(f"PORT {server.server_address[1]}", flush=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    while os.getppid() == parent:
        time.sleep(0.5)
    server.shutdown()


class Holder:
    """The launcher's handle on the holder process it started (``start``)."""

    def __init__(self, proc: subprocess.Popen, address: str, token: str) -> None:
        self.proc, self.address, self.token = proc, address, token

    def env(self) -> dict[str, str]:
        """What a worker needs to reach it."""
        return {ADDRESS_ENV: self.address, TOKEN_ENV: self.token}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def start(state_dir: Path | None = None) -> Holder:
    """Start this machine's holder (from the launcher: it outlives every worker attempt); its pid goes to
    ``state_dir/workers/holder.pid``."""
    token = secrets.token_hex(16)
    proc = subprocess.Popen([sys.executable, "-m", "plait.fault.holder", str(os.getpid())], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, TOKEN_ENV: token})  # not in argv: ps shows argv
    line = proc.stdout.readline() if proc.stdout is not None else ""
    if not line.startswith("PORT "):
        proc.kill()
        raise RuntimeError("the in-memory checkpoint holder did not start (fault.memory_checkpoint); set "
                           "fault.memory_checkpoint=false to train with disk checkpoints only")
    if state_dir is not None:
        d = Path(state_dir) / "workers"
        d.mkdir(parents=True, exist_ok=True)
        (d / PID_FILE).write_text(str(proc.pid))
    return Holder(proc, f"127.0.0.1:{int(line.split()[1])}", token)


class Client:
    """A worker's side: ``put`` its copy at a save, ``get`` it at a load. Every call fails soft (returns False
    or None) when the holder is gone: the disk is the fallback, never an error."""

    def __init__(self, address: str, token: str, timeout_s: float = 30.0) -> None:
        host, port = address.rsplit(":", 1)
        self.address, self.host, self.port, self.token, self.timeout_s = address, host, int(port), token, timeout_s

    @classmethod
    def from_env(cls) -> Client | None:
        address, token = os.environ.get(ADDRESS_ENV), os.environ.get(TOKEN_ENV)
        return cls(address, token) if address and token else None

    def _call(self, header: dict[str, Any],
              payload: bytes | memoryview = b"") -> tuple[dict[str, Any], bytearray] | None:
        try:
            with socket.create_connection((self.host, self.port), timeout=self.timeout_s) as sock:
                _send(sock, {**header, "token": self.token}, payload)
                return _recv(sock)
        except OSError:
            return None

    def put(self, rank: int, step: int, world: int, payload: bytes | memoryview) -> bool:
        header = {"op": "put", "rank": rank, "step": step, "world": world, "size": len(payload),
                  "crc32": zlib.crc32(payload)}
        reply = self._call(header, payload)
        return reply is not None and bool(reply[0].get("ok"))

    def get(self, rank: int) -> tuple[dict[str, Any], bytearray] | None:
        """(header, bytes) of this rank's copy when held and whole (its CRC-32 checked), else None."""
        reply = self._call({"op": "get", "rank": rank})
        if reply is None or not reply[0].get("held"):
            return None
        header, payload = reply
        if zlib.crc32(payload) != header.get("crc32"):
            return None
        return header, payload


if __name__ == "__main__":
    serve(os.environ[TOKEN_ENV], int(sys.argv[1]))
