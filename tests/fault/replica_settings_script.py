"""A user's own loop under ``fault.mode = "replicas"`` with settings that act on each replica group's own gradient
synchronisation (run by tests/fault/test_replicas_settings.py through ``plait run --replicas 2 --nproc 2``: 2 groups
of 2 ranks). For each run of ``RUNS``: ``STEPS`` AdamW steps on a small MLP (with BatchNorm under sync_batchnorm) from
group g's weights (seed g: the first quorum makes them group 0's), each global batch of 16 as 4 shares of 4.

``OUT``: every rank saves OUT/<run>_g<g>r<j>.pt: the weights it starts from (after the first quorum), per step its
loss and sample ids, the gradients the optimizer reads at step 1, the full state after the last step, and what shows
the setting took effect (the reducer's engine, its all-reduce algorithm, its compressors, the BatchNorm layers'
classes, the bytes each step put on the wire)."""

import os
import sys
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

import plait

RUNS: dict[str, dict[str, Any]] = {
    "ring_syncbn": {"parallel": {"strategy": "data", "sync_batchnorm": True}, "comm": {"allreduce": "ring"}},
    "ddp": {"parallel": {"impl": "torch"}},
    "powersgd": {"comm": {"compress": "powersgd", "powersgd_rank": 2}},
}
STEPS, GLOBAL, LR = 3, 16, 1e-2


def data() -> TensorDataset:
    x = torch.randn(512, 8, generator=torch.Generator().manual_seed(1))
    return TensorDataset(x, x[:, :4].sum(1, keepdim=True) * 0.5, torch.arange(512))


def build(run: str) -> nn.Module:
    if run == "ring_syncbn":
        # no bias before BatchNorm: it would cancel it, leaving a gradient of rounding noise that AdamW amplifies
        return nn.Sequential(nn.Linear(8, 32, bias=False), nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 1))
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


def adamw(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(m.parameters(), lr=LR)


def train(out: str, run: str) -> None:
    group = int(os.environ["PLAIT_REPLICA_GROUP"])
    settings = RUNS[run]
    p = plait.Plait(fault={"mode": "replicas"}, parallel=settings.get("parallel", {}),
                    comm={"timeout_s": 60, **settings.get("comm", {})}, run={"dir": f"{out}/{run}/replica{group}"},
                    train={"global_batch_size": GLOBAL, "steps": STEPS}, observe={"progress": False, "trackers": []})
    torch.manual_seed(group)  # different weights per group: the first quorum must make them the same
    model, opt = p.setup(build(run), optimizer=adamw)
    start = {k: v.detach().clone() for k, v in p.full_state_dict(model).items()}
    grads: dict[str, torch.Tensor] = {}

    def first_grads(o: Any, args: Any, kwargs: Any) -> None:  # what the optimizer reads at step 1
        if not grads:
            grads.update({n: q.grad.detach().clone() for n, q in model.named_parameters()})

    getattr(opt, "optimizer", opt).register_step_pre_hook(first_grads)
    loader = p.setup_dataloader(data())
    steps: list[dict[str, Any]] = []
    for xb, yb, ids in loader:
        loss = nn.functional.mse_loss(model(xb), yb)
        p.backward(loss)
        info = p.step(log=False)
        steps.append({"loss": loss.item(), "ids": ids.tolist(), "live": info.strategy_metrics["replicas_live"],
                      "comm_bytes": info.comm_bytes})
        if p.steps == STEPS:
            break
    policy = p.layout.policy
    facts = {"engine": type(policy.engine).__name__, "policy": policy.name, "algorithm": p.comm.algorithm,
             "compressors": [c.name for c in p.comm.compressors],
             "batchnorm": [type(m).__name__ for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]}
    final = {k: v.detach().clone() for k, v in p.full_state_dict(model).items()}
    torch.save({"start": start, "steps": steps, "grads": grads, "final": final, "facts": facts},
               f"{out}/{run}_g{group}r{p.rank}.pt")
    p.close()


if __name__ == "__main__":
    for name in sys.argv[2].split(","):
        train(sys.argv[1], name)
