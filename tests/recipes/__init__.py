"""Tests of plait.recipes."""
