"""Checkpoints and weight I/O in one package.

- ``dcp``: the resharding checkpoint format (torch.distributed.checkpoint), its atomic directories and retention;
- ``pieces``: reading and writing a checkpoint's pieces with no pickle code execution;
- ``integrity``: checksums and the newest good checkpoint;
- ``memory``: the in-memory copy of a rank's share (``fault.memory_checkpoint``);
- ``single_file``: a single-file export of a whole model;
- ``hf`` and ``hf_convert``: Hugging Face checkpoints, read and written shard by shard;
- ``weights``: loading weights into a model built on the meta device, under any layout;
- ``layout_state``: a layout's state for all of these (``Layout.state``: its state dicts, entries, full state);
- ``checkpointer`` and ``export``: the engine's save, load and export, which the layouts answer to.
"""
