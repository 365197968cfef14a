"""Tests of plait.comm."""
