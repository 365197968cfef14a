"""``train.precision = "fp8"``: torchao's Float8Linear for the model's Linears, bf16 autocast for the rest.

The reference is the user's own loop: ``torchao.float8.convert_to_float8_training`` on the same Linears, the model
under ``torch.autocast(bfloat16)``, AdamW, no clipping. On this CPU torch computes the float8 matmuls itself
(``torch._scaled_mm``), the same arithmetic a GPU's tensor cores run, without their speed.

- one process: plait's losses and parameters after 6 steps equal the reference's exactly (tolerance 0); the head
  and the Linears whose dimensions do not divide by 16 stay ``nn.Linear``; checkpoint keys are the bf16 model's;
  the loss after 30 steps within 1% of bf16's;
- two ranks (plait's reducer, and ZeRO-3 with float8 all-gathers): losses, gradients and parameters after 3 steps
  against one process running the same two half-batches as two accumulation micro-steps (dynamic float8 scales
  are per micro-batch, as on each rank), without clipping (a norm summed in another order moves parameters by a
  rounding, which a float8 cast, a step function, can turn into a whole float8 step): plait's reducer equal bit
  for bit (tolerance 0); ZeRO-3, whose bf16 is FSDP2's (bf16 parameters, not autocast), its Linear weights
  gathered in float8, losses within 1% of the reference;
- the parameter server, the one layout float8 does not compose with, and a missing Linear to convert: one clear
  error each (every other dimension: ``test_float8_compose``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import run_ranks

import plait
from plait.config import ConfigError
from plait.models.tiny import tiny_config

pytest.importorskip("torchao.float8")

# plait's tiny GPT (d_model 32, 16 tokens a row): on the CPU ``torch._scaled_mm`` is a plain loop whose time
# grows with tokens x in x out (about 30 M multiply-adds a second), so each step costs ~9x less than at d_model 64
# over 32 tokens while every Linear but the head still divides by 16 and the loss still falls from 5.5 to ~2.6.
MC = tiny_config()
LR, STEPS = 3e-3, 6


def _gpt() -> torch.nn.Module:
    from plait.models.tiny import seeded_gpt

    return seeded_gpt(MC, seed=1)


def _data(steps: int, batch: int = 8) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    base = torch.randint(0, 256, (batch, 8), generator=g)  # a learnable, repeating pattern
    seq = base.repeat(1, 5)[:, :MC.seq_len + 1]
    return torch.stack([seq.roll(i, dims=1) for i in range(steps)])


def _loss(model: torch.nn.Module, b: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(b[:, :-1]).float().flatten(0, 1), b[:, 1:].flatten())


def _plait(root: str, precision: str, **sections: Any) -> plait.Plait:
    world = sections.pop("world", 1)
    return plait.Plait(train={"global_batch_size": 8, "micro_batch_size": 8 // world, "precision": precision,
                              "log_every": 10**6, "steps": 10**6, "eval_every": 0},
                       optim={"grad_clip": 0.0, "lr": LR, "warmup_steps": 0, "min_lr_ratio": 1.0},
                       checkpoint={"every": 0}, observe={"progress": False, "trackers": []}, run={"dir": root},
                       **sections)


def _adamw(m: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(m.parameters(), lr=LR)


def _reference(data: torch.Tensor, micro: int) -> tuple[list[float], torch.nn.Module, list[dict]]:
    """The user's loop: float8 Linears, bf16 autocast, ``micro`` accumulation micro-steps per step."""
    from torchao.float8 import convert_to_float8_training

    from plait.parallel.float8 import eligible

    model = _gpt()
    names = set(eligible(model))
    convert_to_float8_training(model, module_filter_fn=lambda _m, fqn: fqn in names)
    opt = _adamw(model)
    losses, grads = [], []
    for batch in data:
        total = 0.0
        for part in batch.chunk(micro):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = _loss(model, part) / micro
            loss.backward()
            total += loss.item()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, model, grads


def test_one_process_equals_the_users_float8_loop(tmp_path) -> None:
    data = _data(STEPS)
    p = _plait(str(tmp_path / "fp8"), "fp8")
    model, _ = p.setup(_gpt(), optimizer=_adamw)
    losses = []
    for b in data:
        loss = _loss(model, b)
        p.backward(loss)
        p.step()
        losses.append(loss.item())
    state = p.full_state_dict(model)
    p.close()
    ref_losses, ref, _ = _reference(data, 1)
    assert losses == ref_losses
    for name, value in ref.state_dict().items():
        assert torch.equal(state[name], value), name
    kinds = {n: type(m).__name__ for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert kinds["head"] == "Linear" and kinds["blocks.0.attn.q"] == "Float8Linear", kinds
    assert sum(k == "Float8Linear" for k in kinds.values()) == 6 * MC.n_layer
    assert set(state) == set(_gpt().state_dict())


def test_float8_loss_stays_within_one_percent_of_bf16(tmp_path) -> None:
    data = _data(30)
    final = {}
    for precision in ("bf16", "fp8"):
        p = _plait(str(tmp_path / precision), precision)
        model, _ = p.setup(_gpt(), optimizer=_adamw)
        for b in data:
            loss = _loss(model, b)
            p.backward(loss)
            p.step()
        final[precision] = loss.item()
        p.close()
    assert final["bf16"] < 4.0, final  # it learned the pattern (from ln 256 = 5.5)
    assert abs(final["fp8"] / final["bf16"] - 1) < 0.01, final


def _two_ranks(rank: int, world: int, root: str) -> dict[str, Any]:
    out = {}
    data = _data(3)
    for name, parallel in (("reducer", {}), ("zero3", {"zero": 3})):
        p = _plait(f"{root}/{name}", "fp8", world=2, parallel=parallel)
        model, opt = p.setup(_gpt(), optimizer=_adamw)
        losses, grads = [], []
        names = {id(q): n for n, q in model.named_parameters()}

        def record(optimizer: Any, *_: Any, grads: list = grads, names: dict = names) -> None:
            grads.append(  # the reduced gradients the update reads
                {names[id(q)]: (q.grad.full_tensor() if hasattr(q.grad, "full_tensor") else q.grad.clone())
                          for group in optimizer.param_groups for q in group["params"]})

        opt.register_step_pre_hook(record)
        for b in data:
            loss = _loss(model, b.chunk(2)[rank])
            p.backward(loss)
            p.step()
            losses.append(p.reduce(loss.detach(), op="mean").item())
        wrapped = sum(type(q).__name__ == "WeightWithDynamicFloat8CastTensor"  # gathered in float8
                      or type(getattr(q, "_local_tensor", None)).__name__ == "WeightWithDynamicFloat8CastTensor"
                      for q in model.parameters())
        out[name] = (losses, grads, p.full_state_dict(model), wrapped)
        p.close()
    return out


def test_two_ranks_equal_one_process_over_the_same_micro_batches(tmp_path) -> None:
    results = run_ranks(_two_ranks, 2, str(tmp_path), timeout=300)[0]
    ref_losses, ref, ref_grads = _reference(_data(3), 2)
    losses, grads, state, _ = results["reducer"]  # bit for bit: the same float8 casts of the same tensors
    assert losses == ref_losses
    for step, (got, want) in enumerate(zip(grads, ref_grads, strict=True)):
        for n, g in want.items():
            assert torch.equal(got[n], g), (step, n, (got[n] - g).abs().max())
    for n, value in ref.state_dict().items():
        assert torch.equal(state[n], value), n
    # ZeRO-3 computes through FSDP2's bf16 policy (bf16 parameters, not autocast) with float8 all-gathers: the
    # same float8 Linears over other bf16 roundings, so its losses are held to the fp8-against-bf16 bound (1%)
    losses, _, _, wrapped = results["zero3"]
    assert wrapped == 6 * MC.n_layer, wrapped
    assert max(abs(a / b - 1) for a, b in zip(losses, ref_losses, strict=True)) < 0.01, (losses, ref_losses)


def test_layouts_and_models_float8_cannot_take_are_one_error(tmp_path) -> None:
    with pytest.raises(ConfigError, match="train.precision=fp8 does not run under parallel.mode=ps"):
        from plait.config import Config
        from plait.validate import validate

        cfg = Config()
        cfg.train.precision, cfg.parallel.mode = "fp8", "ps"
        validate(cfg, 3)
    p = _plait(str(tmp_path / "tiny"), "fp8")
    with pytest.raises(ConfigError, match="no Linear of this model can multiply in float8"):
        p.setup(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)))
    p.close()
