"""A user's own loop under DiLoCo with torchft replica groups (``parallel.sync = "diloco"``, ``fault.mode =
"replicas"``; run by tests/fault/test_replicas_diloco.py through ``plait run --replicas 2 --nproc 2``): each group one
DiLoCo replica, ZeRO-1 over its 2 ranks inside, H = 2, a small MLP.

``OUT STEPS``. First a run of STEPS steps (group g's weights from seed g before the first quorum): each rank writes
OUT/run_g<g>r<j>.jsonl (per step its loss, the sample ids it trained on, the live groups and whether DiLoCo
synchronised), saves the whole model it starts from (OUT/start_g<g>r<j>.pt) and ends with (OUT/full_g<g>r<j>.pt);
group 0 saves a checkpoint after step 2 (a synchronisation), group 1 after step 1. Then a resumed run: fresh weights
of another seed, each group loads its own checkpoint (group 1 its older one: it heals from group 0 at the load) and
trains until step STEPS; each rank saves what it loaded and ends with (OUT/resumed_g<g>r<j>.pt)."""

import json
import os
import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset

import plait

H = 2


def data() -> TensorDataset:
    x = torch.randn(512, 8, generator=torch.Generator().manual_seed(1))
    return TensorDataset(x, x[:, :4].sum(1, keepdim=True) * 0.5, torch.arange(512))


def build() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


def adamw(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(m.parameters(), lr=1e-2)


def make(out: str, name: str, group: int) -> plait.Plait:
    return plait.Plait(fault={"mode": "replicas"}, run={"dir": f"{out}/{name}/replica{group}"},
                       parallel={"zero": 1, "sync": "diloco", "diloco_inner_steps": H},
                       comm={"timeout_s": 60}, train={"global_batch_size": 16, "steps": 400},
                       observe={"progress": False, "trackers": []})


def whole(p: plait.Plait, model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in p.full_state_dict(model).items()}


def train(p: plait.Plait, model: nn.Module, loader, until: int, records, save: tuple[int, str] | None = None) -> None:
    """Steps until ``p.steps == until``, a checkpoint at ``save`` (step, path)."""
    for xb, yb, ids in loader:
        loss = nn.functional.mse_loss(model(xb), yb)
        p.backward(loss)
        info = p.step(log=False)
        metrics = info.strategy_metrics
        records.write(json.dumps({"step": p.steps, "loss": loss.item(), "ids": ids.tolist(),
                                  "live": metrics["replicas_live"], "synced": metrics["diloco_synced"]}) + "\n")
        if save is not None and p.steps == save[0]:
            p.save(save[1], dataloader=loader)
        if p.steps == until:
            break


def main(out: str, steps: int) -> None:
    group = int(os.environ["PLAIT_REPLICA_GROUP"])
    p = make(out, "run", group)
    torch.manual_seed(group)  # different weights per group: the first quorum makes them group 0's
    model, _ = p.setup(build(), optimizer=adamw)
    torch.save(whole(p, model), f"{out}/start_g{group}r{p.rank}.pt")
    loader = p.setup_dataloader(data())
    ckpt = f"{out}/ckpt_g{group}"  # group 0 at a synchronisation, group 1 one step before it
    with open(f"{out}/run_g{group}r{p.rank}.jsonl", "w") as records:
        train(p, model, loader, steps, records, save=(2 - group, ckpt))
    torch.save(whole(p, model), f"{out}/full_g{group}r{p.rank}.pt")
    p.close()

    p = make(out, "resumed", group)
    torch.manual_seed(10 + group)
    model, _ = p.setup(build(), optimizer=adamw)
    loader = p.setup_dataloader(data())
    p.load(ckpt, dataloader=loader)  # the group's own; group 1 heals from group 0 at the load
    loaded, healed_steps = whole(p, model), p.steps
    with open(f"{out}/resumed_g{group}r{p.rank}.jsonl", "w") as records:
        train(p, model, loader, steps, records)
    torch.save({"loaded": loaded, "steps": healed_steps, "final": whole(p, model)},
               f"{out}/resumed_g{group}r{p.rank}.pt")
    p.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
