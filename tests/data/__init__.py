"""Tests of plait.data."""
