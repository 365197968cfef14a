"""Attention masks shared by plait's models and layouts.

``document_causal_mask(doc_ids)`` is the mask of packed documents (``plait.data.packing``): causal, and
inside one document only. It takes the batch's ``doc_ids`` and nothing else, so any layer or layout that
holds a slice of them (a context-parallel rank's keys, for instance) can build its part of the mask.
"""

from __future__ import annotations

import torch


def document_causal_mask(doc_ids: torch.Tensor, key_doc_ids: torch.Tensor | None = None,
                         query_offset: int = 0) -> torch.Tensor:
    """A boolean attention mask, True where a query may attend a key: same document and not later.

    ``doc_ids``: (B, Tq) the queries' document ids; ``key_doc_ids``: (B, Tk) the keys' (default: the
    queries' own); ``query_offset``: the position of the first query among the keys (a query at position
    ``query_offset + i`` sees keys ``0..query_offset + i``). Returns (B, 1, Tq, Tk), broadcast over heads, as
    ``torch.nn.functional.scaled_dot_product_attention`` takes it.
    """
    keys = doc_ids if key_doc_ids is None else key_doc_ids
    tq, tk = doc_ids.size(1), keys.size(1)
    same = doc_ids[:, :, None] == keys[:, None, :]  # (B, Tq, Tk)
    q_pos = torch.arange(tq, device=doc_ids.device)[:, None] + query_offset
    causal = torch.arange(tk, device=doc_ids.device)[None, :] <= q_pos  # (Tq, Tk)
    return (same & causal)[:, None]
