"""Expert parallelism for mixture-of-experts models: the composition's step and check (``apply``), experts sharded
over the ``ep`` axis and tokens dispatched to them (``dispatch``), Hugging Face MoE families (``hf``), and the expert
parameters' gradients, optimizer and checkpoint form beside the gradient-sync policy (``sync``)."""
