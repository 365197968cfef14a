"""Tests of plait.components."""
