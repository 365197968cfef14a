"""The API's pieces in one process: config tables and lists, loss functions, plan checks, block discovery,
named pipeline splits."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from plait.components.losses import CausalLMLoss, ClassificationLoss, HFLoss, LossError, infer_loss, resolve_loss
from plait.config import ConfigError, from_sections, load_config, to_toml
from plait.models.gpt import GPT
from plait.parallel.pipeline.split import PipelineConfigError, split_by_names
from plait.parallel.tensor.plan import TensorParallelError, hf_plan, validate_plan
from plait.parallel.units import find_blocks


def test_tables_and_lists_from_the_command_line_round_trip(tmp_path) -> None:
    cfg = load_config(overrides=["--model.factory=pkg.mod:build", "--model.args.width=64", "--model.args.name=x y",
                                 '--parallel.tp_plan={"model.layers.*.q_proj" = "colwise"}',
                                 "--parallel.pp_split=model.layers.2,model.layers.4"])
    assert cfg.model.args == {"width": 64, "name": "x y"}
    assert cfg.parallel.tp_plan == {"model.layers.*.q_proj": "colwise"}
    assert cfg.parallel.pp_split == ["model.layers.2", "model.layers.4"]
    path = tmp_path / "c.toml"
    path.write_text(to_toml(cfg))
    assert load_config(path) == cfg
    with pytest.raises(ConfigError, match="parallel.tp_plan must be auto or a table"):
        from plait.config import check_values

        check_values(load_config(overrides=["--parallel.tp_plan=megatron"]))
    with pytest.raises(ConfigError, match="model.args must be a table"):
        load_config(overrides=["--model.args=3"])


def test_keyword_sections() -> None:
    cfg = from_sections({"parallel": {"zero": 2}, "train": {"steps": 7}})
    assert (cfg.parallel.zero, cfg.train.steps) == (2, 7)
    with pytest.raises(ConfigError, match="unknown config section 'paralel'; did you mean 'parallel'"):
        from_sections({"paralel": {"zero": 2}})


def test_causal_lm_loss_shifts_hugging_face_batches() -> None:
    ids = torch.tensor([[5, 6, 7, 8]])
    args, kwargs, target = CausalLMLoss().split({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    assert torch.equal(args[0], ids) and set(kwargs) == {"attention_mask"}
    assert target.tolist() == [[6, 7, 8, -100]]  # the last position has no next token: ignored
    logits = torch.randn(1, 4, 10)
    expected = nn.functional.cross_entropy(logits[0, :3], ids[0, 1:])
    assert torch.allclose(CausalLMLoss().loss(logits, target), expected)
    # plait's own (x, y) pairs are already shifted
    _, _, y = CausalLMLoss().split((ids, ids + 1))
    assert torch.equal(y, ids + 1)


def test_loss_inference_and_errors() -> None:
    model = nn.Linear(3, 3)
    assert isinstance(infer_loss(model, (torch.randn(2, 3), torch.tensor([0, 1]))), ClassificationLoss)
    assert isinstance(infer_loss(model, (torch.zeros(2, 5, dtype=torch.long),) * 2), CausalLMLoss)
    model.config = object()  # a Hugging Face model has a config; labels in a dict: the model's own loss
    assert isinstance(infer_loss(model, {"input_ids": torch.zeros(1, 2), "labels": torch.zeros(1, 2)}), HFLoss)
    with pytest.raises(LossError, match="cannot tell the loss"):
        infer_loss(model, (torch.randn(2, 3), torch.randn(2, 3)))
    with pytest.raises(LossError, match="unknown loss 'mse'"):
        resolve_loss("mse")
    custom = resolve_loss(lambda out, y: (out - y).pow(2).mean())
    assert custom.name == "<lambda>" and custom(model, (torch.ones(1, 3), torch.ones(1, 3))).dim() == 0


def test_plan_checks_need_no_process_group() -> None:
    mlp = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 8))
    assert set(validate_plan(mlp, {"0": "colwise", "2": "rowwise"}, 2)) == {"0", "2"}
    with pytest.raises(TensorParallelError, match=r"0 \(colwise\) splits its output width 6 over parallel.tp=4"):
        validate_plan(mlp, {"0": "colwise"}, 4)
    with pytest.raises(TensorParallelError, match="'3' matches no module of Sequential"):
        validate_plan(mlp, {"3": "colwise"}, 2)
    with pytest.raises(TensorParallelError, match="1 is a ReLU, but rowwise takes Linear or Embedding"):
        validate_plan(mlp, {"1": "rowwise"}, 2)
    assert hf_plan(mlp) is None


def test_blocks_are_found_without_a_blocks_attribute() -> None:
    from plait.config import ModelConfig

    gpt = GPT(ModelConfig(n_layer=3, d_model=16, n_head=2, seq_len=8))
    assert [n for n, _ in find_blocks(gpt)] == ["blocks.0", "blocks.1", "blocks.2"]
    seq = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    assert [n for n, _ in find_blocks(seq)] == ["0", "1", "2"]
    assert find_blocks(nn.Linear(2, 2)) == []
    transformers = pytest.importorskip("transformers")
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2))
    assert [n for n, _ in find_blocks(llama)] == ["model.layers.0", "model.layers.1"]


def test_named_pipeline_splits() -> None:
    names = [f"model.layers.{i}" for i in range(4)]
    assert split_by_names(names, ["model.layers.1"], 2) == [range(0, 1), range(1, 4)]
    with pytest.raises(PipelineConfigError, match="names 1 split points for 3 stages"):
        split_by_names(names, ["model.layers.1"], 3)
    with pytest.raises(PipelineConfigError, match="'model.layer.2' is not a split point"):
        split_by_names(names, ["model.layer.2"], 2)
    with pytest.raises(PipelineConfigError, match="increasing order"):
        split_by_names(names, ["model.layers.3", "model.layers.1"], 3)


def _plait(tmp_path, **sections):
    import plait

    return plait.Plait(run={"dir": str(tmp_path)}, observe={"progress": False, "trackers": []}, **sections)


def test_compiled_model_comes_back_without_prefixes(tmp_path) -> None:
    p = _plait(tmp_path, train={"global_batch_size": 4, "micro_batch_size": 4})
    plain = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model, _ = p.setup(torch.compile(plain))
    assert model is plain and list(model.state_dict()) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    p.backward(model(torch.randn(4, 4)).sum())  # runs compiled (nn.Module.compile in place)
    assert p.step().step == 1 and model._compiled_call_impl is not None


def test_rank_aware_loader_is_not_sharded_again(tmp_path) -> None:
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    p = _plait(tmp_path)
    data = TensorDataset(torch.arange(10.0))
    sharded = DataLoader(data, batch_size=2, sampler=DistributedSampler(data, num_replicas=2, rank=0))
    assert p.setup_dataloader(sharded) is sharded
    plain = p.setup_dataloader(DataLoader(data, batch_size=2), shuffle=False)
    assert [b[0].tolist() for b in plain] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0], [8.0, 9.0]]
