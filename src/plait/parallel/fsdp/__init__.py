"""ZeRO-3 and hybrid sharding on FSDP2: ``fully_shard`` per block and at the root (``shard``) and the ``Fsdp``
gradient-sync policy (``sync``)."""
