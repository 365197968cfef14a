"""Surviving failures: restarts, preemption, checkpoint integrity, loss spikes, stragglers, goodput."""
