"""Config: strict keys with suggestions, typed overrides, TOML round trip, and cross-field checks."""

from __future__ import annotations

import pytest

from plait.config import Config, ConfigError, load_config, to_toml
from plait.recipes import validate_config as validate


def test_defaults_validate_for_two_workers() -> None:
    cfg = validate(load_config(), 2)
    assert cfg.parallel.dp == 2
    assert cfg.grad_accum == cfg.train.global_batch_size // (cfg.train.micro_batch_size * 2)


def test_unknown_key_names_nearest() -> None:
    with pytest.raises(ConfigError, match=r"unknown config key 'train.stpes'; did you mean 'train.steps'"):
        load_config(overrides=["--train.stpes=3"])


def test_unknown_section_names_nearest() -> None:
    with pytest.raises(ConfigError, match=r"unknown config section 'trian'; did you mean 'train'"):
        load_config(overrides=["--trian.steps=3"])


def test_overrides_are_typed() -> None:
    cfg = load_config(overrides=["--train.steps=7", "--optim.lr=1e-3", "--train.deterministic=true",
                                 "--train.precision=bf16"])
    assert (cfg.train.steps, cfg.optim.lr, cfg.train.deterministic) == (7, 1e-3, True)
    with pytest.raises(ConfigError, match="train.steps must be an integer"):
        load_config(overrides=["--train.steps=seven"])
    with pytest.raises(ConfigError, match="train.precision must be one of fp32, bf16, fp16, fp8"):
        load_config(overrides=["--train.precision=fp4"])


def test_list_overrides_and_the_replaced_tensorboard_key(tmp_path) -> None:
    """A list as TOML, as bare comma-separated names, bracketed or not; observe.tensorboard names its successor."""
    for text, want in (("[]", []), ('["wandb", "mlflow"]', ["wandb", "mlflow"]),
                       ("[wandb, mlflow]", ["wandb", "mlflow"]), ("tensorboard,mlflow", ["tensorboard", "mlflow"])):
        assert load_config(overrides=[f"--observe.trackers={text}"]).observe.trackers == want, text
    assert load_config().observe.trackers == ["tensorboard"]
    with pytest.raises(ConfigError, match="observe.trackers must be one of tensorboard, wandb, mlflow; got 'neptune'"):
        load_config(overrides=["--observe.trackers=[neptune]"])
    path = tmp_path / "c.toml"
    path.write_text("[observe]\ntensorboard = false\n")
    with pytest.raises(ConfigError, match=r"'observe.tensorboard' was replaced by observe.trackers"):
        load_config(path)


def test_toml_round_trip(tmp_path) -> None:
    cfg = load_config(overrides=["--run.dir=x \"y\"", "--model.n_layer=3", "--comm.timeout_s=9"])
    path = tmp_path / "c.toml"
    path.write_text(to_toml(cfg))
    assert load_config(path) == cfg


def test_toml_file_unknown_key(tmp_path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[model]\nn_layers = 2\n")
    with pytest.raises(ConfigError, match="did you mean 'model.n_layer'"):
        load_config(path)


def test_global_batch_must_divide() -> None:
    cfg = load_config(overrides=["--train.global_batch_size=30", "--train.micro_batch_size=4"])
    with pytest.raises(ConfigError, match=r"global_batch_size=30 must equal micro_batch_size \(4\) x dp \(2\)"
                       r" x accumulation steps; try train.global_batch_size=24 or 32"):
        validate(cfg, 2)


def test_degrees_must_match_world() -> None:
    cfg = load_config(overrides=["--parallel.dp=3"])
    with pytest.raises(ConfigError, match=r"dp=3 x tp=1 x pp=1 = 3 do not match the world size 2"):
        validate(cfg, 2)


def test_inferred_dp_needs_divisible_world() -> None:
    cfg = load_config(overrides=["--parallel.tp=2"])
    with pytest.raises(ConfigError, match="world size 3 does not divide by tp x pp = 2"):
        validate(cfg, 3)


def test_heads_must_divide_width() -> None:
    with pytest.raises(ConfigError, match="model.d_model=100 must divide by model.n_head=3"):
        validate(load_config(overrides=["--model.d_model=100", "--model.n_head=3"]), 1)


def test_config_sections_complete() -> None:
    names = {f for f in Config.__dataclass_fields__}
    assert names == {"run", "model", "data", "train", "optim", "parallel", "comm", "checkpoint", "fault", "observe",
                     "ps", "moe", "launch"}


@pytest.mark.parametrize(("args", "world", "message"), [
    (["--parallel.zero=3", "--parallel.dp_shard=3"], 4, r"parallel.dp_shard=3 does not divide the 4 data-parallel "
                                                       r"ranks .* use dp_shard in \[1, 2, 4\]"),
    (["--parallel.zero=2", "--parallel.dp_shard=2"], 4, r"parallel.dp_shard=2 sets the shard groups of hybrid "
                                                       r"sharding.* set parallel.zero=3"),
    (["--parallel.zero=3", "--parallel.dp_shard=1"], 4, r"parallel.dp_shard=1 makes shard groups of one rank"),
    (["--parallel.zero=3", "--parallel.dp_shard=-2"], 4, r"parallel.dp_shard must be 0"),
    (["--parallel.tp=2", "--parallel.impl=torch"], 4, r"set parallel.impl=plait"),
    (["--parallel.tp=2", "--parallel.zero=3"], 2, r"parallel.zero=3 shards model state .* dp=1"),
])
def test_model_parallel_with_zero_combinations(args: list[str], world: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        validate(load_config(overrides=args), world)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_tensor_parallel_composes_with_zero(zero: int) -> None:
    cfg = validate(load_config(overrides=["--parallel.tp=2", f"--parallel.zero={zero}"]), 4)
    assert (cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.zero) == (2, 2, zero)


@pytest.mark.parametrize(("args", "world", "degrees", "strategy"), [
    (["--parallel.zero=3", "--parallel.dp_shard=2"], 8, (1, 4, 2, 1, 1), "fsdp"),
    (["--parallel.zero=3", "--parallel.dp_shard=4"], 8, (1, 2, 4, 1, 1), "fsdp"),
    (["--parallel.zero=3", "--parallel.dp_shard=2", "--parallel.tp=2"], 8, (1, 2, 2, 1, 2), "fsdp"),
    (["--parallel.zero=3", "--parallel.dp_shard=2", "--parallel.pp=2"], 8, (2, 2, 2, 1, 1), "fsdp"),
    (["--parallel.zero=1", "--parallel.pp=2"], 4, (2, 2, 1, 1, 1), "zero"),
    (["--parallel.zero=2", "--parallel.pp=2"], 4, (2, 2, 1, 1, 1), "zero"),
    (["--parallel.zero=3", "--parallel.pp=2", "--parallel.tp=2"], 8, (2, 2, 1, 1, 2), "fsdp"),
])
def test_hybrid_sharding_and_pipeline_zero_degrees(args: list[str], world: int, degrees: tuple, strategy: str) -> None:
    """dp stays the total data-parallel degree; dp_replicate = dp / (ep x dp_shard) on the mesh; the gradient-sync
    policy is the one the ZeRO stage names, whatever model-parallel dimensions run before it."""
    from plait.parallel.compose import policy_class, resolve

    cfg = validate(load_config(overrides=[*args, "--train.micro_batch_size=4"]), world)
    got = resolve(cfg, world)
    assert tuple(got[a] for a in ("pp", "dp_replicate", "dp_shard", "ep", "tp")) == degrees
    assert cfg.parallel.dp == degrees[1] * degrees[2] * degrees[3]
    assert policy_class(cfg).name == strategy
