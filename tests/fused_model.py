"""A small decoder shaped like torchtitan's Llama for the tests of meta initialisation, state-dict hooks and
blocks kept in a ``ModuleDict``: its attention's q, k and v are one fused ``wqkv`` Linear (heads interleaved,
so a column split keeps whole heads) that its state-dict hooks save as ``wq``/``wk``/``wv`` and merge back on
load; its rotary cache is a non-persistent buffer computed in ``__init__`` (no ``reset_parameters``); its blocks
live in a ``ModuleDict``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

DIM, HEADS, LAYERS, VOCAB, MAX_SEQ = 32, 4, 2, 64, 32
HEAD_DIM = DIM // HEADS
# the tests' training: 8 sequences of 16 tokens per step, AdamW at lr 1e-3 clipped at 1.0. Against one process the
# losses agree within LOSS_RTOL and the parameters after 2 steps within ATOL = lr / 10: sums in another order over
# ranks, heads, sequence shards and micro-batches differ by rounding, and AdamW's first steps move a weight by about
# lr whatever the size of its gradient (m / sqrt(v) is the gradient's sign at step 1), so a weight whose gradient is
# near zero moves by a fraction of lr differently. Measured: at most 3.8e-5 (one element of 1024 at tp=2 with
# sequence parallelism), every other weight within 3e-6
ATOL, LOSS_RTOL = 1e-4, 1e-5
GLOBAL, SEQ, STEPS, LR, SEED = 8, 16, 2, 1e-3, 5


class Rotary(nn.Module):
    """cos and sin of the rotary angles for ``max_seq`` positions, computed at construction."""

    def __init__(self, head_dim: int, max_seq: int) -> None:
        super().__init__()
        self.head_dim, self.max_seq = head_dim, max_seq
        inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        angles = torch.outer(torch.arange(max_seq).float(), inv)  # (max_seq, head_dim / 2)
        self.register_buffer("cache", torch.cat([angles.cos(), angles.sin()], dim=-1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, H, D)
        cos, sin = self.cache[: x.size(1)].chunk(2, dim=-1)
        cos, sin = cos[None, :, None], sin[None, :, None]
        a, b = x.chunk(2, dim=-1)
        return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.redistribute(t.device_mesh, [Replicate()] * t.device_mesh.ndim) if isinstance(t, DTensor) else t


class FusedQKV(nn.Module):
    """One Linear for q, k and v, rows laid out (head, q/k/v, head_dim); saved as ``wq``, ``wk``, ``wv``."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.register_state_dict_post_hook(self._split)
        self.register_load_state_dict_pre_hook(self._merge)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t, _ = x.shape
        qkv = self.wqkv(x).view(b, t, -1, 3, HEAD_DIM)  # (B, T, H / tp, 3, D)
        return qkv.unbind(dim=3)

    @staticmethod
    def _split(module: FusedQKV, state: dict, prefix: str, local_metadata: dict) -> None:
        w = _whole(state.pop(f"{prefix}wqkv.weight")).reshape(module.heads, 3, HEAD_DIM, -1)
        for i, name in enumerate("qkv"):
            state[f"{prefix}w{name}.weight"] = w[:, i].reshape(module.heads * HEAD_DIM, -1).contiguous()

    @staticmethod
    def _merge(module: FusedQKV, state: dict, prefix: str, *args: object) -> None:
        keys = [f"{prefix}w{name}.weight" for name in "qkv"]
        if all(k in state for k in keys):
            parts = [_whole(state.pop(k)).reshape(module.heads, 1, HEAD_DIM, -1) for k in keys]
            state[f"{prefix}wqkv.weight"] = torch.cat(parts, dim=1).reshape(3 * module.heads * HEAD_DIM, -1)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = FusedQKV(DIM, HEADS)
        self.rope = Rotary(HEAD_DIM, MAX_SEQ)
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x)
        q, k = self.rope(q), self.rope(k)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).flatten(2))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm, self.attention = nn.RMSNorm(DIM), Attention()
        self.ffn_norm = nn.RMSNorm(DIM)
        self.feed_forward = nn.Sequential()
        self.feed_forward.add_module("w1", nn.Linear(DIM, 4 * DIM, bias=False))
        self.feed_forward.add_module("act", nn.GELU())
        self.feed_forward.add_module("w2", nn.Linear(4 * DIM, DIM, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class FusedDecoder(nn.Module):
    """Embedding, ``LAYERS`` blocks in a ``ModuleDict``, norm, head: logits ``(B, T, VOCAB)``."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(LAYERS)})
        self.norm, self.output = nn.RMSNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))


def dataset() -> torch.utils.data.TensorDataset:
    """(tokens, next tokens) pairs for STEPS + 1 global batches."""
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (GLOBAL * (STEPS + 1), SEQ + 1), generator=g)
    return torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])


def user_loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    """The user's own loss: next-token cross-entropy of the logits."""
    x, y = batch
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


# tensor parallelism: whole heads per rank (wqkv's rows are grouped by head), the embedding left whole
TP_PLAN = {"layers.*.attention.qkv.wqkv": "colwise", "layers.*.attention.wo": "rowwise",
           "layers.*.feed_forward.w1": "colwise", "layers.*.feed_forward.w2": "rowwise"}


def sp_plan() -> dict:
    """``TP_PLAN`` with sequence parallelism, written out as a user of another model writes it: the first block
    takes its slice of the embedding's whole output, the norms run on sequence shards, attention's and the MLP's
    inputs are gathered, their row-parallel outputs reduce-scattered onto the shards, the head gathers the final
    norm's shards."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

    def gather() -> PrepareModuleInput:
        return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                  use_local_output=True)

    return {"layers.0": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                           use_local_output=True),
            "layers.*.attention_norm": "sequence_parallel", "layers.*.ffn_norm": "sequence_parallel",
            "layers.*.attention": gather(), "layers.*.feed_forward": gather(),
            "layers.*.attention.qkv.wqkv": "colwise", "layers.*.feed_forward.w1": "colwise",
            "layers.*.attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "norm": "sequence_parallel", "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}
