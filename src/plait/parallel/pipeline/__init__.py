"""Pipeline parallelism on ``torch.distributed.pipelining``: where a model is cut and tied weights across stages
(``split``), the adapters for plait's GPT (``gpt``) and Hugging Face decoders (``hf``), the stages and schedule of one
rank (``runner``), its timeline and bubble (``trace``), and the composition's pipeline stages with the gradient-sync
policy applied per stage (``stages``)."""
