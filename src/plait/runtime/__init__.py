"""The lowest layer: spawning ranks on one machine, and what every other layer may build on."""
