"""Tests of plait.nn."""
