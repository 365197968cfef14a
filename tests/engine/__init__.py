"""Tests of plait.engine: the keep-your-loop API (``plait.Plait``)."""
