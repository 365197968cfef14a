"""Parallel layouts behind one contract (``strategy``) and their registry (``registry``), one package per dimension:
``data``, ``zero``, ``fsdp``, ``tensor``, ``pipeline``, ``expert``. Beside them, what every layout uses: the
composition order (``apply``), preparing a user's model (``prepare``), per-class plans (``plans``), repeated units
(``units``), activation checkpointing (``checkpointing``), compilation (``compile``), activation memory
(``memory``), meta-device models (``meta_init``) and checkpoint weights (``weights``), and the wrapper base
(``wrapper``)."""
