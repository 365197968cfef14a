"""Context parallelism's accounting against what a cp=2 rank really does, on plait's GPT at sequence 256, fp32.

Measured on 2 ranks, one step per ``cp_impl`` through ``plait.Plait.forward_backward``:

* the bytes plait's comm accounting counts for the cp collectives of one step (``TorchCollectiveCounter``, the
  counter the engine runs at the first step, entered around the micro-step alone) equal exactly
  ``plait.plan.layouts.context_wire_bytes`` (and the step's logged ``comm_bytes`` includes them);
* the bytes autograd saves for backward on one cp rank (``saved_tensors_hooks``, each storage once, parameters
  left out, as ``bench/context.py`` counts) within 10% of the activation memory ``plait plan memory`` predicts
  for that rank (``ring`` and ``alltoall``: every saved tensor is the shard's; ``allgather`` saves the gathered
  keys and values too).
"""

from __future__ import annotations

from pathlib import Path

import torch
from helpers import run_ranks

from .test_context import GLOBAL, SEQ, adamw, batches, gpt

IMPLS = ("ring", "alltoall", "allgather")


def _measure(rank: int, world: int, run_dir: str) -> dict:
    import plait
    from plait.comm.accounting import TorchCollectiveCounter
    from plait.comm.collectives import CommStats

    out = {}
    for impl in IMPLS:
        p = plait.Plait(parallel={"cp": 2, "cp_impl": impl}, train={"global_batch_size": GLOBAL,
                                                                    "micro_batch_size": GLOBAL},
                        run={"dir": f"{run_dir}/{impl}"}, observe={"progress": False, "trackers": []})
        model, _ = p.setup(gpt(), optimizer=adamw, loss_fn="causal_lm")
        params = {q.untyped_storage().data_ptr() for q in model.parameters()}
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor, params: set = params, seen: dict = seen) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                seen[storage.data_ptr()] = storage.nbytes()
            return t

        counter = TorchCollectiveCounter(CommStats())
        with counter, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            p.forward_backward(model, batches()[0])
        info = p.step(log=True)
        out[impl] = {"cp_bytes": counter.stats.bytes_sent, "step_bytes": info.comm_bytes,
                     "saved": sum(seen.values())}
        p.close()
    return out


def _simulated(cp: int, impl: str) -> dict:
    """``plait simulate``'s and ``plait plan memory``'s model of the measured run (one rank's figures)."""
    from plait import recipes
    from plait.config import Config
    from plait.plan.configured import simulate_config
    from plait.plan.hardware import load_profile

    cfg = Config()
    m = cfg.model
    m.n_layer, m.d_model, m.n_head, m.seq_len, m.vocab_size = 2, 32, 4, SEQ, 256
    cfg.parallel.cp, cfg.parallel.cp_impl, cfg.parallel.nproc = cp, impl, cp
    cfg.train.global_batch_size = cfg.train.micro_batch_size = GLOBAL
    sim = simulate_config(cfg, load_profile("a100-80gb"), derive_tp=False, models=recipes)
    return {"activations": sim.memory[0].activations, "sim": sim.as_dict()}


def test_cp_bytes_and_saved_activations_match_the_plan(tmp_path: Path) -> None:
    from plait.plan.layouts import context_wire_bytes

    ranks = run_ranks(_measure, 2, str(tmp_path), timeout=300)
    whole = _simulated(1, "ring")["activations"]
    for impl in IMPLS:
        predicted = context_wire_bytes(impl, GLOBAL, SEQ, heads=4, head_dim=8, cp=2, act_bytes=4, layers=2)
        plan = _simulated(2, impl)
        simulated = plan["sim"]["context_parallel"]
        assert simulated["cp"] == 2 and simulated["impl"] == impl, simulated
        for r in ranks:
            m = r[impl]
            assert m["cp_bytes"] == predicted == simulated["comm_bytes_per_step"], (impl, m["cp_bytes"], simulated)
            assert m["step_bytes"] > m["cp_bytes"], (impl, m)  # the engine counts them, and the gradients'
            assert abs(m["saved"] - plan["activations"]) <= 0.10 * plan["activations"], (impl, m["saved"], plan)
        if impl != "allgather":  # every saved tensor is the shard's: exactly half of one process's
            assert plan["activations"] == whole / 2, (impl, plan["activations"], whole)
        else:  # the gathered keys and values of the whole sequence besides: 2 layers x 2 x B H (T - T/2) D floats
            assert plan["activations"] == whole / 2 + 2 * 2 * GLOBAL * 4 * (SEQ // 2) * 8 * 4, (plan, whole)
