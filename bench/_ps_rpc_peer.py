"""The existing-practice peer of ``bench/ps.py``: PyTorch's RPC parameter server, as its official example
builds it (pytorch/examples ``distributed/rpc/batch/parameter_server.py``, the "batch-updating parameter
server" of the RPC tutorials): the server owns the model and its optimizer; a worker computes gradients
and calls ``update_and_fetch_model`` with ``rpc_sync``; the server, an ``@rpc.functions.async_execution``
function, adds them to the model's gradients and, once ``batch_update_size`` of them have arrived, steps
and answers every waiting worker with the model (pickled through RPC). ``batch_update_size = 1`` is its
asynchronous form, compared here with plait's ``ps.mode = async``.

Run by ``bench/ps.py`` (``run_rpc``): the last rank is the server, the others are workers.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import torch
import torch.distributed.rpc as rpc


class BatchUpdateParameterServer:
    """The example's server: model, optimizer (AdamW here, like plait's), a lock and a future model."""

    def __init__(self, model: torch.nn.Module, batch_update_size: int, lr: float) -> None:
        self.model = model
        self.lock = threading.Lock()
        self.future_model: Any = torch.futures.Future()
        self.batch_update_size = batch_update_size
        self.curr_update_size = 0
        self.updates = 0
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)

    def get_model(self) -> torch.nn.Module:
        return self.model

    @staticmethod
    @rpc.functions.async_execution
    def update_and_fetch_model(ps_rref: Any, grads: list[torch.Tensor]) -> Any:
        self = ps_rref.local_value()
        with self.lock:
            self.curr_update_size += 1
            for p, g in zip(self.model.parameters(), grads, strict=True):
                p.grad += g
            fut = self.future_model
            if self.curr_update_size >= self.batch_update_size:
                for p in self.model.parameters():
                    p.grad /= self.batch_update_size
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
                self.curr_update_size = 0
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=False)
                self.updates += 1
                fut.set_result(self.model)
                self.future_model = torch.futures.Future()
        return fut


_PS: Any = None


def _make_ps(model: torch.nn.Module, batch_update_size: int, lr: float) -> BatchUpdateParameterServer:
    global _PS
    _PS = BatchUpdateParameterServer(model, batch_update_size, lr)
    return _PS


def run_rpc(rank: int, world: int, port: int, make_model: Any, make_data: Any, loss_fn: Any, steps: int,
            micro: int, lr: float) -> dict[str, Any]:
    """One rank of the RPC peer (spawned without a process group); workers return their step times."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    server = world - 1
    name = "ps" if rank == server else f"trainer{rank}"
    rpc.init_rpc(name, rank=rank, world_size=world,
                 rpc_backend_options=rpc.TensorPipeRpcBackendOptions(num_worker_threads=16, rpc_timeout=600))
    cpu0 = _cpu_s()
    out: dict[str, Any] = {}
    if rank == 0:
        torch.manual_seed(0)
        ps_rref = rpc.remote("ps", _make_ps, args=(make_model(), 1, lr))
        for w in range(1, server):
            rpc.rpc_sync(f"trainer{w}", _set_rref, args=(ps_rref,))
        _set_rref(ps_rref)
    if rank != server:
        while _RREF[0] is None:
            time.sleep(0.001)
        ps_rref = _RREF[0]
        model = ps_rref.rpc_sync().get_model()
        data = make_data()
        g = torch.Generator().manual_seed(rank)
        steps_s = []
        t0, cpu0 = time.perf_counter(), _cpu_s()
        for _ in range(steps):
            ts = time.perf_counter()
            idx = torch.randint(0, len(data), (micro,), generator=g)
            x, y = data[idx]
            model.zero_grad()
            loss_fn(model(x), y).backward()
            model = rpc.rpc_sync("ps", BatchUpdateParameterServer.update_and_fetch_model,
                                 args=(ps_rref, [p.grad for p in model.parameters()]))
            steps_s.append(time.perf_counter() - ts)
        out = {"step_s": steps_s, "end_s": time.perf_counter() - t0, "cpu_s": _cpu_s() - cpu0}
    rpc.shutdown()  # waits for every rank: the server ends when all workers have
    if rank == server:
        out = {"cpu_s": _cpu_s() - cpu0}  # serving (instrumentation only: the server's work is unchanged)
    return out


def _cpu_s() -> float:
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


_RREF: list[Any] = [None]


def _set_rref(rref: Any) -> None:
    _RREF[0] = rref
