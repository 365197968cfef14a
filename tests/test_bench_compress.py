"""bench/compress.py's bookkeeping: time to target, byte sums, ratios against DDP, and namespace teardown."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location("bench_compress", Path(__file__).resolve().parents[1] / "bench" /
                                              "compress.py")
bench = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(bench)


def _metrics(tmp_path: Path, rows: list[dict]) -> Path:
    p = tmp_path / "metrics.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return p


def test_time_to_target_sums_step_times_until_first_eval_below_target(tmp_path):
    rows = [{"step": 1, "step_s": 0.5, "comm_bytes": 100},
            {"step": 2, "step_s": 0.25, "comm_bytes": 100, "val_loss": 3.0},
            {"step": 3, "step_s": 0.5, "comm_bytes": 100, "val_loss": 2.5},
            {"step": 4, "step_s": 1.0, "comm_bytes": 100, "val_loss": 2.4},
            {"step": 4, "val_loss": 2.3}]  # the trainer's final evaluation line has no step_s
    out = bench.summarize(_metrics(tmp_path, rows), target=2.6)
    assert out["reached"] and out["step_at_target"] == 3
    assert out["time_to_target_s"] == pytest.approx(1.25)  # exact sums of binary fractions
    assert out["final_val_loss"] == 2.3 and out["steps"] == 4
    assert out["comm_bytes"] == 400 and out["train_seconds"] == pytest.approx(2.25)
    assert out["step_s_median"] == pytest.approx(0.5)


def test_not_reached_reports_final_loss(tmp_path):
    rows = [{"step": 1, "step_s": 0.5, "comm_bytes": 8, "val_loss": 3.0}, {"step": 1, "val_loss": 2.9}]
    out = bench.summarize(_metrics(tmp_path, rows), target=2.6)
    assert not out["reached"] and out["time_to_target_s"] is None and out["final_val_loss"] == 2.9


def test_annotate_ratios_and_unapplied_compression():
    base = {"reached": True, "steps": 10, "step_s_median": 1.0}
    results = [
        {**base, "method": "plait-none", "time_to_target_s": 10.0, "comm_bytes_per_step": 1000.0},
        {**base, "method": "plait-int8", "time_to_target_s": 4.0, "comm_bytes_per_step": 250.0},
        {**base, "method": "plait-topk", "time_to_target_s": 9.0, "comm_bytes_per_step": 1000.0},  # ignored
        {**base, "method": "ddp", "time_to_target_s": 9.0, "comm_bytes_per_step": 1000.0, "step_s_median": 3.0},
        {**base, "method": "ddp-powersgd", "time_to_target_s": 6.0, "comm_bytes_per_step": 100.0},
        {"method": "plait-fp16", "error": "rank 0 exited with 1"},
    ]
    verdict = bench.annotate(results)
    by = {r["method"]: r for r in results}
    assert by["plait-int8"]["compression_applied"] and not by["plait-topk"]["compression_applied"]
    assert by["plait-int8"]["speedup_vs_ddp"] == pytest.approx(2.25)
    assert by["plait-int8"]["speedup_vs_ddp-powersgd"] == pytest.approx(1.5)
    assert by["plait-int8"]["step_speedup_vs_ddp"] == pytest.approx(3.0)
    assert by["plait-int8"]["step_speedup_vs_ddp-powersgd"] == pytest.approx(1.0)
    assert verdict["compressors_applied"] == ["plait-int8"] and verdict["target_2x_vs_ddp_met"]
    results[1]["time_to_target_s"] = 5.0  # 1.8x: not met
    assert not bench.annotate(results)["target_2x_vs_ddp_met"]


def test_unknown_network_is_a_clear_error():
    if os.geteuid() != 0:
        with pytest.raises(bench.BenchError, match="must run as root"):
            bench.check_environment(["netns"])
    else:
        with pytest.raises(bench.BenchError, match="unknown network"):
            bench.check_environment(["wifi"])


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
                    reason="needs root and iproute2 to create network namespaces")
def test_netns_link_is_shaped_and_removed():
    net = bench.Network("netns", f"t{os.getpid()}")
    try:
        net.setup()
        assert [h[2] for h in net.hosts] == list(bench.ADDRS)
        qdisc = bench.sh("tc", "-n", net.hosts[0][0], "qdisc", "show", "dev", net.hosts[0][1])
        assert "tbf" in qdisc and "1Gbit" in qdisc
        assert net.tx_bytes() >= 0
    finally:
        names = list(net.namespaces)
        net.close()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert names and not any(n in listed for n in names)
