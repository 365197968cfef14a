"""Export the full weights as safetensors, under the single-process model's ``state_dict()`` names."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn


def export_safetensors(state: dict[str, torch.Tensor], path: Path) -> None:
    """Write every entry of a full model state dict; tied tensors are stored under each of their names
    (safetensors refuses shared storage, so each is written as its own copy)."""
    tensors = {k: v.detach().to("cpu").clone().contiguous() for k, v in state.items()}
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt", "producer": "plait"})
    tmp.replace(path)


def load_safetensors(model: nn.Module, path: Path) -> None:
    """Load exported weights into ``model`` (strict: every name must match): a ``.safetensors`` file, a Hugging
    Face directory, or a plait run directory (``plait.checkpoint.hf.read_weights``)."""
    from plait.checkpoint.hf import read_weights

    state = read_weights(path)
    model.load_state_dict({k: v.to(torch.get_default_dtype()) if v.is_floating_point() else v
                           for k, v in state.items()})
