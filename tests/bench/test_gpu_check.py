"""The GPU check's CPU rehearsal: ``bench/gpu_check.py --device cpu --quick`` runs every section with tiny sizes
and writes ``gpu_check.json`` into the working directory; every section holds figures or ``skipped`` with a
reason, and none failed. So the script that runs on a lent GPU cannot rot between GPU days."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py"


def test_cpu_rehearsal_fills_every_section(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--quick"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    sections = result["sections"]
    assert set(sections) == {"env", "tests", "gpt", "memory", "hf", "multiprocess"}
    for name, body in sections.items():
        assert "error" not in body, f"{name}: {body['error']}"
        assert body, name
    env_s = sections["env"]
    assert env_s["measured_peak_bf16"]["flops"] > 0 and env_s["torch"]
    assert env_s["datasheet_peak_bf16"]["flops"] is None  # no datasheet peak for a CPU, and it says so
    tests = sections["tests"]
    assert tests["files"] == ["tests/test_gpu.py"] and tests["counts"]["failed"] == tests["counts"]["error"] == 0
    assert all(t["outcome"] == "skipped" and t["detail"] for t in tests["tests"].values())  # no CUDA here
    for mode in ("eager", "compiled"):
        row = sections["gpt"]["tiny"][mode]
        assert row["plait_tokens_per_s"] > 0 and row["peer_tokens_per_s"] > 0 and row["flops_per_token"] > 0
        assert row["ratio_plait_over_peer"] == row["plait_tokens_per_s"] / row["peer_tokens_per_s"]
    assert sections["gpt"]["plait_host_profile"]["top_self_cpu"]
    memory = sections["memory"]
    assert "CPUOffloadPolicy" in memory["big_bf16_zero3_offload"]["skipped"]
    for name in ("fp32", "bf16", "bf16_ckpt_full", "bf16_ckpt_every_2", "big_bf16"):
        row = memory[name]
        assert row["predicted_bytes"] > 0 and row["measured_model_state_bytes"] > 0 and row["measured_skipped"]
    # activation checkpointing predicts less memory than keeping every block's activations
    assert memory["bf16_ckpt_full"]["predicted"]["activations"] < memory["bf16"]["predicted"]["activations"]
    hf = sections["hf"]
    assert hf["params"] > 0 and hf["plait_step_s"] > 0 and hf["peer_step_s"] > 0
    assert "one rank per GPU" in sections["multiprocess"]["skipped"]
    assert "plait GPU check (cpu, quick)" in done.stdout
