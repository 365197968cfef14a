"""plait's GPT and everything plait knows about it, in one folder.

``model``: the model (pre-LayerNorm decoder, tied embeddings), which knows nothing of parallelism; ``shape``: its
shape for the planner and its FLOPs per token for MFU; ``parallelize``: its tensor-parallel plan; ``pipeline``: how
it is cut into pipeline stages; ``context``: its attention routed through the context-parallel attention; ``spec``:
the one ``plait.parallel.train_spec.TrainSpec`` holding them, registered for the class once (``plait.parallel``
imports it). This package exports the model only, so importing it pulls in no parallel code.
"""

from plait.models.gpt.model import GPT, MLP, Block, CausalSelfAttention, Dropout, dropout_stream

__all__ = ["GPT", "MLP", "Block", "CausalSelfAttention", "Dropout", "dropout_stream"]
