"""plait's GPT under tensor parallelism: the plan its spec (``plait.models.gpt.spec``) registers for the GPT class
(the model itself knows nothing of parallelism; its pipeline stages are ``plait.models.gpt.pipeline``).

Tensor-parallel layout on a ``tp`` mesh of size t (Megatron, on DTensor):

* ``attn.q/k/v``: column-parallel, so each rank holds ``n_head / t`` whole heads; ``attn.proj`` is
  row-parallel. Forward: one all-reduce (sequence parallel: a reduce-scatter) after ``proj``;
  backward: one all-reduce (sequence parallel: an all-gather) of the block input's gradient.
* ``mlp.fc`` column-parallel, ``mlp.proj`` row-parallel: the same one collective each way.
* ``tok_emb``: vocabulary-parallel (row-wise on the ``(V, C)`` table): each rank looks up the tokens of
  its vocabulary slice, zeros the others, and the partial embeddings are summed (all-reduce, or
  reduce-scatter along the sequence with sequence parallelism).
* ``head``: column-parallel on the vocabulary, its output kept as a vocabulary-sharded DTensor, and the
  cross-entropy computed under ``loss_parallel()`` without gathering the ``(B, T, V)`` logits.
* Tied weights: ``head.weight`` is ``tok_emb.weight``, a ``(V, C)`` table. Row-wise on the embedding and
  column-wise on the head both shard dim 0 (the vocabulary) of that same table, so one DTensor
  ``Shard(0)`` parameter serves both; the tie is restored after the plan (``head.weight =
  tok_emb.weight``): one parameter, one gradient that accumulates both uses.
* Sequence parallelism: ``ln1``, ``ln2``, ``ln_f``, the dropouts and the residual stream hold
  ``(B, T / t, C)`` (sequence ``Shard(1)``); the position embedding looks up only this rank's
  positions. Before attention/MLP an all-gather restores the full sequence (backward: a
  reduce-scatter); after ``proj`` a reduce-scatter replaces the all-reduce (backward: all-gather).
  q, k, v and fc keep only their input's sequence shard for backward and gather it again there
  (``plait.parallel.tensor.regather``): one more all-gather per block input in backward. An MoE feed-forward
  runs on the rank's own sequence shard, no gather (``plait.parallel.tensor.local_tokens``).

Dropout: tensor-parallel ranks of a model replica share one random stream (the engine seeds them
alike), so dropout on replicated activations draws the same mask on all of them, as it must. Attention
dropout over a rank's own heads, and with sequence parallelism the residual dropout over its own
sequence slice, draw from a per-rank stream instead (``plait.models.gpt.model.dropout_stream``).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from plait.config import ParallelConfig
from plait.models.gpt.model import GPT
from plait.nn.moe import MoE
from plait.parallel.tensor.float8 import float8_plan
from plait.parallel.tensor.local_tokens import LocalTokens
from plait.parallel.tensor.plan import PrepareGatheredInput, TensorParallelError, mark_loss_parallel
from plait.parallel.tensor.regather import ColwiseRegather, GatherSequence


def check_tensor_parallel(n_head: int, d_model: int, vocab_size: int, seq_len: int, tp: int,
                          sequence_parallel: bool) -> None:
    """Raise ``TensorParallelError`` naming what to change when the GPT cannot split ``tp`` ways."""
    if tp < 1:
        raise TensorParallelError(f"parallel.tp must be at least 1; got {tp}")
    if n_head % tp:
        raise TensorParallelError(
            f"model.n_head={n_head} does not divide by parallel.tp={tp}: tensor parallelism splits whole "
            f"attention heads; choose tp among the divisors of n_head or change model.n_head"
        )
    if vocab_size % tp:
        raise TensorParallelError(
            f"model.vocab_size={vocab_size} does not divide by parallel.tp={tp}: the embedding and head "
            f"are split along the vocabulary; pad vocab_size to a multiple of tp"
        )
    if (4 * d_model) % tp:
        raise TensorParallelError(f"the MLP width 4*d_model={4 * d_model} does not divide by tp={tp}")
    if sequence_parallel and seq_len % tp:
        raise TensorParallelError(
            f"sequence parallelism shards the sequence: model.seq_len={seq_len} must divide by tp={tp} "
            f"(and so must every batch's sequence length)"
        )



def _block_plan(sp: bool, moe: bool = False) -> dict[str, object]:
    """Per-block plan: column-parallel in, row-parallel out, optional sequence-sharded norms. An MoE
    feed-forward (``moe``) stays whole on every tp rank (experts whole, not expert-tensor-parallel): without
    sequence parallelism its input is the replicated residual stream, so each tp rank routes and computes the
    same tokens; with it, each tp rank routes its own sequence shard (``LocalTokens``: no gather, the MoE's
    gradients summed over tp, its balancing statistics over the whole sequence by ``plait.parallel.expert``)."""
    seq = Shard(1) if sp else Replicate()
    colwise = ColwiseRegather if sp else ColwiseParallel  # sp: each keeps its input's shard (regather.py)
    plan: dict[str, object] = {
        "attn.q": colwise(),
        "attn.k": colwise(),
        "attn.v": colwise(),
        "attn.proj": RowwiseParallel(output_layouts=seq),
        **({} if moe else {"mlp.fc": colwise(), "mlp.proj": RowwiseParallel(output_layouts=seq)}),
    }
    # The attention input enters as one replicated DTensor (use_local_output=False) that q, k and v
    # share: backward sums their three partial input gradients as DTensors and all-reduces them once
    # at this boundary (with sp: one reduce-scatter). Left to q, k and v, each would convert the plain
    # input itself and all-reduce its own gradient: three all-reduces per block instead of one.
    # With sp it is gathered once, in the autocast dtype under autocast, and q, k and v keep only its shard for
    # backward, where it is gathered again (GatherSequence, ColwiseRegather).
    plan["attn"] = (GatherSequence if sp else PrepareGatheredInput)(input_layouts=(seq,),
                                                                    desired_input_layouts=(Replicate(),))
    if sp:
        mlp = LocalTokens() if moe else GatherSequence(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        plan.update({"ln1": SequenceParallel(), "ln2": SequenceParallel(), "mlp": mlp})
    return plan



def _shard_position_embedding(pos_emb: nn.Embedding, tp_mesh: DeviceMesh) -> None:
    """Sequence parallelism: each rank embeds its own slice of positions with a replicated table.

    Forward: positions ``(T,)`` are split locally (no communication); the table is a replicated
    DTensor. Backward: the table's partial gradients are summed over tp by DTensor (all-reduce).
    """
    pos_emb.weight = nn.Parameter(distribute_tensor(pos_emb.weight.data, tp_mesh, [Replicate()]))
    parallelize_module(pos_emb, tp_mesh, PrepareModuleInput(
        input_layouts=(Replicate(),), desired_input_layouts=(Shard(0),), use_local_output=False))
    parallelize_module(pos_emb, tp_mesh, PrepareModuleOutput(
        output_layouts=(Shard(0),), desired_output_layouts=(Shard(0),), use_local_output=True))



def apply_tensor_parallel(model: GPT, tp_mesh: DeviceMesh, *, sequence_parallel: bool,
                          loss_parallel: bool = True) -> GPT:
    """Shard ``model`` in place over the 1-D ``tp_mesh`` (Megatron layout) and return it.

    Contract: call on identical full models on every tp rank (same seed), before any optimizer is
    built. Afterwards every sharded parameter is a DTensor on ``tp_mesh``; with ``sequence_parallel``
    the norms and the position embedding are replicated DTensors too, otherwise they stay plain
    tensors (computed identically on all tp ranks). ``model(idx, targets)`` still returns the mean
    cross-entropy, as a replicated DTensor when ``loss_parallel``; run forward and backward inside
    ``loss_context(model)``. Inputs ``idx``/``targets`` are the full ``(B, T)`` batch on every tp rank.
    Raises ``TensorParallelError`` when heads, vocabulary or (with sp) the sequence do not divide.
    """
    cfg = model.cfg
    tp = tp_mesh.size()
    check_tensor_parallel(cfg.n_head, cfg.d_model, cfg.vocab_size, cfg.seq_len, tp, sequence_parallel)
    seq = Shard(1) if sequence_parallel else Replicate()
    parallelize_module(model, tp_mesh, {
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                use_local_output=not loss_parallel),
        **({"ln_f": SequenceParallel()} if sequence_parallel else {}),
    })
    model.head.weight = model.tok_emb.weight  # both Shard(0) on the vocabulary: one parameter again
    if sequence_parallel:
        _shard_position_embedding(model.pos_emb, tp_mesh)
    stream = tp_mesh.get_local_rank() + 1
    for block in model.blocks:
        plan = _block_plan(sequence_parallel, isinstance(block.mlp, MoE))
        parallelize_module(block, tp_mesh, float8_plan(block, plan))  # torchao's styles on its Float8Linears
        block.attn.n_head = cfg.n_head // tp  # local heads; the forward reshapes with -1 anyway
        block.attn.dropout_stream = stream  # this rank's heads: masks of their own
        if sequence_parallel:
            block.drop.stream = stream  # this rank's sequence slice: masks of its own
    if sequence_parallel:
        model.drop.stream = stream
    mark_loss_parallel(model, loss_parallel)
    return model



def parallelize(model: GPT, tp_mesh: DeviceMesh, p: ParallelConfig) -> GPT:
    """The spec's tensor-parallel plan: ``apply_tensor_parallel`` with the config's sp/loss options."""
    return apply_tensor_parallel(model, tp_mesh, sequence_parallel=p.sequence_parallel, loss_parallel=p.loss_parallel)

