"""Tests of plait.plan."""
