"""A user's own loop under ``fault.mode = "replicas"`` (run by tests/fault/test_replicas.py through ``plait run
--replicas 2``): each step's record (pid, step, loss, live groups) to OUT/group<g>.jsonl, the final weights to
OUT/final<g>.pt, the ``replicas`` block of its report (failures, heals, steps with fewer groups) to
OUT/replicas<g>.json. It trains at least MIN_STEPS steps, then until 5 steps in a row had every group live (so a
killed group's replacement has come back), at most 400; every group decides at the same step, as they see the same
quorums."""

import json
import os
import sys
import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

import plait


def data() -> TensorDataset:
    x = torch.randn(2048, 8, generator=torch.Generator().manual_seed(1))
    return TensorDataset(x, x[:, :4].sum(1, keepdim=True) * 0.5)


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


if __name__ == "__main__":
    out, min_steps = sys.argv[1], int(sys.argv[2])
    group, groups = int(os.environ["PLAIT_REPLICA_GROUP"]), int(os.environ["PLAIT_REPLICA_GROUPS"])
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        # a replacement that takes a while to arrive (a new machine would): on a quiet machine the agent restarts
        # the process faster than the Lighthouse's 5 s heartbeat timeout, and the survivor would never step alone
        time.sleep(10)
    p = plait.Plait(fault={"mode": "replicas"}, run={"dir": f"{out}/replica{group}"}, comm={"timeout_s": 60},
                    train={"global_batch_size": 16, "micro_batch_size": 8, "steps": 400},
                    observe={"progress": False, "trackers": []})
    torch.manual_seed(100 + group)  # different weights per group: the first quorum must make them the same
    model, _ = p.setup(nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1)),
                       optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2))
    loader = p.setup_dataloader(data())
    live: list[int] = []
    with open(f"{out}/group{group}.jsonl", "a") as records:
        # a summed loss's divisor for 8 x 3 labels: the group's own count (its gradients are then averaged over the
        # live groups), not a share of a count over groups that may not be there
        items = float(p.num_items_in_batch(torch.ones(8, 3, dtype=torch.long), shift=False))
        records.write(json.dumps({"pid": os.getpid(), "joined_at": p.steps, "items": items}) + "\n")
        while True:
            for xb, yb in loader:
                loss = nn.functional.mse_loss(model(xb), yb)
                p.backward(loss)
                info = p.step(log=False)
                live.append(info.strategy_metrics["replicas_live"])
                records.write(json.dumps({"pid": os.getpid(), "step": p.steps, "loss": float(loss), "live": live[-1],
                                          "heals": info.strategy_metrics["replica_heals"], "t": time.time()}) + "\n")
                records.flush()
                time.sleep(0.05)
                done = p.steps >= min_steps and len(live) >= 5 and all(n == groups for n in live[-5:])
                if done or p.steps >= 400:
                    break
            else:
                continue
            break
    torch.save(model.state_dict(), f"{out}/final{group}.pt")
    with open(f"{out}/replicas{group}.json", "w") as f:  # what plait train writes to the group's summary.json
        json.dump(p.report()["replicas"], f)
    p.close()
