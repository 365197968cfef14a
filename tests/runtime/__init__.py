"""Tests of plait.runtime."""
