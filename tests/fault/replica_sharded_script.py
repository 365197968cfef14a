"""A user's own loop under ``fault.mode = "replicas"`` with replica groups of several ranks (run by
tests/fault/test_replicas_sharded.py through ``plait run --replicas 2 --nproc 2``), each group sharded inside by ZeRO
or FSDP2. Every rank writes its records to OUT/<run>_g<g>r<j>.jsonl: per step its pid, step, loss, live groups and
the sample ids it trained on.

``OUT ZEROS STEPS KILL_ZERO MIN_STEPS``. First, for each ZeRO stage in ZEROS (comma-separated), one run of STEPS steps
(group g's weights from seed g before the first quorum), saving the full model it starts from and ends with
(OUT/z<zero>_start_..., OUT/z<zero>_full_g<g>r<j>.pt, gathered in its group) and checkpoints two steps before the end
(both groups) and one step before it (group 0); then a resumed run from those checkpoints (group 1 from its older
one) takes the last step again (OUT/z<zero>_resumed_g<g>r<j>.pt). Then the run at KILL_ZERO the test kills a rank
of: at least MIN_STEPS steps, then until 5 steps in a row had every group live (the killed group's replacement, which
starts here, came back), at most 400; each rank saves its own shards of the model and of the optimizer state
(OUT/final_g<g>r<j>.pt)."""

import json
import os
import sys
import time
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import TensorDataset

import plait


def data() -> TensorDataset:
    x = torch.randn(512, 8, generator=torch.Generator().manual_seed(1))
    return TensorDataset(x, x[:, :4].sum(1, keepdim=True) * 0.5, torch.arange(512))


def build() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


def local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def make(out: str, name: str, zero: int) -> plait.Plait:
    group = int(os.environ["PLAIT_REPLICA_GROUP"])
    return plait.Plait(fault={"mode": "replicas"}, parallel={"zero": zero}, run={"dir": f"{out}/{name}/replica{group}"},
                    comm={"timeout_s": 60}, train={"global_batch_size": 16, "micro_batch_size": 4, "steps": 400},
                    observe={"progress": False, "trackers": []})


def run(out: str, name: str, zero: int, min_steps: int, until_all_live: bool, saves: dict[int, str] | None = None
        ) -> tuple[plait.Plait, nn.Module, Any]:
    group, groups = int(os.environ["PLAIT_REPLICA_GROUP"]), int(os.environ["PLAIT_REPLICA_GROUPS"])
    p = make(out, name, zero)
    torch.manual_seed(group)  # different weights per group: the first quorum must make them the same
    model, opt = p.setup(build(), optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2))
    if not until_all_live:  # the weights every group starts from, after the first quorum
        start = p.full_state_dict(model)
        torch.save({k: v.detach().clone() for k, v in start.items()}, f"{out}/{name}_start_g{group}r{p.rank}.pt")
    loader = p.setup_dataloader(data())
    live: list[int] = []
    path = f"{out}/{name}_g{group}r{p.rank}.jsonl"
    with open(path, "a") as records:
        records.write(json.dumps({"pid": os.getpid(), "joined_at": p.steps, "reduce": [  # over the group's ranks
            p.reduce(1.0), p.reduce(1.0, op="sum"), p.reduce(1.0, over="world")]}) + "\n")
        while True:
            for xb, yb, ids in loader:
                loss = nn.functional.mse_loss(model(xb), yb)
                p.backward(loss)
                info = p.step(log=False)
                live.append(info.strategy_metrics["replicas_live"])
                records.write(json.dumps({"pid": os.getpid(), "step": p.steps, "loss": loss.item(), "live": live[-1],
                                          "ids": ids.tolist(), "t": time.time()}) + "\n")
                records.flush()
                if p.steps in (saves or {}):  # this group's own checkpoint, sharded as its layout shards
                    p.save(f"{out}/{name}_{saves[p.steps]}_g{group}", dataloader=loader)
                if until_all_live:
                    time.sleep(0.05)
                done = p.steps >= min_steps and (not until_all_live or (
                    len(live) >= 5 and all(n == groups for n in live[-5:])))
                if done or p.steps >= 400:
                    break
            else:
                continue
            break
    return p, model, opt


def compare(out: str, zeros: list[int], steps: int) -> None:
    group = int(os.environ["PLAIT_REPLICA_GROUP"])
    for zero in zeros:
        # checkpoints: both groups two steps before the end, group 0 also one step before it
        saves = {steps - 2: "early", **({steps - 1: "last"} if group == 0 else {})}
        p, model, _ = run(out, f"z{zero}", zero, steps, until_all_live=False, saves=saves)
        full = p.full_state_dict(model)
        torch.save({k: v.detach().clone() for k, v in full.items()}, f"{out}/z{zero}_full_g{group}r{p.rank}.pt")
        p.close()
        # a resumed run: group 0 from its newest checkpoint, group 1 from its older one (it heals to group 0's
        # step at the load), fresh weights of another seed before the load; then the last step again
        p = make(out, f"z{zero}_resumed", zero)
        torch.manual_seed(10 + group)
        model, _ = p.setup(build(), optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2))
        loader = p.setup_dataloader(data())
        p.load(f"{out}/z{zero}_{'last' if group == 0 else 'early'}_g{group}", dataloader=loader)
        loaded = p.steps
        xb, yb, ids = next(iter(loader))
        p.backward(nn.functional.mse_loss(model(xb), yb))
        info = p.step(log=False)
        full = p.full_state_dict(model)
        torch.save({"loaded": loaded, "steps": p.steps, "ids": ids.tolist(), "live": info.strategy_metrics[
            "replicas_live"], **{k: v.detach().clone() for k, v in full.items()}},
                   f"{out}/z{zero}_resumed_g{group}r{p.rank}.pt")
        p.close()


def kill(out: str, zero: int, min_steps: int) -> None:
    group = int(os.environ["PLAIT_REPLICA_GROUP"])
    p, model, opt = run(out, "kill", zero, min_steps, until_all_live=True)
    inner = opt.optimizer if hasattr(opt, "buckets") else opt
    state = {f"optim.{i}.{k}": local(v) for i, s in inner.state_dict()["state"].items() for k, v in s.items()
             if isinstance(v, torch.Tensor)}
    model_sd = {f"model.{k}": local(v) for k, v in p.strategy.model_entries().items()}
    torch.save({**model_sd, **state}, f"{out}/final_g{group}r{p.rank}.pt")
    p.close()


if __name__ == "__main__":
    # OUT ZEROS STEPS KILL_ZERO MIN_STEPS: the compared runs, then the run whose rank the test kills
    out, zeros, steps, kill_zero, min_steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), \
        int(sys.argv[5])
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
        compare(out, [int(z) for z in zeros.split(",")], steps)
    else:
        # the killed group's replacement goes straight to the run it left; a moment late (a new machine would be),
        # so that the survivor steps alone
        time.sleep(1)
    kill(out, kill_zero, min_steps)
