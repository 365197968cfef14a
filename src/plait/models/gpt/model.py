"""A GPT: pre-LayerNorm decoder, causal attention through scaled_dot_product_attention, tied embeddings.

The model knows nothing of parallelism. Its structure is what the parallel modules need to act on it
from outside: blocks in a ModuleList (pipeline split, per-block wrapping, checkpointing), attention
projections as separate ``q``, ``k``, ``v`` and ``proj`` Linears and the MLP as ``fc`` then ``proj``
(column/row tensor-parallel pairs), and no global state. The head count lives on each attention
module so a tensor-parallel plan can shard heads and update it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plait.config import ModelConfig, MoeConfig


@contextlib.contextmanager
def dropout_stream(stream: int, device: torch.device) -> Iterator[None]:
    """Draw the dropout masks inside from stream ``stream`` (0: the shared generator itself).

    For ``stream > 0`` one seed is drawn from the shared generator and the masks come from a generator
    forked from it with ``seed + stream``; the shared one is left just one draw further. Ranks that
    share the generator but not the stream (tensor-parallel ranks holding different heads or sequence
    slices) get independent masks and stay in step for the dropouts they must share, and activation
    checkpointing, which restores the shared generator before recomputing, replays the same masks.
    """
    if not stream:
        yield
        return
    seed = int(torch.randint(0, 2**62, (1,)))
    devices = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed + stream)
        yield


class Dropout(nn.Dropout):
    """``nn.Dropout`` with a ``stream`` (see ``dropout_stream``); 0 by default, like ``nn.Dropout``."""

    stream: int = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with dropout_stream(self.stream if self.training and self.p > 0 else 0, x.device):
            return super().forward(x)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.head_dim = cfg.d_model // cfg.n_head
        self.q = nn.Linear(cfg.d_model, cfg.d_model)
        self.k = nn.Linear(cfg.d_model, cfg.d_model)
        self.v = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.dropout = cfg.dropout
        self.dropout_stream = 0  # attention-dropout stream (``dropout_stream``); tensor parallel sets it

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        B, T, _ = x.shape  # (B, T, C)
        # -1 rather than n_head: under tensor parallelism the local projection holds fewer heads.
        q = self.q(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = self.k(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.v(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        p = self.dropout if self.training else 0.0
        with dropout_stream(self.dropout_stream if p > 0 else 0, x.device):
            if attn_mask is None:
                y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)  # (B, H, T, D)
            else:  # (B, 1, T, T): causal inside each packed document
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=p)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, C_local)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, moe: MoeConfig | None = None) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp: nn.Module = MLP(cfg) if moe is None else _moe_layer(cfg, moe)
        self.drop = Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        attn = self.attn(self.ln1(x)) if attn_mask is None else self.attn(self.ln1(x), attn_mask=attn_mask)
        x = x + self.drop(attn)
        return x + self.drop(self.mlp(self.ln2(x)))


def _moe_layer(cfg: ModelConfig, m: MoeConfig) -> nn.Module:
    from plait.nn.moe import MoE

    hidden = m.d_hidden or max(1, 4 * cfg.d_model // m.top_k)  # top_k experts: a dense 4x MLP's active FLOPs
    return MoE(cfg.d_model, hidden, m.num_experts, top_k=m.top_k, capacity_factor=m.capacity_factor,
               drop_policy=m.drop_policy, aux_loss_coef=m.aux_loss_coef, z_loss_coef=m.z_loss_coef,
               balance=m.balance, shared_experts=m.shared_experts, bias_update_rate=m.bias_update_rate,
               score=m.score, num_groups=m.num_groups, topk_groups=m.topk_groups, route_scale=m.route_scale,
               seq_aux_loss_coef=m.seq_aux_loss_coef, experts=m.experts)


class GPT(nn.Module):
    """Token ids (B, T) -> logits (B, T, V), or the mean cross-entropy when targets are given.

    With ``moe`` (a ``[moe]`` section with ``num_experts`` > 0) every ``moe.every``-th block (blocks
    ``every-1, 2 every-1, ...``) has a ``plait.nn.MoE`` feed-forward instead of the dense MLP. Packed
    documents (``plait.data.packing``) pass ``position_ids`` (B, T) and ``doc_ids`` (B, T); with
    ``document_mask`` attention stays inside each document. ``cfg.vocab_size = 0`` means 256 (bytes)."""

    def __init__(self, cfg: ModelConfig, moe: MoeConfig | None = None, *, document_mask: bool = False) -> None:
        super().__init__()
        if cfg.vocab_size == 0:  # "the tokenizer's", unresolved here: the byte vocabulary
            import dataclasses

            cfg = dataclasses.replace(cfg, vocab_size=256)
        self.cfg = cfg
        self.document_mask = document_mask
        # What builds the document mask from ``doc_ids`` (None: ``document_causal_mask``, (B, 1, T, T)); context
        # parallelism sets its own, which marks the layers' attention as document-masked without building it.
        self.document_mask_fn: Any = None
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = Dropout(cfg.dropout)
        use_moe = moe is not None and moe.num_experts > 0
        self.blocks = nn.ModuleList(Block(cfg, moe if use_moe and (i + 1) % moe.every == 0 else None)
                                    for i in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # tied embeddings
        self.apply(self._init_weights)
        # GPT-2 scaling: residual projections shrink with depth so the stream's variance stays bounded.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, *,
                position_ids: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        B, T = idx.shape  # (B, T)
        if T > self.cfg.seq_len:
            raise ValueError(f"sequence of {T} tokens exceeds model.seq_len={self.cfg.seq_len}")
        pos = torch.arange(T, device=idx.device) if position_ids is None else position_ids  # (T,) or (B, T)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))  # (B, T, C)
        if doc_ids is not None and self.document_mask:
            from plait.nn.attention import document_causal_mask

            mask = (self.document_mask_fn or document_causal_mask)(doc_ids)  # (B, 1, T, T)
            for block in self.blocks:
                x = block(x, attn_mask=mask)
        else:
            for block in self.blocks:
                x = block(x)
        logits = self.head(self.ln_f(x))  # (B, T, V)
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))

    def num_params(self) -> int:
        """Parameters counted once (the tied head shares the embedding)."""
        return sum(p.numel() for p in self.parameters())

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 0.8,
                 top_k: int | None = 40, generator: torch.Generator | None = None) -> torch.Tensor:
        """Extend (B, T) token ids by ``max_new_tokens`` sampled tokens."""
        for _ in range(max_new_tokens):
            ctx = idx[:, -self.cfg.seq_len:]
            logits = self(ctx)[:, -1, :].float() / max(temperature, 1e-5)  # (B, V)
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
        return idx
