"""Tensor and sequence parallelism on DTensor: plans and their checks (``plan``), plait's GPT plan (``gpt``),
Hugging Face plans as transformers means them (``hf``), checkpoint entries of strided shards (``strided``), and
the ``Tensor`` / ``TensorFsdp`` strategies with what every model-parallel strategy shares (``strategy``)."""
