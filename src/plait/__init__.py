"""plait: distributed training on PyTorch, one typed config for the whole layout."""

__version__ = "0.1.0"
