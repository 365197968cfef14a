"""MFU: the GPT's FLOP formula against FlopCounterMode, counts for other models, device peaks (datasheet
tables, the measured and cached CPU peak), and MFU in metrics.jsonl, summary.json and the progress bar."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from plait.components.losses import resolve_loss
from plait.config import load_config
from plait.models.gpt import GPT
from plait.train import mfu as M


@pytest.mark.parametrize("shape", [(2, 64, 4, 32), (3, 96, 6, 64)])
def test_gpt_formula_matches_flop_counter_within_2_percent(shape) -> None:
    """``6 N_mm + 12 L d T`` per token against FlopCounterMode's count of one forward + backward (meta copy)."""
    n_layer, d, heads, seq = shape
    cfg = load_config(overrides=[f"--model.n_layer={n_layer}", f"--model.d_model={d}", f"--model.n_head={heads}",
                                 f"--model.seq_len={seq}"])
    torch.manual_seed(0)
    model = GPT(cfg.model)
    batch = torch.randint(0, 256, (2, seq))
    counted = M.counted_flops(model, resolve_loss("causal_lm"), batch) / batch.numel()
    formula = M.formula_flops_per_token(model)
    assert formula == pytest.approx(counted, rel=0.02)
    n_mm = n_layer * 12 * d * d + 256 * d  # blocks' matmul weights and the tied head
    assert formula == pytest.approx(6 * n_mm + 12 * n_layer * d * seq)
    got = M.model_flops_per_item(model, resolve_loss("causal_lm"), batch, tokens=batch.numel())
    assert (got.source, got.item, got.per_item) == ("formula", "token", formula)
    assert all(p.device.type == "cpu" for p in model.parameters())  # the meta copy left the model alone


def test_other_models_are_counted_on_the_meta_device() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x, y = torch.randn(5, 8), torch.randint(0, 4, (5,))
    got = M.model_flops_per_item(model, resolve_loss("classification"), (x, y), tokens=0, samples=5)
    # forward 2 (8*16 + 16*4) per sample; backward: both weight gradients, the input gradient of the second
    # layer only (the first layer's input needs none).
    fwd = 2 * (8 * 16 + 16 * 4)
    assert got.source == "flop_counter" and got.item == "sample"
    assert got.per_item == pytest.approx(fwd + 2 * (8 * 16 + 16 * 4) + 2 * 16 * 4)


class _NeedsData(nn.Module):
    """A token model whose forward reads a value (impossible on the meta device)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.out = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if int(x.max().item()) > 100:
            raise ValueError("unexpected token")
        return self.out(self.emb(x))


def test_a_model_that_needs_data_falls_back_to_6n_and_says_why() -> None:
    model = _NeedsData()
    batch = torch.randint(0, 16, (2, 4))
    got = M.model_flops_per_item(model, resolve_loss("causal_lm"), batch, tokens=8)
    n = sum(p.numel() for p in model.parameters())
    assert got.per_item == 6 * n and got.source.startswith("6N (")


def test_cpu_peak_is_measured_once_per_key_and_cached(tmp_path, monkeypatch) -> None:
    calls = []

    def fake(dtype, threads, min_time=0.05):
        calls.append((dtype, threads))
        return 1e11 * threads

    monkeypatch.setattr(M, "measure_cpu_matmul_peak", fake)
    cache = tmp_path / "peak.json"
    first = M.cpu_peak(torch.float32, 1, cache)
    again = M.cpu_peak(torch.float32, 1, cache)
    two = M.cpu_peak(torch.float32, 2, cache)
    assert first.flops == again.flops == 1e11 and two.flops == 2e11
    assert calls == [(torch.float32, 1), (torch.float32, 2)] and "cached" in again.source
    table = json.loads(cache.read_text())
    assert len(table) == 2 and all(M.cpu_model() in k for k in table)


def test_cpu_peak_measurement_is_a_plausible_matmul_rate() -> None:
    rate = M.measure_cpu_matmul_peak(torch.float32, 1, min_time=0.005)
    assert 1e8 < rate < 1e13  # one core: between 0.1 GFLOP/s and 10 TFLOP/s


def test_gpu_peaks_come_from_datasheets() -> None:
    assert M.gpu_peak("NVIDIA H100 80GB HBM3", "bf16").flops == 989.4e12  # the h100-sxm profile
    assert M.gpu_peak("NVIDIA H100 80GB HBM3", "fp32").flops == 67e12
    assert M.gpu_peak("NVIDIA H100 PCIe", "bf16").flops == 756.5e12
    assert M.gpu_peak("NVIDIA H200", "bf16").flops == 989.4e12
    assert M.gpu_peak("NVIDIA A100-SXM4-80GB", "bf16").flops == 312e12
    unknown = M.gpu_peak("Some Future GPU", "bf16")
    assert unknown.flops is None and "GPU_PEAKS" in unknown.source
    assert M.mfu(1e9, 100.0, 2, 1e11) == pytest.approx(0.5) and M.mfu(None, 1.0, 1, 1.0) is None


def test_mfu_in_metrics_summary_and_progress_bar(tmp_path, monkeypatch) -> None:
    from plait.observe.metrics import ProgressBar
    from plait.recipes import build_trainer
    from plait.recipes import validate_config as validate

    monkeypatch.setenv("PLAIT_CACHE_DIR", str(tmp_path / "cache"))
    cfg = load_config(overrides=["--model.n_layer=1", "--model.d_model=32", "--model.n_head=2",
                                 "--model.seq_len=16", "--train.global_batch_size=2", "--train.micro_batch_size=2",
                                 "--train.steps=2", "--train.eval_every=0", "--train.eval_sequences=2",
                                 "--train.log_every=1", "--checkpoint.every=0", "--observe.progress=false",
                                 "--observe.trackers=[]", f"--run.dir={tmp_path / 'run'}"])
    summary = build_trainer(validate(cfg, 1)).fit()
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "step_s" in r]
    assert len(steps) == 2 and all(0 < r["mfu"] < 1 for r in steps)
    r = steps[-1]
    flops = summary["model_flops_per_item"]
    assert summary["flops_source"] == "formula" and summary["flops_item"] == "token"
    assert r["mfu"] == pytest.approx(flops * r["tokens_per_s"] / summary["peak_flops_per_device"])
    assert summary["mfu"] == pytest.approx(flops * summary["tokens_per_s"] / summary["peak_flops_per_device"])
    assert "measured torch.mm peak" in summary["peak_source"]
    assert (tmp_path / "cache" / "peak.json").is_file()
    bar = ProgressBar(10, 0, True)
    try:
        bar.update(1, 2.0, 100.0, 0.123)
        assert bar._progress.tasks[0].fields["mfu"] == "12.3%"
        bar.update(2, 2.0, 100.0, None)
        assert bar._progress.tasks[0].fields["mfu"] == "-"
    finally:
        bar.close()
