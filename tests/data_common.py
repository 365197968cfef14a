"""Documents, shards and a tokenizer made in a test (shared by the data tests through module fixtures).

``make_corpus(root)`` writes 3000 documents of 3 to 420 words (a seeded mix: many short, some long) as
three Parquet shards (row groups of 100, 150 and 200 rows: unequal units) and two JSON Lines shards, and
trains a byte-level BPE tokenizer of 500 tokens (with ``<|endoftext|>``) on them offline with the
``tokenizers`` library, saved to ``root/tok``. Returns the paths and the texts.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

NUM_DOCS, PARQUET_SHARDS, PARQUET_ROWS = 3000, 3, 800


def make_corpus(root: Path) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(0)
    words = "the a of and to in is it that for on with as was at by an be this from or are".split() + \
        [f"w{i}" for i in range(300)]
    lengths = [rng.choice([3, 10, 40, 120, 400]) + rng.randrange(20) for _ in range(NUM_DOCS)]
    docs = [" ".join(rng.choice(words) for _ in range(n)) for n in lengths]
    (root / "pq").mkdir(parents=True)
    for s in range(PARQUET_SHARDS):
        part = docs[s * PARQUET_ROWS:(s + 1) * PARQUET_ROWS]
        pq.write_table(pa.table({"text": part, "n": list(range(len(part)))}), root / "pq" / f"shard{s}.parquet",
                       row_group_size=100 + 50 * s)
    (root / "jl").mkdir()
    rest = docs[PARQUET_SHARDS * PARQUET_ROWS:]
    for s in range(2):
        with open(root / "jl" / f"part{s}.jsonl", "w") as f:
            for d in rest[s::2]:
                f.write(json.dumps({"text": d}) + "\n")
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=["[UNK]", "<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(docs, trainer)
    (root / "tok").mkdir()
    tok.save(str(root / "tok" / "tokenizer.json"))
    return {"root": root, "parquet": root / "pq", "jsonl": root / "jl", "tokenizer": root / "tok", "docs": docs,
            "parquet_docs": docs[:PARQUET_SHARDS * PARQUET_ROWS]}
