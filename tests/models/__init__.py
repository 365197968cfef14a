"""Tests of plait.models."""
