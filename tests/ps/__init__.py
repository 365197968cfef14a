"""Tests of plait.ps."""
