"""Tensor and sequence parallelism on DTensor: the composition's step and check (``apply``), plans and their checks
(``plan``; plait's GPT plan is in its folder, ``plait.models.gpt.parallelize``), Hugging Face plans as transformers
means them (``hf``, ``hf_sequence``), and checkpoint entries of strided shards (``strided``)."""
