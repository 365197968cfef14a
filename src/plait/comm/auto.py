"""``comm.compress=auto``: measure the first steps, then turn compression on only if it can pay.

Compression costs compute (encoding, decoding, PowerSGD's matrix products and QR) and some accuracy;
it only pays when the step waits for communication that computation did not hide. So the first
steps run uncompressed while this records, per step, the exposed communication (the trainer's
``comm_exposed_s``: waiting for gradients after backward finished), the step time, the bytes put on
the wire and the time spent waiting for them. After the window the measurements are summed over
the data-parallel group (one all-reduce), so every rank computes the same decision from the same
numbers, and compression turns on when the exposed fraction exceeds ``threshold``.

The compressor chosen is PowerSGD (``AUTO_COMPRESSOR``): it removes the most bytes (two all-reduces
of ``~8 r / sqrt(N)`` of the fp32 bucket, e.g. ~1% for a 1M-element bucket at rank 4), its payload
is all-reduced so its cost does not grow with the number of ranks (unlike the all-gathered int8/int4
and top-k payloads), and with error feedback it trains to the uncompressed loss. Step 1 is left out
of the window: it carries one-off costs (allocator warm-up, first-touch of buffers).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from plait.comm.collectives import AUTO_COMPRESSOR, Comm


class AutoCompress:
    """Measures steps ``first..last`` (1-based, inclusive) and decides once, at step ``last``."""

    def __init__(self, first: int = 2, last: int = 6, threshold: float = 0.10,
                 compressor: str = AUTO_COMPRESSOR) -> None:
        if not 1 <= first <= last:
            raise ValueError(f"auto-compression window must satisfy 1 <= first <= last; got {first}..{last}")
        self.first, self.last, self.threshold, self.compressor = first, last, threshold, compressor
        # (exposed seconds, step seconds, bytes on the wire, seconds waiting), summed over the window
        self.sums = [0.0, 0.0, 0.0, 0.0]
        self.decision: dict[str, Any] | None = None

    def observe(self, step: int, exposed_s: float, step_s: float, nbytes: int, wait_s: float) -> bool:
        """Record step ``step``'s measurements; True when the decision is due now (call ``decide``)."""
        if self.decision is not None or not self.first <= step <= self.last:
            return False
        for i, v in enumerate((exposed_s, step_s, float(nbytes), wait_s)):
            self.sums[i] += v
        return step == self.last

    def decide(self, comm: Comm, group: dist.ProcessGroup | None) -> dict[str, Any]:
        """Collective over ``group``: agree on the measurements, set ``comm.compress_active`` and
        return the decision record (for the run log and ``summary.json``). Communication: one
        all-reduce of 4 float64; no backward."""
        totals = torch.tensor(self.sums, dtype=torch.float64)
        ranks = 1
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            comm.all_reduce_sum(totals, group, name="auto-compression measurements")
            ranks = dist.get_world_size(group)
        exposed, step, nbytes, wait = totals.tolist()
        fraction = exposed / step if step > 0 else 0.0
        bandwidth = nbytes / wait if wait > 0 else float("inf")
        on = fraction > self.threshold
        if on:
            reason = (f"communication is exposed: {fraction:.1%} of step time waits for gradients after "
                      f"backward (threshold {self.threshold:.0%}), so {self.compressor} compression is on")
        else:
            reason = (f"communication is hidden: only {fraction:.1%} of step time waits for gradients after "
                      f"backward (threshold {self.threshold:.0%}); compression would add compute and "
                      "error without saving time, so it stays off")
        comm.compress_active = on
        self.decision = {
            "decision": "on" if on else "off", "compressor": self.compressor if on else "none",
            "reason": reason, "steps": [self.first, self.last], "exposed_fraction": fraction,
            "bandwidth_bytes_per_s": bandwidth if bandwidth != float("inf") else None,
            "bytes_per_rank_per_step": nbytes / ranks / (self.last - self.first + 1),
            "threshold": self.threshold,
        }
        return self.decision

    def state_dict(self) -> dict[str, Any]:
        return {"sums": list(self.sums), "decision": self.decision}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.sums = [float(x) for x in sd["sums"]]
        self.decision = sd["decision"]
