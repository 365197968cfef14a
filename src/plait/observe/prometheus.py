"""A Prometheus endpoint per rank (``observe.prometheus_port``): the health of a distributed run as gauges and
counters that Prometheus scrapes, Grafana plots and alerting rules watch (docs/monitoring/).

Rank r serves ``http://<observe.prometheus_host>:<port + local rank>/metrics`` with prometheus_client's own
HTTP server, from a registry of its own (never the process-wide default, so nothing else in the process leaks
into it). Every series carries the labels ``job`` (the run directory's name), ``rank`` (global rank) and
``host``. Values arrive as arguments from the layers that measure them (the engine's step, the trainer's data
wait and throughput, the recovery policy's straggler score and checkpoint interval); the checkpoint age and
the hang watchdog's state are read when Prometheus scrapes, so they keep moving while a rank is stuck.

The names, their units and meaning are listed in ``METRICS`` (and in docs/monitoring/README.md).
"""

from __future__ import annotations

import importlib.util
import os
import resource
import socket
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from plait.config import ConfigError

LABELS = ("job", "rank", "host")
WATCHDOG_STATES = ("off", "running", "busy", "waiting")

# name -> (kind, help); gauges set from the values of each step unless noted.
METRICS: dict[str, tuple[str, str]] = {
    "plait_step": ("gauge", "Last optimizer step this rank completed."),
    "plait_steps_total": ("counter", "Optimizer steps this process completed."),
    "plait_skipped_steps_total": ("counter", "Optimizer steps this process skipped for non-finite gradients."),
    "plait_loss": ("gauge", "This rank's training loss at its last step (mean over its micro-batches)."),
    "plait_grad_norm": ("gauge", "Global gradient norm before clipping at the last step."),
    "plait_tokens_per_second": ("gauge", "Tokens per second of the whole job at the last step (same on every rank)."),
    "plait_step_seconds": ("gauge", "Wall time of the last optimizer step."),
    "plait_compute_seconds": ("gauge", "Forward and backward time of the last step."),
    "plait_comm_exposed_seconds": ("gauge", "Gradient communication the last step waited for after backward."),
    "plait_data_wait_seconds": ("gauge", "Time the last step waited for its batches."),
    "plait_optimizer_seconds": ("gauge", "Clip, optimizer and scheduler time of the last step."),
    "plait_last_step_timestamp_seconds": ("gauge", "Unix time at which this rank last completed a step."),
    "plait_memory_bytes": ("gauge", "Memory of this rank by kind: allocated, reserved, peak (GPU) or rss (CPU)."),
    "plait_straggler_score": ("gauge", "This rank's smoothed work time over the median rank's (1: typical)."),
    "plait_straggler_factor": ("gauge", "Score above which plait names a rank a straggler (fault.straggler_factor)."),
    "plait_restarts": ("gauge", "Restarts of the job before this attempt (0 on the first attempt)."),
    "plait_last_checkpoint_timestamp_seconds": ("gauge", "Unix time at which this process last completed or "
                                                         "loaded a checkpoint (its start before any)."),
    "plait_checkpoint_age_seconds": ("gauge", "Seconds since this process last completed or loaded a checkpoint "
                                              "(its start before any; read at scrape): training a failure would lose."),
    "plait_checkpoint_interval_steps": ("gauge", "Steps between checkpoints (0: only at the end)."),
    "plait_watchdog_state": ("gauge", "Hang watchdog's view of the main thread, 1 for the current state: off, "
                                      "running, busy (computing) or waiting (in communication) (read at scrape)."),
    "plait_watchdog_wait_seconds": ("gauge", "Seconds the main thread has waited in the same collective (read at "
                                             "scrape)."),
    "plait_watchdog_timeout_seconds": ("gauge", "Wait after which the watchdog ends the job (comm.timeout_s)."),
}
# step record key -> gauge
_FROM_RECORD = {"step": "plait_step", "loss": "plait_loss", "grad_norm": "plait_grad_norm",
                "tokens_per_s": "plait_tokens_per_second", "step_s": "plait_step_seconds",
                "comm_exposed_s": "plait_comm_exposed_seconds", "data_s": "plait_data_wait_seconds",
                "optimizer_s": "plait_optimizer_seconds", "straggler_factor": "plait_straggler_factor",
                "checkpoint_interval_steps": "plait_checkpoint_interval_steps",
                "watchdog_timeout_s": "plait_watchdog_timeout_seconds", "restarts": "plait_restarts"}


def local_rank(rank: int) -> int:
    """``LOCAL_RANK`` from the launcher (torchrun, plait, SLURM), else the global rank (one host)."""
    return int(os.environ.get("LOCAL_RANK", rank))


def restarts() -> int:
    """Restarts before this attempt: plait's launcher counts them in PLAIT_ATTEMPT, torchrun in
    TORCHELASTIC_RESTART_COUNT."""
    return int(os.environ.get("PLAIT_ATTEMPT") or os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)


def memory_bytes(device: Any) -> dict[str, float]:
    """This process's memory: the CUDA caching allocator's figures on a GPU, else the resident set size."""
    import torch

    if getattr(device, "type", "cpu") == "cuda":
        return {"allocated": float(torch.cuda.memory_allocated(device)),
                "reserved": float(torch.cuda.memory_reserved(device)),
                "peak": float(torch.cuda.max_memory_allocated(device))}
    try:
        with open("/proc/self/statm") as f:
            return {"rss": float(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))}
    except OSError:  # not Linux: the peak is what the platform reports (kilobytes on Linux, bytes on macOS)
        scale = 1 if os.uname().sysname == "Darwin" else 1024
        return {"rss": float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale)}


class _ReadAtScrape:
    """The values computed when Prometheus scrapes: checkpoint age and the watchdog's state."""

    def __init__(self, exporter: PrometheusExporter) -> None:
        self.e = exporter

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        e = self.e
        age = GaugeMetricFamily("plait_checkpoint_age_seconds", METRICS["plait_checkpoint_age_seconds"][1],
                                labels=LABELS)
        age.add_metric(e.labels, max(0.0, time.time() - e.checkpoint_at))
        yield age
        state, waited = e.status() if e.status is not None else ("off", 0.0)
        states = GaugeMetricFamily("plait_watchdog_state", METRICS["plait_watchdog_state"][1],
                                   labels=(*LABELS, "state"))
        for s in WATCHDOG_STATES:
            states.add_metric([*e.labels, s], 1.0 if s == state else 0.0)
        yield states
        wait = GaugeMetricFamily("plait_watchdog_wait_seconds", METRICS["plait_watchdog_wait_seconds"][1],
                                 labels=LABELS)
        wait.add_metric(e.labels, waited)
        yield wait


class PrometheusExporter:
    """One rank's endpoint (see the module docstring). ``status``: returns the watchdog's ``(state, seconds
    waiting)``; ``device``: where memory is measured. ``close`` stops the server and frees the port."""

    def __init__(self, host: str, port: int, *, job: str, rank: int, device: Any = None,
                 status: Callable[[], tuple[str, float]] | None = None) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

        self.rank, self.labels = rank, [job, str(rank), socket.gethostname()]
        self.registry = CollectorRegistry(auto_describe=True)
        self.device, self.status = device, status
        self.checkpoint_at = time.time()
        self._gauges: dict[str, Any] = {}
        self._counters: dict[str, Any] = {}
        for name, (kind, doc) in METRICS.items():
            if name in ("plait_checkpoint_age_seconds", "plait_watchdog_state", "plait_watchdog_wait_seconds"):
                continue
            if kind == "counter":
                self._counters[name] = Counter(name, doc, LABELS, registry=self.registry).labels(*self.labels)
            elif name == "plait_memory_bytes":
                self._memory = Gauge(name, doc, (*LABELS, "kind"), registry=self.registry)
            else:  # the series appears with its first value: no loss of 0 before the first step
                self._gauges[name] = Gauge(name, doc, LABELS, registry=self.registry)
        self.registry.register(_ReadAtScrape(self))
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            raise ConfigError(f"observe.prometheus_port: rank {rank} cannot serve metrics on {host}:{port} "
                              f"({e.strerror or e}); choose another observe.prometheus_port (rank r listens on it "
                              "+ its local rank) or observe.prometheus_host") from None
        self.set_values({"restarts": restarts(), "checkpoint_interval_steps": 0})
        self._gauges["plait_last_checkpoint_timestamp_seconds"].labels(*self.labels).set(self.checkpoint_at)

    def _set(self, name: str, value: float) -> None:
        self._gauges[name].labels(*self.labels).set(value)

    def set_values(self, values: Mapping[str, Any]) -> None:
        """Gauges from a record's keys (``step``, ``loss``, ``grad_norm``, ``tokens_per_s``, ``step_s``,
        ``forward_s`` + ``backward_s``, ``comm_exposed_s``, ``data_s``, ``optimizer_s``, ``straggler_factor``,
        ``checkpoint_interval_steps``, ``watchdog_timeout_s``, ``restarts``; ``straggler_score``: every rank's
        list, of which this rank's entry); None values and keys it does not know are ignored."""
        for key, name in _FROM_RECORD.items():
            if values.get(key) is not None:
                self._set(name, float(values[key]))
        if "forward_s" in values and "backward_s" in values:
            self._set("plait_compute_seconds", float(values["forward_s"]) + float(values["backward_s"]))
        scores = values.get("straggler_score")
        if scores:
            self._set("plait_straggler_score", float(scores[self.rank]))

    def step_done(self, values: Mapping[str, Any]) -> None:
        """One optimizer step completed on this rank (``values``: its record, as ``set_values`` reads it; the
        device's values, loss and norm, and ``skipped``, the skipped steps since the last log step, only at log
        steps: the engine reads nothing for the exporter on other steps)."""
        self.set_values(values)
        self._set("plait_last_step_timestamp_seconds", time.time())
        self._counters["plait_steps_total"].inc()
        if values.get("skipped"):
            self._counters["plait_skipped_steps_total"].inc(int(values["skipped"]))
        for kind, value in memory_bytes(self.device).items():
            self._memory.labels(*self.labels, kind).set(value)

    def checkpoint_done(self) -> None:
        """A checkpoint completed (or was loaded) now."""
        self.checkpoint_at = time.time()
        self._set("plait_last_checkpoint_timestamp_seconds", self.checkpoint_at)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def check_prometheus(port: int) -> None:
    """Raise a ``ConfigError`` naming the extra when the endpoint is asked for and prometheus_client is missing."""
    if port and importlib.util.find_spec("prometheus_client") is None:
        raise ConfigError("observe.prometheus_port is set, but the prometheus-client package is not installed: "
                          "pip install 'plait[prometheus]' (or set observe.prometheus_port = 0)")


def serve_metrics(port: int, host: str, *, job: str, rank: int, device: Any = None,
                  status: Callable[[], tuple[str, float]] | None = None,
                  timeout_s: float | None = None) -> PrometheusExporter | None:
    """This rank's exporter on ``port`` + its local rank, or None when ``port`` is 0 (off); ``timeout_s``: the
    watchdog's limit (``comm.timeout_s``)."""
    if not port:
        return None
    check_prometheus(port)
    exporter = PrometheusExporter(host, port + local_rank(rank), job=job, rank=rank, device=device, status=status)
    exporter.set_values({"watchdog_timeout_s": timeout_s})
    return exporter
