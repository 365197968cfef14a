"""plait's GradReducer on a toy model: unused and frozen parameters, accumulation, grads dropped by the
optimizer, and bucket order. Reference: the gradient of the mean loss over both ranks' data computed in
one process. Tolerance 1e-6 absolute: the same sums in a different order."""

from __future__ import annotations

import torch
from helpers import run_ranks
from torch import nn

from plait.comm.collectives import Comm
from plait.parallel.data.reducer import GradReducer


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.unused = nn.Linear(4, 4)  # requires grad, never reached by forward
        self.frozen = nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.b = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.frozen(torch.tanh(self.a(x))))).square().mean()


def _data(rank: int, micro: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * rank + micro))


def _reference(world: int, accum: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Toy()
    for r in range(world):
        for m in range(accum):
            (model(_data(r, m)) / (world * accum)).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _reduce(rank: int, world: int, accum: int, drop_grads: bool) -> dict:
    torch.manual_seed(rank)  # different init per rank: the reducer must broadcast rank 0's weights
    model = Toy()
    reducer = GradReducer(model, None, Comm(), bucket_mb=128 / 2**20)  # 128-byte buckets: 3 of them
    torch.manual_seed(0)
    same = Toy().state_dict()
    broadcast_ok = all(torch.equal(v, model.state_dict()[k]) for k, v in same.items())
    for _step in range(2):  # the second step must not see the first step's gradients
        if drop_grads:
            model.zero_grad(set_to_none=True)
        else:
            reducer.zero_grad()
        for m in range(accum):
            if m < accum - 1:
                with reducer.no_sync():
                    (model(_data(rank, m)) / accum).backward()
            else:
                (model(_data(rank, m)) / accum).backward()
        reducer.finish()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"grads": grads, "broadcast_ok": broadcast_ok, "num_buckets": len(reducer.buckets),
            "frozen_grad": model.frozen.weight.grad}


CASES = ((1, False), (2, True))


def _cases(rank: int, world: int) -> list[dict]:
    return [_reduce(rank, world, accum, drop) for accum, drop in CASES]  # one spawn for both


def test_reducer_matches_reference_with_unused_and_frozen_params() -> None:
    per_rank = run_ranks(_cases, 2)
    for i, (accum, drop) in enumerate(CASES):
        results = [r[i] for r in per_rank]
        ref = _reference(2, accum)
        for r in results:
            assert r["broadcast_ok"] and r["num_buckets"] >= 3 and r["frozen_grad"] is None
            for name, g in ref.items():
                torch.testing.assert_close(r["grads"][name], g, atol=1e-6, rtol=0)
            # Unused parameters: zero gradients while .grad views are kept, None after set_to_none (as DDP).
            unused = {n for n in r["grads"] if n.startswith("unused")}
            assert unused == (set() if drop else {"unused.weight", "unused.bias"})
            assert all(torch.count_nonzero(r["grads"][n]) == 0 for n in unused)
