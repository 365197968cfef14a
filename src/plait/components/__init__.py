"""Pieces several layers use: the optimizer factory, mixed precision, losses, the checkpoint format and export."""
