"""A user's own loop under ``fault.mode = "replicas"`` with replica groups of several ranks (run by
tests/fault/test_replicas_sharded.py and test_replicas_inside.py through ``plait run --replicas 2 --nproc 2``), each
group sharded inside by ZeRO or FSDP2 (a small MLP), or split by tensor, pipeline, context or expert parallelism
(plait's tiny GPT, its embedding and head tied; with MoE blocks under ep).
Every rank writes its records to OUT/<run>_g<g>r<j>.jsonl: per step its pid, step, loss, live groups and the sample
ids it trained on.

``OUT LAYOUTS STEPS KILL_ZERO MIN_STEPS``. First, for each layout in LAYOUTS (comma-separated: a ZeRO stage 0-3, or
tp (parallel.tp=2), pp (parallel.pp=2, 1F1B over 2 pipeline micro-batches), cp_ring or cp_alltoall (parallel.cp=2)
or ep (parallel.ep=2, 4 experts per MoE block, balanced by bias)), one run of STEPS steps (group g's
weights from seed g before the first quorum), saving the full model it starts from and ends with
(OUT/<run>_start_..., OUT/<run>_full_g<g>r<j>.pt, gathered in its group; <run> is z<zero>, tp or pp) and checkpoints
two steps before the end (both groups) and one step before it (group 0); then a resumed run from those checkpoints
(group 1 from its older one) takes the last step again (OUT/<run>_resumed_g<g>r<j>.pt). Then the run at KILL_ZERO the
test kills a rank of: at least MIN_STEPS steps, then until 5 steps in a row had every group live (the killed group's
replacement, which starts here once the survivor has stepped alone, came back), at most MAX_STEPS; each rank saves
its own shards of the model and of the optimizer state (OUT/final_g<g>r<j>.pt)."""

import json
import os
import sys
import time
from typing import Any

import torch
from replica_script import MAX_STEPS, wait_until_stepped_alone
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import TensorDataset

import plait

MODEL_LAYOUTS = {"tp": {"tp": 2}, "pp": {"pp": 2, "microbatches": 2, "pp_balance": "count"},
                 "cp_ring": {"cp": 2, "cp_impl": "ring"}, "cp_alltoall": {"cp": 2, "cp_impl": "alltoall"},
                 "ep": {"ep": 2}}
GPT_SEQ, GPT_VOCAB = 16, 64


def data() -> TensorDataset:
    x = torch.randn(512, 8, generator=torch.Generator().manual_seed(1))
    return TensorDataset(x, x[:, :4].sum(1, keepdim=True) * 0.5, torch.arange(512))


def build() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


def gpt_data() -> TensorDataset:
    """Next-token pairs: windows of GPT_SEQ + 1 random tokens, the targets the inputs moved one token on."""
    tokens = torch.randint(GPT_VOCAB, (512, GPT_SEQ + 1), generator=torch.Generator().manual_seed(2))
    return TensorDataset(tokens[:, :-1], tokens[:, 1:], torch.arange(512))


def build_gpt(moe: bool = False) -> nn.Module:
    """plait's tiny GPT; ``moe``: each block's MLP a mixture of 4 experts, 2 per token, balanced by bias (the loads
    summed over every data-parallel rank move each expert's bias after every step), with DeepSeek-V3's sequence-wise
    balance loss."""
    from plait.config import MoeConfig
    from plait.models.tiny import GPT, tiny_config

    return GPT(tiny_config(n_layer=2, d_model=32, n_head=4, seq_len=GPT_SEQ, vocab_size=GPT_VOCAB),
               MoeConfig(num_experts=4, top_k=2, balance="bias", bias_update_rate=0.01, seq_aux_loss_coef=0.01)
               if moe else None)


def layout(name: str) -> tuple[dict[str, Any], Any, Any]:
    """(the [parallel] section, the model's builder, the data set's) of a layout's name."""
    if name in MODEL_LAYOUTS:
        return MODEL_LAYOUTS[name], (lambda: build_gpt(moe=name == "ep")), gpt_data
    return {"zero": int(name)}, build, data


def run_name(name: str) -> str:
    return name if name in MODEL_LAYOUTS else f"z{name}"


def local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def make(out: str, name: str, parallel: dict[str, Any]) -> plait.Plait:
    group = int(os.environ["PLAIT_REPLICA_GROUP"])
    return plait.Plait(fault={"mode": "replicas"}, parallel=parallel, run={"dir": f"{out}/{name}/replica{group}"},
                    comm={"timeout_s": 60}, train={"global_batch_size": 16, "steps": MAX_STEPS},  # one micro-step
                    observe={"progress": False, "trackers": []})


def setup(p: plait.Plait, which: str) -> tuple[nn.Module, Any]:
    _, builder, _ = layout(which)
    gpt = which in MODEL_LAYOUTS  # a pipeline's stages run inside the schedule: the loss is given here
    return p.setup(builder(), optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
                   loss_fn="causal_lm" if gpt else None)  # the targets given as they are: no shift


def train_step(p: plait.Plait, model: nn.Module, which: str, xb: torch.Tensor, yb: torch.Tensor) -> float:
    """One micro-batch: the MLP through the user's own forward, the GPT through forward_backward (loss parallel
    under tp; the schedule under pp, which returns the loss on the last stage's rank only, 0 elsewhere)."""
    if which in MODEL_LAYOUTS:
        return float(p.forward_backward(model, (xb, yb)))
    loss = nn.functional.mse_loss(model(xb), yb)
    p.backward(loss)
    return loss.item()


def run(out: str, which: str, min_steps: int, until_all_live: bool, saves: dict[int, str] | None = None
        ) -> tuple[plait.Plait, nn.Module, Any]:
    group, groups = int(os.environ["PLAIT_REPLICA_GROUP"]), int(os.environ["PLAIT_REPLICA_GROUPS"])
    name = "kill" if until_all_live else run_name(which)
    parallel, _, dataset = layout(which)
    p = make(out, name, parallel)
    torch.manual_seed(group)  # different weights per group: the first quorum must make them the same
    model, opt = setup(p, which)
    if not until_all_live:  # the weights every group starts from, after the first quorum
        start = p.full_state_dict(model)
        torch.save({k: v.detach().clone() for k, v in start.items()}, f"{out}/{name}_start_g{group}r{p.rank}.pt")
    loader = p.setup_dataloader(dataset())
    live: list[int] = []
    path = f"{out}/{name}_g{group}r{p.rank}.jsonl"
    with open(path, "a") as records:
        records.write(json.dumps({"pid": os.getpid(), "joined_at": p.steps, "reduce": [  # over the group's ranks
            p.reduce(1.0), p.reduce(1.0, op="sum"), p.reduce(1.0, over="world")]}) + "\n")
        while True:
            for xb, yb, ids in loader:
                loss = train_step(p, model, which, xb, yb)
                info = p.step(log=False)
                live.append(info.strategy_metrics["replicas_live"])
                records.write(json.dumps({"pid": os.getpid(), "step": p.steps, "loss": loss, "live": live[-1],
                                          "ids": ids.tolist(), "t": time.time()}) + "\n")
                records.flush()
                if p.steps in (saves or {}):  # this group's own checkpoint, sharded as its layout shards
                    p.save(f"{out}/{name}_{saves[p.steps]}_g{group}", dataloader=loader)
                if until_all_live:
                    time.sleep(0.05)
                done = p.steps >= min_steps and (not until_all_live or (
                    len(live) >= 5 and all(n == groups for n in live[-5:])))
                if done or p.steps >= MAX_STEPS:
                    break
            else:
                continue
            break
    return p, model, opt


def compare(out: str, layouts: list[str], steps: int) -> None:
    group = int(os.environ["PLAIT_REPLICA_GROUP"])
    for which in layouts:
        name = run_name(which)
        # checkpoints: both groups two steps before the end, group 0 also one step before it
        saves = {steps - 2: "early", **({steps - 1: "last"} if group == 0 else {})}
        p, model, _ = run(out, which, steps, until_all_live=False, saves=saves)
        full = p.full_state_dict(model)
        torch.save({k: v.detach().clone() for k, v in full.items()}, f"{out}/{name}_full_g{group}r{p.rank}.pt")
        p.close()
        # a resumed run: group 0 from its newest checkpoint, group 1 from its older one (it heals to group 0's
        # step at the load), fresh weights of another seed before the load; then the last step again
        p = make(out, f"{name}_resumed", layout(which)[0])
        torch.manual_seed(10 + group)
        model, _ = setup(p, which)
        loader = p.setup_dataloader(layout(which)[2]())
        p.load(f"{out}/{name}_{'last' if group == 0 else 'early'}_g{group}", dataloader=loader)
        loaded = p.steps
        xb, yb, ids = next(iter(loader))
        train_step(p, model, which, xb, yb)
        info = p.step(log=False)
        full = p.full_state_dict(model)
        torch.save({"loaded": loaded, "steps": p.steps, "ids": ids.tolist(), "live": info.strategy_metrics[
            "replicas_live"], **{k: v.detach().clone() for k, v in full.items()}},
                   f"{out}/{name}_resumed_g{group}r{p.rank}.pt")
        p.close()


def kill(out: str, which: str, min_steps: int) -> None:
    group = int(os.environ["PLAIT_REPLICA_GROUP"])
    p, model, opt = run(out, which, min_steps, until_all_live=True)
    inner = opt.optimizer if hasattr(opt, "buckets") else opt
    state = {f"optim.{i}.{k}": local(v) for i, s in inner.state_dict()["state"].items() for k, v in s.items()
             if isinstance(v, torch.Tensor)}
    model_sd = {f"model.{k}": local(v) for k, v in p.strategy.state.model_entries().items()}
    torch.save({**model_sd, **state}, f"{out}/final_g{group}r{p.rank}.pt")
    p.close()


if __name__ == "__main__":
    # OUT LAYOUTS STEPS KILL_LAYOUT MIN_STEPS: the compared runs, then the run whose rank the test kills
    out, layouts, steps, kill_layout, min_steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], \
        int(sys.argv[5])
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
        compare(out, layouts.split(","), steps)
    else:
        # the killed group's replacement goes straight to the run it left, once the survivor has stepped alone (a new
        # machine would take a while to arrive; one that came at once would find the survivor never alone)
        wait_until_stepped_alone(f"{out}/kill_g0r0.jsonl")
    kill(out, kill_layout, min_steps)
