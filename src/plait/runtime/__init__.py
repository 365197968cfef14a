"""The lowest layer: config, topology, joining the process group, spawning ranks, timing."""
