"""Save mid-epoch at dp=2, load in a fresh pair of processes and in one process: training continues as the
uninterrupted run does (data position, per-rank RNG, LR schedule, optimizer state).

The model is plait's GPT through the keep-your-loop API, with a learning-rate schedule that changes
every step. With dropout (0.1) the fresh pair of processes must continue bit for bit: every rank gets
its own dropout stream back. One process continues a dropout-free run: its accumulation (4 micro-steps
instead of 2 ranks x 2) sums in another order, so it matches within float32 rounding (losses 1e-5,
parameters 3e-5; measured below 1e-6).
"""

from __future__ import annotations

import pytest
import torch
from helpers import run_ranks
from references import plait_steps

STEPS, SAVE_AT, GLOBAL, MICRO, SEQ = 6, 3, 8, 2, 16
LOSS_ATOL, PARAM_ATOL = 1e-5, 3e-5


def _dataset():
    from plait.data.corpus import embedded_corpus_bytes
    from plait.data.text import TokenWindows

    tokens = torch.tensor(list(embedded_corpus_bytes()[:4000]), dtype=torch.long)
    return TokenWindows(tokens, SEQ, epoch_offsets=True, seed=1)  # 249 windows: 31 steps per epoch


def _run(run_dir: str, dropout: float, *, save: str | None = None, load: str | None = None,
         until: int = STEPS) -> dict:
    import plait
    from plait.config import ModelConfig
    from plait.models.tiny import seeded_gpt

    p = plait.Plait(run={"dir": run_dir}, train={"global_batch_size": GLOBAL, "micro_batch_size": MICRO, "seed": 1},
                    observe={"progress": False, "trackers": []})
    model = seeded_gpt(ModelConfig(n_layer=2, d_model=32, n_head=2, seq_len=SEQ, dropout=dropout))
    model, opt = p.setup(model, optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3),
                         scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)),
                         loss_fn="causal_lm")
    loader = p.setup_dataloader(_dataset())
    if load:
        extra = p.load(load, model=model, optimizer=opt, dataloader=loader)
        assert extra == {"note": "mid-epoch"} and p.steps == SAVE_AT
    lrs = []

    def after_step(info) -> None:
        lrs.append(info.lr)
        if save and p.steps == SAVE_AT:
            p.save(save, model=model, optimizer=opt, dataloader=loader, extra={"note": "mid-epoch"})

    losses = plait_steps(p, model, loader, until, after_step)
    state = p.full_state_dict(model)
    p.close()
    return {"losses": losses, "lrs": lrs, "state": state}


def _first(rank: int, world: int, root: str) -> dict:
    return {"straight": _run(f"{root}/a", 0.1), "saved": _run(f"{root}/b", 0.1, save=f"{root}/ckpt", until=SAVE_AT),
            "straight0": _run(f"{root}/c", 0.0), "saved0": _run(f"{root}/d", 0.0, save=f"{root}/ckpt0", until=SAVE_AT)}


def _second(rank: int, world: int, root: str) -> dict:
    return _run(f"{root}/e", 0.1, load=f"{root}/ckpt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[list[dict], list[dict], str]:
    root = str(tmp_path_factory.mktemp("resume"))
    first = run_ranks(_first, 2, root, timeout=300)
    second = run_ranks(_second, 2, root, timeout=300)  # a fresh pair of processes
    return first, second, root


def test_fresh_pair_of_processes_continues_bit_for_bit(runs) -> None:
    first, second, _ = runs
    for rank in (0, 1):
        straight, resumed = first[rank]["straight"], second[rank]
        assert resumed["losses"] == straight["losses"][SAVE_AT:]
        assert resumed["lrs"] == straight["lrs"][SAVE_AT:]
        assert all(torch.equal(resumed["state"][k], v) for k, v in straight["state"].items())
    # the checkpoint was taken mid-run: the first half alone ends elsewhere
    assert first[0]["saved"]["losses"] == first[0]["straight"]["losses"][:SAVE_AT]


def test_one_process_continues_a_two_rank_run(runs) -> None:
    first, _, root = runs
    straight = first[0]["straight0"]
    resumed = _run(f"{root}/f", 0.0, load=f"{root}/ckpt0")  # this process: world size 1, accumulation 4
    assert resumed["losses"] == pytest.approx(straight["losses"][SAVE_AT:], abs=LOSS_ATOL)
    assert resumed["lrs"] == pytest.approx(straight["lrs"][SAVE_AT:], rel=1e-12)
    assert max((resumed["state"][k] - v).abs().max().item() for k, v in straight["state"].items()) < PARAM_ATOL
