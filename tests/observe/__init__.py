"""Tests of plait.observe."""
