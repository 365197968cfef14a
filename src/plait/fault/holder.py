"""In-memory checkpoints: a small holder process per machine that keeps the newest checkpoint copy of each of its
machine's ranks in host memory, and on several machines also the copies of a peer machine's ranks, so that a
restarted worker group reloads in seconds instead of reading the disk, even after a machine was lost.

Why a process of its own: when one worker fails, torch's elastic agent (and plait's launcher over it) stops
and restarts every worker of the machine, so nothing a worker holds survives a restart, and neither would a
copy kept by another local rank. The launcher (``plait train``) outlives its workers; it starts the holder beside
them (``start``) before the first attempt and ends it with the run (the holder also ends when its launcher is
gone). It stores bytes and never interprets them: a rank's copy is the checkpoint's tensors as ``torch.save``
bytes, loaded back with ``torch.load(weights_only=True)`` (``plait.checkpoint.memory``), with a
CRC-32 the rank checks (the copy crossed a socket and sat in memory: a check against damage, not against an
adversary, which the token keeps out).

Where it listens: on one machine, loopback (127.0.0.1) only. On several (``--nnodes``), on the address this
machine uses toward the rendezvous host (``facing``), so that the other machines' workers reach it. Every holder
answers only requests carrying its own random token (``PLAIT_MEMORY_TOKEN``, passed to the workers in their
environment, never in argv or a file); the workers of a job exchange their holders' addresses and tokens once
per attempt, inside their process group (``plait.engine.host_copies``), so a holder's token goes only to the
job's own workers, over the channel that already carries their gradients.

Which copies where (``Holders``): every rank puts its copy into its own machine's holder and, with several
machines, into the next machine's too (machines in the order of their lowest global rank, the last one's peer
the first), both at once. At a load a rank looks for its copy in its own machine's holder first, then its peer
machine's, then any other machine's (after a machine was replaced the ranks may sit elsewhere), and takes the
first that is whole, of the step asked for and of this world size. The holder keeps one copy per rank, the
newest (``put`` replaces it once the new bytes have arrived whole). The disk checkpoint stays the record and the
fallback: a worker loads from memory only when every rank found its copy, whole, of the same step as the newest
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
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

ADDRESS_ENV = "PLAIT_MEMORY_HOLDER"  # host:port of this machine's holder, for the workers
TOKEN_ENV = "PLAIT_MEMORY_TOKEN"
PID_FILE = "holder.pid"  # in the run's workers/ directory, beside the workers' pid files (tests kill it)
LOOPBACK = "127.0.0.1"
CONNECT_TIMEOUT_S = 5.0  # a holder that does not accept within this is gone (a lost machine may not answer at all)


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


def open_server(token: str, host: str = LOOPBACK) -> _Server:
    """A holder's server on an ephemeral port of ``host``, answering in a thread of its own (``shutdown`` ends it);
    ``serve`` runs one as the holder process, tests run one in theirs."""
    server = _Server((host, 0), _Handler)
    server.token, server.lock, server.copies = token, threading.Lock(), {}
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def serve(token: str, parent: int, host: str = LOOPBACK) -> None:
    """Run the holder on an ephemeral port of ``host`` (printed as ``PORT <n>``) until ``parent`` is gone."""
    server = open_server(token, host)
    print(f"PORT {server.server_address[1]}", flush=True)
    while os.getppid() == parent:
        time.sleep(0.5)
    server.shutdown()


def facing(host: str) -> str:
    """The IPv4 address this machine uses toward ``host`` (the rendezvous host; a name is resolved): the one the
    other machines of the job reach it at. No packet is sent: a UDP socket's connect only picks the route."""
    try:
        target = socket.getaddrinfo(host, 1, socket.AF_INET, socket.SOCK_DGRAM)[0][4][0]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((target, 1))
            return str(s.getsockname()[0])
    except OSError as e:
        raise RuntimeError(f"fault.memory_checkpoint: no route from this machine to the rendezvous host {host!r} "
                           f"({e}) for the in-memory checkpoint holder to listen on; check --rdzv-endpoint, give this "
                           "machine's address with --local-addr, or set fault.memory_checkpoint=false to train with "
                           "disk checkpoints only") from None


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


def start(state_dir: Path | None = None, host: str = LOOPBACK, pid_file: str = PID_FILE) -> Holder:
    """Start this machine's holder (from the launcher: it outlives every worker attempt), listening on ``host``
    (loopback unless the job spans several machines: then ``facing(rendezvous host)``); its pid goes to
    ``state_dir/workers/<pid_file>``."""
    token = secrets.token_hex(16)
    proc = subprocess.Popen([sys.executable, "-m", "plait.fault.holder", str(os.getpid()), host],
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, TOKEN_ENV: token})  # not in argv: ps shows argv
    line = proc.stdout.readline() if proc.stdout is not None else ""
    if not line.startswith("PORT "):
        proc.kill()
        raise RuntimeError("the in-memory checkpoint holder did not start (fault.memory_checkpoint); set "
                           "fault.memory_checkpoint=false to train with disk checkpoints only")
    if state_dir is not None:
        d = Path(state_dir) / "workers"
        d.mkdir(parents=True, exist_ok=True)
        (d / pid_file).write_text(str(proc.pid))
    return Holder(proc, f"{host}:{int(line.split()[1])}", token)


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

    @property
    def endpoint(self) -> str:
        """``"host:port token"``: what the job's other workers need to reach this holder (``Holders.of_ranks``)."""
        return f"{self.address} {self.token}"

    def _call(self, header: dict[str, Any],
              payload: bytes | memoryview = b"") -> tuple[dict[str, Any], bytearray] | None:
        try:
            with socket.create_connection((self.host, self.port), timeout=min(CONNECT_TIMEOUT_S,
                                                                               self.timeout_s)) as sock:
                sock.settimeout(self.timeout_s)
                _send(sock, {**header, "token": self.token}, payload)
                return _recv(sock)
        except (OSError, ValueError, struct.error):
            return None

    def put(self, rank: int, step: int, world: int, payload: bytes | memoryview, crc32: int | None = None) -> bool:
        header = {"op": "put", "rank": rank, "step": step, "world": world, "size": len(payload),
                  "crc32": zlib.crc32(payload) if crc32 is None else crc32}
        reply = self._call(header, payload)
        return reply is not None and bool(reply[0].get("ok"))

    def head(self, rank: int) -> dict[str, Any] | None:
        """The header of this rank's copy (step, world, size, crc32) without its bytes; None when none is held."""
        reply = self._call({"op": "head", "rank": rank})
        return reply[0] if reply is not None and reply[0].get("held") else None

    def get(self, rank: int) -> tuple[dict[str, Any], bytearray] | None:
        """(header, bytes) of this rank's copy when held and whole (its CRC-32 checked), else None."""
        reply = self._call({"op": "get", "rank": rank})
        if reply is None or not reply[0].get("held"):
            return None
        header, payload = reply
        if zlib.crc32(payload) != header.get("crc32"):
            return None
        return header, payload


class Holders:
    """A worker's holders: its own machine's, the peer machine's that keeps a second copy of this worker's
    checkpoint (None on one machine), and every other machine's of the job, searched last at a load (after a
    machine was replaced, a rank's copies may be on any). Built by ``of_ranks``."""

    def __init__(self, own: Client, peer: Client | None = None, others: Sequence[Client] = ()) -> None:
        self.own, self.peer, self.others = own, peer, list(others)

    @classmethod
    def of_ranks(cls, endpoints: Sequence[str], rank: int) -> Holders:
        """``endpoints[r]``: the ``Client.endpoint`` of global rank r's machine's holder. Machines are ordered by
        their lowest global rank (the agents' node order), and each machine's peer is the next one, the last
        machine's the first: a rule every worker derives alike, again at each attempt (a machine replaced by
        another gets the new one's holder)."""
        machines = list(dict.fromkeys(endpoints))
        i, n = machines.index(endpoints[rank]), len(machines)
        ring = [Client(*machines[(i + k) % n].split(" ", 1)) for k in range(n)]
        return cls(ring[0], ring[1] if n > 1 else None, ring[2:])

    @property
    def address(self) -> str:
        """The holders for a log line: this machine's, and the peer's where there is one."""
        return self.own.address + (f", peer {self.peer.address}" if self.peer is not None else "")

    def put(self, rank: int, step: int, world: int, payload: bytes | memoryview) -> list[str]:
        """Put this rank's copy into its own machine's holder and its peer's, both at once (the peer's send in a
        thread); returns the addresses of the holders that did not take it (empty: all did)."""
        targets = [c for c in (self.own, self.peer) if c is not None]
        crc32 = zlib.crc32(payload)
        taken = [False] * len(targets)

        def send(i: int) -> None:
            taken[i] = targets[i].put(rank, step, world, payload, crc32)

        threads = [threading.Thread(target=send, args=(i,), daemon=True) for i in range(1, len(targets))]
        for t in threads:
            t.start()
        send(0)
        for t in threads:
            t.join()
        return [c.address for c, ok in zip(targets, taken, strict=True) if not ok]

    def sources(self) -> list[tuple[str, Client]]:
        """Where a load looks, in order: ``own`` (this machine), ``peer`` (the next machine), ``other``."""
        peer = [("peer", self.peer)] if self.peer is not None else []
        return [("own", self.own), *peer, *(("other", c) for c in self.others)]

    def find(self, rank: int, world: int, accept: Callable[[int], bool]) -> Iterator[tuple[str, dict[str, Any],
                                                                                             bytearray]]:
        """(where, header, bytes) of each whole copy of ``rank`` saved at ``world`` ranks whose step ``accept``
        takes, in the order of ``sources``; a holder that is gone or holds another step is passed over (only
        its header is read)."""
        for where, client in self.sources():
            head = client.head(rank)
            if head is None or int(head["world"]) != world or not accept(int(head["step"])):
                continue
            got = client.get(rank)
            if got is not None and got[0]["step"] == head["step"]:
                yield where, got[0], got[1]


if __name__ == "__main__":
    serve(os.environ[TOKEN_ENV], int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else LOOPBACK)
