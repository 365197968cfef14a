"""Tests of plait.train."""
