"""Data parallelism: plait's bucketed, overlapped gradient reducer and PyTorch DDP (``reducer``), and the
``DataParallel`` strategy that trains with either (``strategy``)."""
