"""ZeRO stages 1-2: plait's sharded optimizer (``optimizer``), its canonical checkpoint form (``state``) and the
``Zero`` gradient-sync policy (``sync``)."""
