"""Data parallelism: plait's bucketed, overlapped gradient reducer and PyTorch DDP (``reducer``) as gradient-sync
policies (``sync``), and DiLoCo's outer loop around any layout (``diloco``, a driver)."""
