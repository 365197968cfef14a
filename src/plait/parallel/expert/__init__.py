"""Expert parallelism for mixture-of-experts models: experts sharded over the ``ep`` axis and tokens dispatched
to them (``dispatch``), Hugging Face MoE families (``hf``), and the ``ExpertParallel`` wrapper strategy
(``strategy``)."""
