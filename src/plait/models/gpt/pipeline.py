"""plait's GPT cut into pipeline stages: the adapter its spec (``plait.models.gpt.spec``) registers for the class. The
blocks are the split units; the embeddings go with the first stage, the final norm and the head with the last
(either may be alone on its stage: ``parallel.pp_split_embedding``, ``pp_split_head``).
A tied head gets its own copy on the last stage from the pipeline's split (``plait.parallel.pipeline.split``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from plait.models.gpt.model import GPT


class GPTStage(nn.Module):
    """The part of a GPT one pipeline stage owns, under the full model's attribute names (FQNs)."""

    def __init__(self, model: GPT, layers: list[int], *, is_first: bool, is_last: bool) -> None:
        super().__init__()
        self.is_first, self.is_last, self.seq_len = is_first, is_last, model.cfg.seq_len
        # context parallelism (plait.models.gpt.context): the global positions of the tokens this rank holds, (S,);
        # None: positions 0..T-1
        self.positions: Callable[[], torch.Tensor | None] | None = None
        if is_first:
            self.tok_emb, self.pos_emb, self.drop = model.tok_emb, model.pos_emb, model.drop
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in layers})
        if is_last:
            self.ln_f, self.head = model.ln_f, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:  # x: token ids (B, T)
            T = x.size(1)
            if T > self.seq_len:
                raise ValueError(f"sequence of {T} tokens exceeds model.seq_len={self.seq_len}")
            pos = self.positions() if self.positions is not None else None
            pos = torch.arange(T, device=x.device) if pos is None else pos
            x = self.drop(self.tok_emb(x) + self.pos_emb(pos))  # (B, T, C)
        for block in self.blocks.values():
            x = block(x)  # (B, T, C)
        if self.is_last:
            x = self.head(self.ln_f(x))  # (B, T, V)
        return x



class GPTPipeline:
    """Pipeline adapter for plait's GPT: the blocks are the split units; the embedding goes with the
    first stage, the final norm and head with the last."""

    def layer_names(self, model: GPT) -> list[str]:
        return [f"blocks.{i}" for i in range(len(model.blocks))]

    def head_name(self, model: GPT) -> str:
        """The split point that starts a stage holding only the final norm and the head (``parallel.pp_split``)."""
        return "ln_f"

    def build_stage(self, model: GPT, layers: list[str], *, is_first: bool, is_last: bool) -> nn.Module:
        return GPTStage(model, [int(n.rsplit(".", 1)[1]) for n in layers], is_first=is_first, is_last=is_last)

