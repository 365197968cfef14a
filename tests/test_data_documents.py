"""Documents from Parquet and JSON Lines shards with a tokenizer trained here (``tests/data_common.py``).

* packing: position ids restart per document, labels are ignored where a document starts;
* the document mask: changing one token of a document changes no logit of the next document in the row
  (and does without the mask: the probe can fail);
* the token cache is built once, reused, and rebuilt for a changed file; its tokens are the tokenizer's;
* at dp=2 (gloo, spawned), streaming (2 reader workers per rank) and cached: the training documents of
  one epoch are those of a single process (the same multiset of tokens), and no document reaches two
  ranks; a streaming checkpoint saved at dp=2 mid-epoch and resumed at dp=1 consumes every training
  document of that epoch exactly once (token counts per document equal the document's length);
* bad input: one line, exit code 2, no traceback, for each of six mistakes (no file matches, a missing
  column, a tokenizer directory without a tokenizer, a vocabulary larger than the GPT's or than a
  factory model's embedding, a corrupt Parquet file).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from data_common import make_corpus
from helpers import run_ranks

SEQ, MICRO, GLOBAL, SEED, BUFFER = 64, 4, 8, 7, 50


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    return make_corpus(tmp_path_factory.mktemp("corpus"))


def _config(corpus: dict, run_dir: str, **data) -> dict:
    return {"run": {"dir": run_dir}, "model": {"n_layer": 1, "d_model": 32, "n_head": 2, "seq_len": SEQ},
            "data": {"path": str(corpus["parquet"]), "tokenizer": str(corpus["tokenizer"]),
                     "shuffle_buffer": BUFFER, "cache_dir": str(corpus["root"] / "cache"), "tokenize_processes": 1,
                     **data},
            "train": {"global_batch_size": GLOBAL, "micro_batch_size": MICRO, "seed": SEED},
            "observe": {"progress": False, "trackers": []}}


def _training_docs(corpus: dict) -> dict[int, int]:
    """Training document id -> its token count (with the end-of-document token), held-out ones left out."""
    from plait.data.files import DataFiles
    from plait.data.packing import doc_hash, held_out
    from plait.data.tokenize import load_tokenizer

    files, tok = DataFiles(str(corpus["parquet"])), load_tokenizer(str(corpus["tokenizer"]))
    texts = {files.doc_id(u, j): t for u in files.units for j, t in enumerate(files.read(u))}
    ids = sorted(texts)
    val = held_out(np.array([doc_hash(texts[i]) for i in ids], dtype=np.uint64), SEED, 0.05)
    assert 0 < val.sum() < len(ids) * 0.1
    return {i: len(tok.encode(texts[i])) + 1 for i, v in zip(ids, val, strict=True) if not v}


# -- single process ------------------------------------------------------------------------------
def test_packed_fields() -> None:
    from plait.data.packing import packed_fields

    tokens = torch.arange(10, 22).view(2, 6)
    docs = torch.tensor([[5, 5, 6, 6, 6, 7], [7, 7, 7, 8, 9, 9]])
    out = packed_fields(tokens, docs)
    assert out["position_ids"].tolist() == [[0, 1, 0, 1, 2, 0], [0, 1, 2, 0, 0, 1]]
    assert out["labels"].tolist() == [[10, 11, -100, 13, 14, -100], [16, 17, 18, -100, -100, 21]]
    assert all(v.dtype == torch.int64 and v.shape == (2, 6) for v in out.values())


def test_document_mask_keeps_documents_apart() -> None:
    from plait.config import ModelConfig
    from plait.data.packing import packed_fields
    from plait.models.gpt import GPT

    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (1, 24))
    docs = torch.tensor([[1] * 10 + [2] * 8 + [3] * 6])
    changed = tokens.clone()
    changed[0, 4] = (tokens[0, 4] + 1) % 256  # a token of document 1
    logits = {}
    for mask in (True, False):
        torch.manual_seed(1)
        model = GPT(ModelConfig(n_layer=2, d_model=32, n_head=2, seq_len=24), document_mask=mask).eval()
        for name, t in (("a", tokens), ("b", changed)):
            f = packed_fields(t, docs)
            logits[mask, name] = model(f["input_ids"], position_ids=f["position_ids"], doc_ids=f["doc_ids"])
    assert torch.equal(logits[True, "a"][0, 10:], logits[True, "b"][0, 10:])  # documents 2 and 3: untouched
    assert not torch.allclose(logits[True, "a"][0, 4:10], logits[True, "b"][0, 4:10])  # document 1 did change
    assert not torch.allclose(logits[False, "a"][0, 10:], logits[False, "b"][0, 10:])  # no mask: it leaks


def test_hf_model_gets_the_document_mask_from_position_ids() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from plait.data.packing import model_fields, rows_to_batch

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2)).eval()
    tokens = torch.randint(0, 64, (1, 16))
    docs = torch.tensor([[1] * 9 + [2] * 7])
    changed = tokens.clone()
    changed[0, 3] += 1
    fields = model_fields(plait_gpt=False, document_mask=True)
    assert "doc_ids" not in fields
    batches = [rows_to_batch(t.numpy(), docs.numpy(), True, fields) for t in (tokens, changed)]
    out = [model(**{k: v for k, v in b.items() if k != "labels"}).logits for b in batches]
    assert torch.equal(out[0][0, 9:], out[1][0, 9:]) and not torch.allclose(out[0][0, 3:9], out[1][0, 3:9])


def test_every_format_reads_its_documents(tmp_path) -> None:
    import pyarrow as pa
    import pyarrow.ipc as ipc

    from plait.data.files import DataFiles

    texts = [f"document {i} " * (i % 7 + 1) for i in range(25)]
    table = pa.table({"text": texts, "n": list(range(25))})
    with ipc.new_file(str(tmp_path / "a.arrow"), table.schema) as w:  # IPC file: a unit per record batch
        for batch in table.to_batches(max_chunksize=10):
            w.write_batch(batch)
    with ipc.new_stream(str(tmp_path / "b.arrow"), table.schema) as w:  # IPC stream (Hugging Face datasets)
        w.write_table(table)
    (tmp_path / "c.txt").write_text("\n".join(texts[:5]) + "\n\n" + "\n".join(texts[5:]) + "\n")
    files = DataFiles(str(tmp_path))
    assert [p.name for p in files.paths] == ["a.arrow", "b.arrow", "c.txt"]
    assert [u.num_rows for u in files.units] == [10, 10, 5, -1, -1]
    for i in range(3):
        assert [t for u in files.units if u.file == i for t in files.read(u)] == texts  # the blank line skipped
    assert files.doc_id(files.units[2], 3) == 23  # file 0, row 23


def test_token_cache_is_built_once_and_rekeyed_by_contents(corpus, tmp_path) -> None:
    import shutil

    from plait.data.cache import cached_tokens
    from plait.data.files import DataFiles
    from plait.data.tokenize import load_tokenizer

    data = tmp_path / "pq"
    shutil.copytree(corpus["parquet"], data)
    files, tok = DataFiles(str(data)), load_tokenizer(str(corpus["tokenizer"]))
    first = cached_tokens(files, tok, "", processes=2, show_progress=False)
    entries = sorted((data / ".plait-cache").glob("*/meta.json"))
    assert len(entries) == 3
    stamps = [e.stat().st_mtime_ns for e in entries]
    docs = [t for u in files.units if u.file == 0 for t in files.read(u)]
    expected = np.concatenate([np.asarray(tok.encode(d) + [tok.eos_id]) for d in docs])
    assert np.array_equal(np.asarray(first[0].tokens), expected)
    assert len(first[0].doc_starts) == len(docs) + 1
    again = cached_tokens(DataFiles(str(data)), tok, "", processes=2, show_progress=False)
    assert [e.stat().st_mtime_ns for e in entries] == stamps  # reused, not rebuilt
    assert np.array_equal(np.asarray(again[0].tokens), expected)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["a changed document"] * 3}), data / "shard1.parquet")
    changed = cached_tokens(DataFiles(str(data)), tok, "", processes=1, show_progress=False)
    assert len(sorted((data / ".plait-cache").glob("*/meta.json"))) == 4 and len(changed[1].doc_hash) == 3


# -- dp = 2 against one process --------------------------------------------------------------------
def _epoch0_stream(loader, workers: int) -> tuple[Counter, Counter]:
    """Tokens and per-document token counts of epoch 0 (doc_ids' parity bit 0), read until every reader
    worker (batches come from them in turn) has moved on to epoch 1."""
    from plait.data.packing import EPOCH_BIT

    tokens, per_doc, done = Counter(), Counter(), set()
    for i, batch in enumerate(loader):
        epoch = batch["doc_ids"] >> EPOCH_BIT
        keep = epoch == 0
        tokens.update(batch["input_ids"][keep].tolist())
        per_doc.update(batch["doc_ids"][keep].tolist())
        if (epoch == 1).any():
            done.add(i % max(1, workers))
        if len(done) == max(1, workers):
            return tokens, per_doc
    raise AssertionError("the stream ended")


def _cached_epoch(loader) -> Counter:
    tokens: Counter = Counter()
    for batch in loader:  # one epoch of plait's DistributedLoader
        tokens.update(batch["input_ids"].flatten().tolist())
    return tokens


def _setup(corpus: dict, run_dir: str, **data):
    import plait
    from plait.config import ModelConfig
    from plait.data.build import build_documents
    from plait.models.gpt import GPT

    p = plait.Plait(**_config(corpus, run_dir, **data))
    train, _ = build_documents(p.config, show_progress=False)
    torch.manual_seed(0)
    model, opt = p.setup(GPT(ModelConfig(n_layer=1, d_model=32, n_head=2, seq_len=SEQ, vocab_size=500)),
                         optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.0), loss_fn="causal_lm")
    return p, model, opt, p.setup_dataloader(train)


def _group(rank: int, world: int, corpus: dict, root: str) -> dict:
    p, _, _, stream = _setup(corpus, f"{root}/s{world}", streaming=True, num_workers=2 if world == 2 else 0)
    out = {"stream": _epoch0_stream(stream, 2 if world == 2 else 0)}
    p.close()
    p, _, _, cached = _setup(corpus, f"{root}/c{world}", streaming=False)
    out["cached"] = _cached_epoch(cached)
    p.close()
    if world == 2:  # a mid-epoch checkpoint at dp=2: 30 micro-batches on each rank
        p, model, opt, loader = _setup(corpus, f"{root}/k", streaming=True, num_workers=2)
        it = iter(loader)
        before = [next(it)["doc_ids"] for _ in range(30)]
        p.save(f"{root}/ckpt", model=model, optimizer=opt, dataloader=loader)
        out["before"] = Counter(torch.cat(before).flatten().tolist())
        p.close()
    else:  # resumed at dp=1 from the dp=2 checkpoint: read until epoch 1 begins
        from plait.data.packing import EPOCH_BIT

        p, model, opt, loader = _setup(corpus, f"{root}/k1", streaming=True, num_workers=0)
        p.load(f"{root}/ckpt", model=model, optimizer=opt, dataloader=loader)
        after: Counter = Counter()
        for batch in loader:
            d = batch["doc_ids"].flatten()
            after.update(d[(d >> EPOCH_BIT) == 0].tolist())
            if ((d >> EPOCH_BIT) == 1).any():
                break
        out["after"] = after
        p.close()
    return out


@pytest.fixture(scope="module")
def groups(corpus, tmp_path_factory) -> tuple[list[dict], dict]:
    root = str(tmp_path_factory.mktemp("dp"))
    two = run_ranks(_group, 2, corpus, root, timeout=300)
    one = run_ranks(_group, 1, corpus, root, timeout=300)[0]
    return two, one


def test_streaming_dp2_reads_the_documents_of_one_process(corpus, groups) -> None:
    two, one = groups
    want = _training_docs(corpus)
    assert one["stream"][1] == Counter(want)  # one process: every training document once, whole
    docs0, docs1 = set(two[0]["stream"][1]), set(two[1]["stream"][1])
    assert not docs0 & docs1  # no document on two ranks
    assert two[0]["stream"][1] + two[1]["stream"][1] == Counter(want)
    assert two[0]["stream"][0] + two[1]["stream"][0] == one["stream"][0]  # the same multiset of tokens


def test_cached_dp2_reads_the_windows_of_one_process(groups) -> None:
    two, one = groups
    assert two[0]["cached"] + two[1]["cached"] == one["cached"]
    assert sum(one["cached"].values()) > 0.9 * 585_000  # an epoch of windows covers the training tokens


def test_resume_dp2_to_dp1_consumes_each_document_once(corpus, groups) -> None:
    from plait.data.packing import EPOCH_BIT

    two, one = groups
    before = two[0]["before"] + two[1]["before"]
    assert all(d >> EPOCH_BIT == 0 for d in before)  # saved mid-epoch 0
    assert before + one["after"] == Counter(_training_docs(corpus))


# -- bad input ---------------------------------------------------------------------------------------
def _bad(corpus: dict, tmp: Path, capsys, *args: str) -> str:
    from plait.cli import main

    code = main(["train", f"--run.dir={tmp / 'run'}", "--parallel.nproc=1", *args])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


def test_bad_input_is_one_line(corpus, tmp_path, capsys, monkeypatch) -> None:
    tok = f"--data.tokenizer={corpus['tokenizer']}"
    err = _bad(corpus, tmp_path, capsys, f"--data.path={tmp_path}/nothing/*.parquet", tok)
    assert "matches no .parquet" in err
    err = _bad(corpus, tmp_path, capsys, f"--data.path={corpus['parquet']}", tok, "--data.text_field=body")
    assert "no column 'body'" in err and "text, n" in err
    (tmp_path / "emptytok").mkdir()
    err = _bad(corpus, tmp_path, capsys, f"--data.path={corpus['parquet']}", f"--data.tokenizer={tmp_path}/emptytok")
    assert "holds no tokenizer.json" in err
    err = _bad(corpus, tmp_path, capsys, f"--data.path={corpus['parquet']}", tok, "--model.vocab_size=256")
    assert "has 500 tokens but model.vocab_size=256" in err
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "good.parquet").write_bytes((corpus["parquet"] / "shard0.parquet").read_bytes())
    (bad / "broken.parquet").write_bytes(b"PAR1 this is not parquet")
    err = _bad(corpus, tmp_path, capsys, f"--data.path={bad}", tok)
    assert f"{bad / 'broken.parquet'} is not a readable Parquet file" in err
    assert not (tmp_path / "run").exists()  # refused before anything of a run was written
    # a model from model.factory whose embedding is smaller than the tokenizer's vocabulary
    (tmp_path / "smallvocab.py").write_text(
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "def build():\n"
        "    return LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=16, intermediate_size=32,\n"
        "                                        num_hidden_layers=1, num_attention_heads=2))\n")
    monkeypatch.chdir(tmp_path)
    err = _bad(corpus, tmp_path, capsys, f"--data.path={corpus['parquet']}", tok, "--model.factory=smallvocab:build",
               "--data.name=text", f"--data.cache_dir={tmp_path / 'cache'}")
    assert "has 500 tokens but the model embeds 300" in err
