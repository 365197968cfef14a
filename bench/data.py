"""The input pipeline: streaming vs the token cache vs today's ``.bin`` token file, 0 / 1 / 2 workers.

On a generated Parquet corpus (200 MB of text, about 110 MB of Parquet: documents of 20 to 5000 words,
row groups of 2000 rows) and a BPE tokenizer of 4096 tokens trained on part of it offline:

1. cache build: ``plait.data.cache`` tokenising the whole corpus with 1 process and with 2
   (``TOKENIZERS_PARALLELISM=false`` in both, so the 1-process baseline is one core), alternating for
   ``--rounds`` rounds; the fastest of each, and the speedup;
2. pipeline alone: tokens/s of this rank's loader (dp=1, micro-batches of 16 x 128 packed tokens), read
   with nothing else running, for streaming (``StreamingLoader``), cached (``StreamWindows`` under plait's
   ``DistributedLoader``) and ``.bin`` (today's ``TokenWindows`` over the same tokens written as uint16),
   each with ``num_workers`` 0, 1 and 2;
3. data-wait share of a training step: ``plait train`` with the main job's model and layout (the default
   GPT, 2 ranks, micro-batch 16, global batch 32; the vocabulary is the tokenizer's), one run per source
   and worker count; the share is the sum of ``data_s`` over the sum of ``step_s`` in metrics.jsonl,
   the first 5 steps (worker start-up) left out.

Prints one JSON object (``ratios`` compares the sources; ``targets`` the issue's two goals: data-wait share
below 2% streaming with 2 workers; cache build at least 1.6x faster with 2 processes than 1).

    python bench/data.py [--quick] [--steps 60] [--workdir DIR] [--megabytes MB] [--rounds R] [--cache-only]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # before tokenizers is imported: one core per process
SRC = Path(__file__).resolve().parents[1] / "src"
sys.path.insert(0, str(SRC))

import numpy as np  # noqa: E402

SEQ, MICRO = 128, 16
WORKERS = (0, 1, 2)


def make_corpus(root: Path, megabytes: float, seed: int = 0) -> tuple[Path, Path, int]:
    """Parquet shards of about ``megabytes`` of text and a BPE tokenizer; returns (data dir, tokenizer dir,
    number of documents)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = np.random.default_rng(seed)
    vocab = np.array(["the", "of", "and", "a", "to", "in", "is", "was", "for", "on"] +
                     [f"{p}{i}" for p in ("ka", "mo", "ri", "tes", "un") for i in range(400)])
    data = root / "corpus"
    data.mkdir(parents=True)
    total, shard, docs = 0, 0, 0
    target = int(megabytes * 1e6)
    while total < target:
        lengths = np.clip(rng.lognormal(5.0, 1.2, 20000).astype(int), 20, 5000)
        words = vocab[rng.zipf(1.3, int(lengths.sum())) % len(vocab)]
        cuts = np.cumsum(lengths)[:-1]
        texts = [" ".join(w) for w in np.split(words, cuts)]
        pq.write_table(pa.table({"text": texts}), data / f"shard{shard:03d}.parquet", row_group_size=2000)
        total += sum(len(t) for t in texts)
        shard, docs = shard + 1, docs + len(texts)
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    sample = pq.read_table(data / "shard000.parquet").column("text").to_pylist()[:3000]
    tok.train_from_iterator(sample, trainers.BpeTrainer(vocab_size=4096, special_tokens=["[UNK]", "<|endoftext|>"],
                                                        show_progress=False))
    (root / "tok").mkdir()
    tok.save(str(root / "tok" / "tokenizer.json"))
    return data, root / "tok", docs


def cache_build(data: Path, tok_dir: Path, root: Path, rounds: int) -> dict:
    """Build the whole cache with 1 and with 2 processes, alternating (1, 2, then 2, 1, ...) for ``rounds``
    rounds, so load from elsewhere on the machine hits both alike; the fastest build of each counts."""
    from plait.data.cache import cached_tokens
    from plait.data.files import DataFiles
    from plait.data.tokenize import load_tokenizer

    times: dict[int, list[float]] = {1: [], 2: []}
    cpu: dict[int, list[float]] = {1: [], 2: []}
    for r in range(rounds):
        for processes in (1, 2) if r % 2 == 0 else (2, 1):
            cache = root / f"cache{processes}"
            shutil.rmtree(cache, ignore_errors=True)
            t0, c0 = time.perf_counter(), os.times()
            cached_tokens(DataFiles(str(data)), load_tokenizer(str(tok_dir)), str(cache), processes,
                          show_progress=False)
            c1 = os.times()
            times[processes].append(time.perf_counter() - t0)
            cpu[processes].append(sum(c1[i] - c0[i] for i in range(4)))  # this process and its children
    best = {p: min(t) for p, t in times.items()}
    return {"seconds_1_process": best[1], "seconds_2_processes": best[2], "speedup_2_vs_1": best[1] / best[2],
            "all_seconds": {f"{p}_process": t for p, t in times.items()},
            # CPU seconds of the builds: what the wall-clock ratio would approach on otherwise idle cores
            "cpu_seconds": {f"{p}_process": t for p, t in cpu.items()},
            "load_average_after": os.getloadavg()[0]}


def _loaders(data: Path, tok_dir: Path, root: Path, workers: int) -> dict:
    """One loader per source, dp=1, micro-batches of MICRO x SEQ packed tokens."""
    import torch

    from plait.data.cache import cached_tokens
    from plait.data.files import DataFiles
    from plait.data.loader import DistributedLoader
    from plait.data.stream import StreamSpec
    from plait.data.stream_state import StreamingLoader
    from plait.data.text import TokenWindows
    from plait.data.tokenize import load_tokenizer
    from plait.data.windows import DocStream, StreamWindows

    files, tok = DataFiles(str(data)), load_tokenizer(str(tok_dir))
    spec = StreamSpec(files, tok, SEQ, MICRO, True, 1337, 0.0)
    cached = cached_tokens(files, tok, str(root / "cache2"), 2, show_progress=False)
    windows = StreamWindows(DocStream(cached, [np.ones(len(c.doc_hash), bool) for c in cached]), SEQ, pack=True,
                            epoch_offsets=True, seed=1337)
    bin_path = root / "tokens.bin"
    if not bin_path.exists():
        with open(bin_path, "wb") as f:
            for c in cached:
                f.write(np.asarray(c.tokens, dtype=np.uint16).tobytes())
    tokens = torch.from_numpy(np.fromfile(bin_path, dtype=np.uint16).astype(np.int64))
    kw = {"dp_rank": 0, "dp_size": 1, "seed": 1337, "num_workers": workers}
    return {"streaming": StreamingLoader(spec, dp_rank=0, dp_size=1, num_workers=workers),
            "cached": DistributedLoader(windows, MICRO, **kw),
            "bin": DistributedLoader(TokenWindows(tokens, SEQ, epoch_offsets=True, seed=1337), MICRO, **kw)}


def pipeline_rates(data: Path, tok_dir: Path, root: Path, batches: int) -> dict:
    out: dict = {}
    for workers in WORKERS:
        for name, loader in _loaders(data, tok_dir, root, workers).items():
            it = iter(loader)
            for _ in range(3 + 2 * workers):  # workers started and their first batches in flight
                next(it)
            t0 = time.perf_counter()
            for _ in range(batches):
                next(it)
            out.setdefault(name, {})[f"workers_{workers}"] = batches * MICRO * SEQ / (time.perf_counter() - t0)
            del it
    return out


def data_wait(data: Path, tok_dir: Path, root: Path, steps: int) -> dict:
    """``plait train`` with the main job's model and layout; share of the step spent waiting for data."""
    runs = {f"streaming_workers_{w}": ["--data.streaming=true", f"--data.num_workers={w}"] for w in WORKERS}
    runs["cached_workers_2"] = ["--data.num_workers=2", f"--data.cache_dir={root / 'cache2'}"]
    out = {}
    for name, extra in runs.items():
        run = root / "runs" / name
        cmd = [sys.executable, "-m", "plait.cli", "train", f"--data.path={data}", f"--data.tokenizer={tok_dir}",
               f"--train.steps={steps}", "--train.log_every=1", "--train.eval_every=0", "--train.eval_sequences=16",
               f"--train.micro_batch_size={MICRO}",  # the main job's micro-batch as measured (the default is now 0)
               "--observe.progress=false", "--observe.trackers=[]", "--checkpoint.every=0",
               f"--run.dir={run}", *extra]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SRC)}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode:
            out[name] = {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed"}
            continue
        recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        recs = [r for r in recs if "data_s" in r and r["step"] > 5]
        data_s, step_s = sum(r["data_s"] for r in recs), sum(r["step_s"] for r in recs)
        out[name] = {"data_wait_share": data_s / step_s, "median_step_s": float(np.median([r["step_s"] for r in recs])),
                     "steps_counted": len(recs)}
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a 12 MB corpus, fewer batches and steps")
    ap.add_argument("--steps", type=int, default=60, help="training steps per data-wait run")
    ap.add_argument("--workdir", default="", help="where the corpus and runs go (default: a temporary directory)")
    ap.add_argument("--megabytes", type=float, default=0, help="text in the corpus (default 200, --quick 12)")
    ap.add_argument("--rounds", type=int, default=1, help="alternating cache builds per process count")
    ap.add_argument("--cache-only", action="store_true", help="only the cache build")
    args = ap.parse_args(argv)
    megabytes, batches, steps = (12, 300, 20) if args.quick else (200, 2000, args.steps)
    megabytes = args.megabytes or megabytes
    root = Path(args.workdir or tempfile.mkdtemp(prefix="plait-bench-data-"))
    t0 = time.perf_counter()
    data, tok_dir, num_docs = make_corpus(root, megabytes)
    size = sum(f.stat().st_size for f in data.glob("*.parquet"))
    corpus = {"text_mb": megabytes, "parquet_mb": size / 1e6, "documents": num_docs, "made_s": time.perf_counter() - t0}
    result: dict = {"corpus": corpus,
                    "cpus": len(os.sched_getaffinity(0)), "seq_len": SEQ, "micro_batch": MICRO}
    result["cache_build"] = cache_build(data, tok_dir, root, args.rounds)
    if args.cache_only:
        print(json.dumps(result, indent=1))
        return result
    rates = pipeline_rates(data, tok_dir, root, batches)
    result["pipeline_tokens_per_s"] = rates
    result["ratios"] = {f"{a}_vs_bin_workers_{w}": rates[a][f"workers_{w}"] / rates["bin"][f"workers_{w}"]
                        for a in ("streaming", "cached") for w in WORKERS}
    result["training"] = data_wait(data, tok_dir, root, steps)
    share = result["training"].get("streaming_workers_2", {}).get("data_wait_share")
    speedup = result["cache_build"]["speedup_2_vs_1"]
    result["targets"] = {"streaming_2_workers_data_wait_below_2pct": share is not None and share < 0.02,
                         "cache_2_processes_at_least_1.6x": speedup >= 1.6}
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
