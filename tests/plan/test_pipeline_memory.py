"""What one pipeline rank keeps alive, measured on plait's own runs, against the memory model, per schedule.

A scaled-down Llama (grouped-query attention, SwiGLU, RMSNorm, rotary; 4 layers) at tp=2 with sequence
parallelism and pp=2 (4 gloo ranks), trained through ``plait.Plait`` with each schedule (1F1B; interleaved
1F1B and the zero-bubble V with two stages per rank), in float32 and under bf16 autocast (plait's bf16 in a
pipeline without ZeRO-3); and interleaved over 6 stages whose first holds the embedding alone and whose last the
norm and head alone. One schedule step after a warm-up step is measured by ``ActivationMeter``: every storage a saved
tensor or a stage's output refers to (parameters left out), counted once from its first reference until its
last is gone (a saved tensor's reference lives as long as its graph; a stage output's as long as the schedule
holds it): the micro-batches in flight and what ZBV's split backward leaves alive. Its peak must be within 5%
of the simulator's activation peak of that pipeline rank (plus autocast's weight copies, kept once per rank);
the receive buffers torch's stages keep per micro-batch (counted after the step) must equal the model's.
"""

from __future__ import annotations

import pytest
import torch
from helpers import run_ranks

C, HEADS, KV, FF, V, T, LAYERS = 64, 4, 2, 176, 112, 32, 4
MICRO, MB = 4, 2  # pipeline micro-batches per step, sequences in each
TOLERANCE = 0.05
ZERO3_LAYERS = 6  # three blocks per stage: more than the two units FSDP2 keeps gathered around one without a pipeline
CASES = [(s, v, prec, False) for s, v in (("1f1b", 1), ("interleaved", 2), ("zbv", 2)) for prec in ("fp32", "bf16")]
CASES.append(("interleaved", 3, "bf16", True))  # the embedding and the head each alone on a stage: 6 stages, 6 units


def _config(layers: int = LAYERS):
    import transformers

    return transformers.LlamaConfig(hidden_size=C, intermediate_size=FF, num_hidden_layers=layers,
                                    num_attention_heads=HEADS, num_key_value_heads=KV, vocab_size=V,
                                    max_position_embeddings=T, tie_word_embeddings=False)


class _Ref:
    """A saved tensor's reference: its release runs when autograd drops it."""

    __slots__ = ("t", "release")

    def __init__(self, t: torch.Tensor, release) -> None:
        self.t, self.release = t, release

    def __del__(self) -> None:
        self.release()


class ActivationMeter:
    """Peak bytes of the storages saved tensors and stage outputs refer to (module docstring)."""

    def __init__(self, stages: list[torch.nn.Module], params: list[torch.Tensor], pipeline_stages=()) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.live = self.peak = 0
        self.refs: dict[int, list[int]] = {}
        self.stages, self.handles, self.pipeline_stages = stages, [], list(pipeline_stages)

    def _storage(self, t):
        from torch.distributed.tensor import DTensor

        t = t._local_tensor if isinstance(t, DTensor) else t
        t = getattr(t, "elem", t)  # a functional collective's result
        if not isinstance(t, torch.Tensor):
            return None
        s = t.untyped_storage()
        return None if s.data_ptr() in self.params or s.nbytes() == 0 else s

    def hold(self, t):
        s = self._storage(t)
        if s is None:
            return None
        key = s.data_ptr()
        entry = self.refs.setdefault(key, [0, s.nbytes()])
        if entry[0] == 0:
            self.live += entry[1]
            self.peak = max(self.peak, self.live)
        entry[0] += 1
        return lambda: self._release(key)

    def _release(self, key: int) -> None:
        entry = self.refs[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self.refs[key]

    def _pack(self, t):
        release = self.hold(t)
        return _Ref(t, release) if release else t

    def _output(self, module, args, out) -> None:
        for t in out if isinstance(out, tuple) else (out,):
            self._hold_storage(t)

    def _hold_storage(self, t) -> None:
        """Count ``t`` until its storage is gone (whoever holds it: the schedule, a send in flight)."""
        import weakref

        release = self.hold(t)
        if release:
            weakref.finalize(self._storage(t), release)

    def _sends(self, stage, get_ops):
        """``get_ops`` of a stage, its tensors counted until freed: torch's multi-stage schedules keep each send's
        work, and with it the tensor sent (an output, or the gradient of an input), until the schedule step ends."""

        def ops(mb):
            out = get_ops(mb)
            for op in out:
                self._hold_storage(op.tensor)
            return out

        return ops

    def __enter__(self):
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda r: r.t if isinstance(r, _Ref) else r)
        self.hooks.__enter__()
        self.handles = [m.register_forward_hook(self._output) for m in self.stages]
        for stage in self.pipeline_stages:
            stage.get_fwd_send_ops = self._sends(stage, stage.get_fwd_send_ops)
            stage.get_bwd_send_ops = self._sends(stage, stage.get_bwd_send_ops)
        return self

    def __exit__(self, *exc) -> None:
        self.hooks.__exit__(*exc)
        for h in self.handles:
            h.remove()
        for stage in self.pipeline_stages:
            del stage.get_fwd_send_ops, stage.get_bwd_send_ops


def _receive_buffers(model) -> int:
    total = 0
    for stage in model._runner[0].stages:
        for infos in list(stage.args_recv_info.values()) + list(stage.grad_recv_info.values()):
            for info in infos:
                b = getattr(info, "buffer", None)
                if isinstance(b, torch.Tensor):
                    total += b.untyped_storage().nbytes()
                    total += b.grad.untyped_storage().nbytes() if b.grad is not None else 0
    return total


def _measure(rank: int, world: int, root: str) -> dict:
    import transformers
    from torch.distributed.tensor import DTensor

    import plait

    ids = torch.randint(0, V, (MICRO * MB, T), generator=torch.Generator().manual_seed(1))
    out = {}
    for schedule, v, precision, split in CASES:
        p = plait.Plait(parallel={"nproc": world, "tp": 2, "pp": 2, "sequence_parallel": True, "pp_schedule": schedule,
                                  "microbatches": MICRO, "pp_virtual_stages": v, "pp_balance": "count",
                                  "pp_split_embedding": split, "pp_split_head": split},
                        train={"global_batch_size": MICRO * MB, "micro_batch_size": MICRO * MB,
                               "precision": precision},
                        run={"dir": f"{root}/{schedule}-{precision}"}, observe={"progress": False, "trackers": []})
        torch.manual_seed(0)
        model, _ = p.setup(transformers.LlamaForCausalLM(_config()), loss_fn="causal_lm",
                           optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3))
        p.forward_backward(model, ids)  # warm-up: gradients and receive buffers exist from here on
        p.step()
        params = [q._local_tensor if isinstance(q, DTensor) else q for q in model.parameters()]
        with ActivationMeter(list(model.stages), params, model._runner[0].stages) as meter:
            p.forward_backward(model, ids)
        out[schedule, v, precision, split] = (meter.peak, _receive_buffers(model))
        p.step()
        p.close()
    out["zero3"] = _measure_unsharded_gradients(world, root, ids)
    return out


def _accumulated_gradients(stages) -> int:
    """Bytes of the unsharded gradients FSDP2 holds on this rank's stages (accumulated in the reduce dtype, or
    still on the unsharded parameter)."""
    from torch.distributed.fsdp import fully_shard

    total = 0
    for stage in stages:
        for state in fully_shard.state(stage.submod)._state_ctx.all_states:
            for group in state._fsdp_param_groups:
                for q in group.fsdp_params:
                    g = q.unsharded_accumulated_grad
                    if g is None and hasattr(q, "_unsharded_param"):
                        g = q._unsharded_param.grad
                    total += g.numel() * g.element_size() if g is not None else 0
    return total


def _gathered_parameters(stages) -> int:
    """Bytes of the parameters FSDP2 holds gathered (unsharded) on this rank's stages."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

    total = 0
    for stage in stages:
        for state in fully_shard.state(stage.submod)._state_ctx.all_states:
            for group in state._fsdp_param_groups:
                for q in group.fsdp_params:
                    if q.sharded_state == ShardedState.UNSHARDED:
                        total += q._unsharded_param.numel() * q._unsharded_param.element_size()
    return total


def _measure_unsharded_gradients(world: int, root: str, ids) -> dict:
    """pp=2 x dp=2 at ZeRO-3 in bf16 (FSDP2 per stage, resharding after forward), 1F1B over a 6-layer Llama: the
    most unsharded gradient bytes and gathered parameter bytes this rank's stage holds when its reduce-scatter
    starts (torch's REDUCE_GRAD, after its last backward)."""
    import transformers

    import plait

    p = plait.Plait(parallel={"nproc": world, "pp": 2, "zero": 3, "pp_schedule": "1f1b", "microbatches": MICRO,
                              "pp_balance": "count"},
                    train={"global_batch_size": MICRO * MB, "micro_batch_size": MICRO * MB // 2, "precision": "bf16"},
                    run={"dir": f"{root}/zero3"}, observe={"progress": False, "trackers": []})
    torch.manual_seed(0)
    model, _ = p.setup(transformers.LlamaForCausalLM(_config(ZERO3_LAYERS)), loss_fn="causal_lm",
                       optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3))
    stages, seen, gathered = model._runner[0].stages, [], []
    for stage in stages:
        def reduce(*args, _orig=stage.perform_reduce_grad, **kwargs):
            seen.append(_accumulated_gradients(stages))
            gathered.append(_gathered_parameters(stages))
            return _orig(*args, **kwargs)

        stage.perform_reduce_grad = reduce
    half = ids[p.dp_rank * MICRO * MB // 2:(p.dp_rank + 1) * MICRO * MB // 2]
    for _ in range(2):
        p.forward_backward(model, half)
        p.step()
    after = _accumulated_gradients(stages)
    p.close()
    return {"peak": max(seen), "reductions": len(seen), "after": after, "gathered": max(gathered)}


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> list[dict]:
    pytest.importorskip("transformers")
    return run_ranks(_measure, 4, str(tmp_path_factory.mktemp("ppmem")), timeout=600)


def _predicted(schedule: str, v: int, precision: str, split: bool = False):
    from plait.plan.hardware import load_profile
    from plait.plan.shapes import shape_from_hf
    from plait.plan.simulate import simulate
    from plait.plan.stages import Cluster
    from plait.plan.workload import Layout, Workload

    lay = Layout(dp=1, tp=2, sp=True, pp=2, schedule=schedule, virtual=v, microbatches=MICRO,
                 micro_batch_size=MICRO * MB, pp_balance="count", loss_parallel=False, split_embedding=split,
                 split_head=split)
    return simulate(Workload(shape_from_hf(_config(), T), lay, MICRO * MB, precision=precision),
                    Cluster.of(load_profile("h100-sxm"), 4))


@pytest.mark.parametrize("schedule,v,precision,split", CASES)
def test_pipeline_rank_activations_match_the_model(measured, schedule, v, precision, split) -> None:
    from plait.plan.schedule import stage_owner
    from plait.plan.simulate import _receive_buffers as predicted_buffers
    from plait.plan.stages import StageModel

    sim = _predicted(schedule, v, precision, split)
    owner = stage_owner(2, v, schedule)
    if split:
        assert [len(r) for r in sim.stages] == [0, 1, 1, 1, 1, 0]
    for rank, got in enumerate(measured):
        pp_rank = rank // 2  # ranks (0, 1) hold the first pipeline rank's stages, tp-split
        peak, buffers = got[schedule, v, precision, split]
        mem = sim.memory[pp_rank]
        want = mem.activations + mem.detail["autocast_weight_copies"]
        assert peak == pytest.approx(want, rel=TOLERANCE), (rank, peak, want)
        mine = [s for s in range(2 * v) if owner[s] == pp_rank]
        model = StageModel(sim.work, sim.cluster)
        assert buffers == predicted_buffers(model, mine, 2 * v), (rank, buffers)


def test_pipeline_zero3_keeps_whole_gradients_until_the_reduce_scatter(measured) -> None:
    """torch's schedule turns FSDP2's gradient sync and resharding after backward off for the micro-batches'
    backwards: each stage's gradients stay whole (fp32, the reduce dtype) and its units gathered (bf16) until its
    reduce-scatter, with ``reshard_after_forward`` too; the model's ``unsharded_gradients`` and
    ``gathered_units``."""
    from plait.plan.hardware import load_profile
    from plait.plan.shapes import shape_from_hf
    from plait.plan.simulate import simulate
    from plait.plan.stages import Cluster
    from plait.plan.workload import Layout, Workload

    lay = Layout(dp=2, pp=2, zero=3, schedule="1f1b", microbatches=MICRO, micro_batch_size=MICRO * MB // 2,
                 pp_balance="count", reshard_after_forward=True)
    sim = simulate(Workload(shape_from_hf(_config(ZERO3_LAYERS), T), lay, MICRO * MB, precision="bf16"),
                   Cluster.of(load_profile("h100-sxm"), 4))
    for rank, got in enumerate(measured):
        z, detail = got["zero3"], sim.memory[rank // 2].detail
        assert z["reductions"] == 2 and z["after"] == 0, z  # one stage, two steps; freed by the reduction
        assert z["peak"] == detail["unsharded_gradients"], (rank, z)
        assert z["gathered"] == detail["gathered_units"], (rank, z)
