"""Tests of plait.fault."""
