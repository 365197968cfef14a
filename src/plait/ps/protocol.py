"""The parameter server's wire protocol: a fixed header, then (for most operations) one payload.

A header is ``HEADER_LEN`` float64 numbers (integers up to 2**53 are exact)::

    [op, worker, server, version, nbytes, clock, norm_sq, flags, lr of group 0 .. lr of group 7]

announcing ``nbytes`` of payload. Requests (worker to server) and parameter replies travel *framed*: one
float32 message of the header's 128 bytes followed by a slot the size of the shard, holding the payload
(a gradient, parameters) or nothing (a pull, statistics, done), so the hot path, a push answered with
the new parameters, is one message each way. Other replies, and a checkpoint request's arguments, are a
header, then the payload as its own message (UTF-8 JSON as uint8: statistics, a checkpoint's path).
Messages go over c10d point-to-point ``send``/``recv`` on a gloo group of their own (also when training
uses NCCL); per pair of ranks gloo delivers them in order, so a request and its payload, and a reply
and its payload, never interleave with another message of the same pair. A server receives with one
blocking ``recv`` per worker on its own thread; no operation polls ``is_completed()`` or sets a
timeout on a pair (both break gloo). A peer that dies closes its connections: the blocked ``recv``
raises, and the survivor raises a ``PsError`` naming the rank.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

HEADER_LEN = 16
HEADER_F32 = 2 * HEADER_LEN  # the float64 header's bytes as float32 slots of a framed message
MAX_GROUPS = HEADER_LEN - 8


class Op(enum.IntEnum):
    INIT = 1  # worker 0 -> server: the initial parameters of the shard
    PUSH = 2  # worker -> server: a gradient of the shard, computed on ``version``
    PULL = 3  # worker -> server: request the shard's parameters; the reply carries them
    SAVE = 4  # worker -> server: join the checkpoint save at a path (JSON); the server writes its shard
    LOAD = 5  # worker -> server: join the checkpoint load from a path (JSON); answered with version, clock
    STATS = 6  # worker -> server: request the server's statistics (JSON)
    DONE = 7  # worker -> server: this worker has finished; no more messages follow
    REPLY = 8  # server -> worker
    PARK = 9  # worker -> server: it meets the other workers (backup mode: versions complete without it)


FLAG_NONFINITE = 1  # PUSH: the worker's gradient held NaN/inf (no payload; counted, never applied)
FLAG_PULL = 2  # PUSH: answer with the parameters, as a PULL right after it would


class PsError(RuntimeError):
    """A parameter-server peer is gone or answered out of protocol; the message names the rank."""


@dataclass
class Header:
    op: Op
    worker: int = 0
    server: int = 0
    version: int = 0
    nbytes: int = 0
    clock: int = 0
    norm_sq: float = 0.0
    flags: int = 0
    lrs: list[float] = field(default_factory=list)

    def encode(self) -> torch.Tensor:
        if len(self.lrs) > MAX_GROUPS:
            raise PsError(f"parallel.mode=ps supports at most {MAX_GROUPS} optimizer parameter groups; the optimizer "
                          f"has {len(self.lrs)}")
        vals = [int(self.op), self.worker, self.server, self.version, self.nbytes, self.clock, self.norm_sq,
                self.flags, *self.lrs]
        return torch.tensor(vals + [0.0] * (HEADER_LEN - len(vals)), dtype=torch.float64)

    @classmethod
    def decode(cls, t: torch.Tensor, num_groups: int = 0) -> Header:
        v = t.tolist()
        return cls(Op(int(v[0])), int(v[1]), int(v[2]), int(v[3]), int(v[4]), int(v[5]), float(v[6]), int(v[7]),
                   v[8:8 + num_groups])


class Channel:
    """Point-to-point messages with one peer on the parameter-server group; counts bytes both ways."""

    def __init__(self, group: dist.ProcessGroup, me: int, peer: int, peer_role: str, slot: int = 0) -> None:
        self.group, self.me, self.peer, self.peer_role = group, me, peer, peer_role
        self.bytes_sent = 0
        self.bytes_received = 0
        self.slot = slot  # float32 elements of a framed message's payload slot: the shard's size
        self._frame_out = torch.zeros(HEADER_F32 + slot, dtype=torch.float32)
        self._frame_in = torch.zeros(HEADER_F32 + slot, dtype=torch.float32)

    def out_slot(self) -> torch.Tensor:
        """The payload slot of the outgoing frame: write a payload here and send it with ``send_framed(header,
        filled=n)``, without a copy of its own (valid until the next send on this channel)."""
        return self._frame_out[HEADER_F32:]

    def send_framed(self, header: Header, payload: torch.Tensor | None = None, filled: int = 0) -> None:
        """One message: ``header`` and ``payload`` (float32, at most the slot) in a shard-sized frame; or,
        with ``filled = n``, the ``n`` elements already written to ``out_slot()``."""
        n = payload.numel() if payload is not None else filled
        if n > self.slot or (payload is not None and payload.dtype != torch.float32):
            raise PsError(f"rank {self.me}: a {header.op.name} payload of {n} elements does not fit the {self.slot} "
                          f"float32 slot of the frame to rank {self.peer} (or is not float32)")
        header.nbytes = 4 * n
        frame = self._frame_out
        frame[:HEADER_F32].view(torch.float64).copy_(header.encode())
        if payload is not None and n:
            frame[HEADER_F32:HEADER_F32 + n].copy_(payload.reshape(-1))
        try:
            dist.send(frame, dst=self.peer, group=self.group)
        except RuntimeError as e:
            raise self._broken(f"sending {header.op.name}", e) from None
        self.bytes_sent += frame.numel() * 4

    def recv_framed(self, num_groups: int = 0, what: str = "waiting for a message") -> tuple[Header, torch.Tensor]:
        """A framed message: its header and its payload (a view of this channel's buffer, valid until the
        next ``recv_framed``: copy what must last)."""
        frame = self._frame_in
        try:
            dist.recv(frame, src=self.peer, group=self.group)
        except RuntimeError as e:
            raise self._broken(what, e) from None
        self.bytes_received += frame.numel() * 4
        header = Header.decode(frame[:HEADER_F32].view(torch.float64), num_groups)
        return header, frame[HEADER_F32:HEADER_F32 + header.nbytes // 4]

    def _broken(self, what: str, e: BaseException) -> PsError:
        # Worded without the backend's text, so the watchdog does not re-read it as a collective timeout.
        return PsError(f"{self.peer_role} rank {self.peer} is gone: rank {self.me} lost its link to it while "
                       f"{what} ({type(e).__name__}); see that rank's own error or exit status")

    def send(self, header: Header, payload: torch.Tensor | None = None) -> None:
        """Blocking send of ``header`` (its ``nbytes`` set from ``payload``) and the payload."""
        if payload is not None:
            header.nbytes = payload.numel() * payload.element_size()
        try:
            dist.send(header.encode(), dst=self.peer, group=self.group)
            if payload is not None and payload.numel():
                dist.send(payload.contiguous(), dst=self.peer, group=self.group)
        except RuntimeError as e:
            raise self._broken(f"sending {header.op.name}", e) from None
        self.bytes_sent += HEADER_LEN * 8 + header.nbytes

    def recv_header(self, num_groups: int = 0) -> Header:
        t = torch.empty(HEADER_LEN, dtype=torch.float64)
        try:
            dist.recv(t, src=self.peer, group=self.group)
        except RuntimeError as e:
            raise self._broken("waiting for a message", e) from None
        self.bytes_received += HEADER_LEN * 8
        return Header.decode(t, num_groups)

    def recv_payload(self, header: Header, dtype: torch.dtype = torch.float32,
                     out: torch.Tensor | None = None) -> torch.Tensor:
        """The payload announced by ``header``, into ``out`` when given (it must have that many bytes)."""
        size = torch.tensor([], dtype=dtype).element_size()
        t = out if out is not None else torch.empty(header.nbytes // size, dtype=dtype)
        if t.numel() * t.element_size() != header.nbytes:
            raise PsError(f"rank {self.me}: {header.op.name} from rank {self.peer} announced {header.nbytes} bytes; "
                          f"expected {t.numel() * t.element_size()} (workers and servers built different models?)")
        if t.numel():
            try:
                dist.recv(t, src=self.peer, group=self.group)
            except RuntimeError as e:
                raise self._broken(f"receiving a {header.op.name} payload", e) from None
        self.bytes_received += header.nbytes
        return t


def encode_json(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)


def decode_json(t: torch.Tensor) -> Any:
    return json.loads(bytes(t.tolist()).decode())
