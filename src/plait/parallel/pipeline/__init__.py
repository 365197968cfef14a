"""Pipeline parallelism on ``torch.distributed.pipelining``: where a model is cut and tied weights across stages
(``split``), the adapter for Hugging Face decoders (``hf``; plait's GPT brings its own, ``plait.models.gpt``), the
stages and schedule of one rank (``runner``), its timeline and bubble (``trace``), and the composition's pipeline
stages with the gradient-sync policy applied per stage (``stages``)."""
