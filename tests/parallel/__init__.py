"""Tests of plait.parallel."""
