"""A user's own loop under ``fault.mode = "replicas"`` (run by tests/fault/test_replicas.py through ``plait run
--replicas 2``): each step's record (pid, step, loss, live groups) to OUT/group<g>.jsonl, the final weights to
OUT/final<g>.pt, the ``replicas`` block of its report (failures, heals, steps with fewer groups) to
OUT/replicas<g>.json. It trains at least MIN_STEPS steps, then until 5 steps in a row had every group live (so a
killed group's replacement has come back), at most MAX_STEPS; every group decides at the same step, as they see the
same quorums. A replacement starts once the survivor has stepped alone (``wait_until_stepped_alone``)."""

import json
import os
import sys
import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

import plait

# The most steps a run that waits for a killed group's replacement takes: each pauses 0.05 s, so the survivor waits
# over 200 s for it before the run ends without it (a loaded machine takes ~10-40 s to restart a group; 400 steps,
# 20-30 s, ended the survivor's run before its replacement came, and the replacement then started from step 0)
MAX_STEPS = 4000


def data() -> TensorDataset:
    x = torch.randn(2048, 8, generator=torch.Generator().manual_seed(1))
    return TensorDataset(x, x[:, :4].sum(1, keepdim=True) * 0.5)


def wait_until_stepped_alone(records: str, timeout_s: float = 120.0) -> None:
    """Return once the JSON lines of ``records`` (a surviving rank's, written a line per step) show a step with one
    live group, or after ``timeout_s`` (the test's "trained on alone" check then fails and says so)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open(records) as f:
            lines = f.read().split("\n")[:-1]  # whole lines only: the survivor may be writing the last one
        if any(json.loads(line).get("live") == 1 for line in lines if line.strip()):
            return
        time.sleep(0.05)


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


if __name__ == "__main__":
    out, min_steps = sys.argv[1], int(sys.argv[2])
    group, groups = int(os.environ["PLAIT_REPLICA_GROUP"]), int(os.environ["PLAIT_REPLICA_GROUPS"])
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        # a replacement that arrives only once the survivor has stepped alone (a new machine would take a while): on
        # a quiet machine the agent restarts the process faster than the Lighthouse's 5 s heartbeat timeout, and the
        # survivor would never step alone
        wait_until_stepped_alone(f"{out}/group0.jsonl")
    p = plait.Plait(fault={"mode": "replicas"}, run={"dir": f"{out}/replica{group}"}, comm={"timeout_s": 60},
                    train={"global_batch_size": 16, "micro_batch_size": 8, "steps": MAX_STEPS},
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
                if done or p.steps >= MAX_STEPS:
                    break
            else:
                continue
            break
    torch.save(model.state_dict(), f"{out}/final{group}.pt")
    with open(f"{out}/replicas{group}.json", "w") as f:  # what plait train writes to the group's summary.json
        json.dump(p.report()["replicas"], f)
    p.close()
