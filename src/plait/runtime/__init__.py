"""The lowest layer: config, topology, joining the process group, spawning ranks on one machine, timing."""
