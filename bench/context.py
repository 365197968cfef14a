"""Context parallelism on plait's small GPT: activation memory per rank and step time against sequence length.

For each sequence length, at cp=1 (one process on the whole sequence) and cp=2, 4 with each ``cp_impl``
(``ring``, ``alltoall``, ``allgather``), every rank trains through ``plait.Plait.forward_backward`` (gloo ranks
spawned with ``plait.runtime.spawn``) and measures:

* activation memory per rank: the bytes of the tensors autograd saves for backward during one micro-step
  (``torch.autograd.graph.saved_tensors_hooks``, each storage counted once, the model's parameters left out so the
  figure is activations only); the largest over the group's ranks;
* step time: the median wall time of ``forward_backward`` + ``step`` over the timed steps; the largest over ranks.

Verdict (``activation_memory_ok``): for every ``cp_impl`` at the longest length, activation memory per rank at most
1.1 x 1/cp of cp=1's. ``allgather`` keeps only its shard's keys and values and gathers them again in backward,
so it is held to the target too. With ``--documents`` the figures fall well below it: one process's attention
keeps a (T, T) mask per layer, the cp attention builds each block's mask when needed and keeps none.

Step time on a CPU with few cores: every rank is a process and a cp group of ``N`` ranks on fewer than ``N`` cores
time-shares them, so the ring's transfers cannot overlap its block compute and cp > 1 cannot be faster than one
process; the ratios then measure the extra work and communication of each implementation, not the speed-up a
machine with a core (or GPU) per rank would see. ``--quick`` runs two short lengths and one timed step.
``--documents`` trains on packed documents (50 to 999 tokens, any length, cut anywhere by the shards) with the
GPT's document mask, at cp=1 as at every cp, so the figures include the document masks' cost.

    python bench/context.py [--quick] [--documents] [--lengths 512 1024 ...] [--steps N] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from _common import machine_info, spawn_group

IMPLS = ("ring", "alltoall", "allgather")
MODEL = {"n_layer": 2, "d_model": 64, "n_head": 4, "vocab_size": 256}
TARGET = 0.10  # activation memory per rank at most 1.1 x 1/cp of cp=1's


def _saved_bytes(model: Any, call: Any) -> int:
    """Bytes of the storages autograd saves for backward while ``call()`` runs, parameters left out."""
    import torch

    params = {q.untyped_storage().data_ptr() for q in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        call()
    return sum(seen.values())


def _batch(length: int, g: Any, documents: bool) -> dict:
    """One sequence of ``length`` tokens; with ``documents`` packed documents of 50 to 999 tokens (their last one
    cut by the end), with ``position_ids`` and ``doc_ids`` (``plait.data.packing``)."""
    import torch

    from plait.data.packing import packed_fields

    tokens = torch.randint(0, MODEL["vocab_size"], (1, length), generator=g)
    if not documents:
        return {"input_ids": tokens, "labels": tokens.clone()}
    sizes = torch.randint(50, 1000, (length // 50 + 1,), generator=g)
    docs = torch.repeat_interleave(torch.arange(len(sizes)), sizes)[:length]
    return packed_fields(tokens, docs[None])


def _rank(rank: int, world: int, cp: int, impl: str, lengths: list[int], steps: int, run_dir: str,
          documents: bool = False) -> dict:
    import torch

    import plait
    from plait.models.gpt import GPT
    from plait.models.tiny import tiny_config

    torch.manual_seed(0)
    model = GPT(tiny_config(seq_len=max(lengths), **MODEL), document_mask=documents)
    p = plait.Plait(parallel={"cp": cp, "cp_impl": impl}, train={"global_batch_size": 1, "micro_batch_size": 1},
                    run={"dir": f"{run_dir}/{impl}-cp{cp}"}, observe={"progress": False, "trackers": []})
    model, _ = p.setup(model, optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4), loss_fn="causal_lm")
    g = torch.Generator().manual_seed(1)
    out: dict[str, Any] = {}
    for length in lengths:
        batch = _batch(length, g, documents)
        saved = _saved_bytes(model, lambda b=batch: p.forward_backward(model, b))  # also the warm-up step
        p.step()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            p.forward_backward(model, batch)
            p.step()
            times.append(time.perf_counter() - start)
        out[str(length)] = {"activation_bytes": saved, "step_s": statistics.median(times)}
    p.close()
    return out


def _run(cp: int, impl: str, lengths: list[int], steps: int, run_dir: str, documents: bool = False) -> dict:
    ranks = spawn_group(_rank, cp, cp, impl, lengths, steps, run_dir, documents, name=f"context-{impl}-cp{cp}",
                        timeout_s=3000)
    return {str(n): {"activation_bytes_per_rank": max(r[str(n)]["activation_bytes"] for r in ranks),
                     "step_s": max(r[str(n)]["step_s"] for r in ranks)} for n in lengths}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="two short lengths, one timed step")
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    parser.add_argument("--cps", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per length (after one warm-up)")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("--documents", action="store_true",
                        help="packed documents (50-999 tokens) with the GPT's document mask, at every cp too")
    args = parser.parse_args()
    lengths, steps = ([256, 512], 1) if args.quick else (sorted(args.lengths), args.steps)
    bad = [n for n in lengths if any(n % (2 * cp) for cp in args.cps)]
    if bad:
        sys.exit(f"lengths {bad} do not split into 2 x cp equal chunks for cp in {args.cps}")
    run_dir = f"/tmp/plait-bench-context-{os.getpid()}"
    load = os.getloadavg()

    base = _run(1, "ring", lengths, steps, run_dir, args.documents)  # cp=1: no context parallelism, the impl is unused
    results: dict[str, Any] = {"cp1": base}
    longest = str(lengths[-1])
    verdict: dict[str, Any] = {}
    for cp in args.cps:
        for impl in IMPLS:
            runs = _run(cp, impl, lengths, steps, run_dir, args.documents)
            for n, r in runs.items():
                r["memory_ratio_to_cp1"] = r["activation_bytes_per_rank"] / base[n]["activation_bytes_per_rank"]
                r["memory_ratio_to_ideal"] = r["memory_ratio_to_cp1"] * cp  # 1.0 = exactly 1/cp of cp=1's
                r["step_time_ratio_to_cp1"] = r["step_s"] / base[n]["step_s"]
            results[f"{impl}-cp{cp}"] = runs
            ratio = runs[longest]["memory_ratio_to_ideal"]
            verdict[f"{impl}-cp{cp}"] = {"memory_x_cp_over_cp1": ratio, "ok": ratio <= 1.0 + TARGET}
    ring_vs_allgather = {f"cp{cp}": {n: results[f"ring-cp{cp}"][n]["step_s"] / results[f"allgather-cp{cp}"][n]["step_s"]
                                     for n in map(str, lengths)} for cp in args.cps}
    cores = os.cpu_count() or 1
    report = {
        "bench": "context",
        "command": "python " + " ".join(sys.argv),
        "machine": machine_info(),
        "load_average_1_5_15_at_start": load,
        "load_average_1_5_15_at_end": os.getloadavg(),
        "setup": {"model": MODEL, "batch": 1, "packed_documents": args.documents,
                  "lengths": lengths, "cps": args.cps, "timed_steps": steps,
                  "optimizer": "AdamW", "threads_per_rank": 1},
        "results": results,
        "ring_over_allgather_step_time": ring_vs_allgather,
        "step_time_meaning": (
            f"{cores} cores for groups of up to {max(args.cps)} ranks: "
            + ("ranks time-share the cores, so the ring's transfers cannot overlap its block compute and cp > 1 "
               "cannot beat one process; the step-time ratios measure the extra work and communication of each "
               "implementation, not the speed-up of a core or GPU per rank"
               if cores < max(args.cps) else
               "each rank has a core (more with spare); overlap is possible")),
        "verdict": {"target": f"ring, alltoall and allgather activation memory per rank at most {1 + TARGET:g} x "
                              f"1/cp of "
                              f"cp=1's at length {lengths[-1]}",
                    "runs": verdict, "activation_memory_ok": all(v["ok"] for v in verdict.values())},
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
