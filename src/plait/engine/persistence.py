"""``Plait``'s checkpoints and exports (a mixin): ``save`` / ``load`` (disk, or a host-memory copy), the whole
model's weights (``full_state_dict``) and ``export``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from plait.checkpoint.export import export_weights
from plait.checkpoint.hf import DEFAULT_SHARD_BYTES
from plait.config import Config
from plait.engine.collectives import explained
from plait.parallel import compose
from plait.parallel.errors import PlaitError
from plait.parallel.layout import Layout


class Persistence:
    """Saves, loads and exports for ``Plait`` (which provides the attributes used here)."""

    config: Config
    checkpointer: Any
    stepper: Any
    comm: Any
    rng: Any
    group: Any
    device: torch.device
    logger: Any
    prometheus: Any
    rank: int
    world_size: int

    @explained
    def save(self, path: str | Path, *, model: nn.Module | None = None, optimizer: Any = None,
             scheduler: Any = None, dataloader: Any = None, extra: dict[str, Any] | None = None,
             on_complete: Callable[[Path], None] | None = None) -> Path:
        """Save a complete, reshardable checkpoint at ``path`` (collective: every rank calls it).

        Holds the model and optimizer state (DCP shards keyed by the single-process model's names, so
        it loads at another world size or layout), the scheduler, the loader's position, the loss scale,
        every rank's RNG and compressor residuals, and ``extra`` (JSON), with a SHA-256 manifest of every
        file. Written to ``path.tmp`` and renamed when complete: a crash never leaves a half checkpoint
        at ``path``. With ``checkpoint.async`` the shards are written in the background and the
        checkpoint completes at the next optimizer step (or save, or ``close``); ``on_complete(path)``
        then runs on rank 0.
        """
        strategy = self._check_objects(model, optimizer)
        self.finish_saves()
        self.phase("checkpoint save")
        shared = self.stepper.run_state(scheduler, dataloader)
        meta = {"extra": extra or {}, "world_size": self.world_size, "dp": self.dp,
                "layout": strategy.describe() or "single process", "steps": self.steps}
        rank_state = {"comm": self.comm.state_dict(), "rng": self.rng.state_dict()}
        return self.checkpointer.save(Path(path), strategy, meta, self.rank, rank_state,
                                      shared, self.steps, on_complete, self.is_main)

    def finish_saves(self) -> None:
        """Complete an asynchronous save still being written (collective; nothing when there is none)."""
        if self.checkpointer.pending:
            self.phase("checkpoint save")
            self.checkpointer.finish(self.is_main)

    def _saved(self, path: Path, step: int) -> None:
        self.logger.info("checkpoint saved: %s", path)
        self.stepper.saved_step = step
        self.stepper.write_progress()
        if self.prometheus is not None:
            self.prometheus.checkpoint_done()

    def _host_copy(self, cfg: Config) -> Any:
        """``fault.memory_checkpoint``: this rank's holders (``plait.engine.host_copies``: its machine's, which the
        launcher started, and on several machines the peer machine's); None when off, under a parameter server,
        or where no holder runs (a worker not started by ``plait train``: said once). Collective on several
        machines (one all-gather of the holders' addresses, at setup)."""
        if not cfg.fault.memory_checkpoint or not compose.copies_state_per_rank(cfg):
            return None
        from plait.engine.host_copies import holders_for

        holders = holders_for(self.rank, self.world_size, self.group, self.device, self.logger)
        if holders is None and self.is_main:
            self.logger.warning("fault.memory_checkpoint: no holder runs beside this worker (plait train starts "
                                "one for 2 or more workers, whose restarts use it); checkpoints go to disk only")
        return holders

    def memory_copy(self, accept: Callable[[int], bool]) -> Any:
        """The in-memory checkpoint (``plait.engine.host_copies.HeldCopy``: step, this rank's decoded copy, where it
        came from) that every rank found whole, from its own machine's holder or a peer machine's, and could fit
        into its layout, of one same step that ``accept(step)`` takes on every rank, at this world size; None
        otherwise, or with no holder (then every rank reads the disk). Collective (one all-reduce of six numbers
        over every rank); ``load(path, memory=held.decoded)`` then loads it."""
        from plait.checkpoint.memory import decode
        from plait.engine.host_copies import find_copies

        strategy = self._require_strategy()
        return find_copies(self.checkpointer.host_copy, self.rank, self.world_size, accept,
                           lambda payload: decode(payload, strategy.state),
                           lambda t: self.reduce(t, op="sum", over="world"), self.logger)

    @explained
    def load(self, path: str | Path, *, model: nn.Module | None = None, optimizer: Any = None,
             scheduler: Any = None, dataloader: Any = None, verify: bool | None = None,
             memory: Any = None) -> dict[str, Any]:
        """Load a checkpoint written by ``save`` (at any world size or layout) into this run's objects;
        returns its ``extra``. Every file is first checked against the checkpoint's manifest
        (``checkpoint.verify``; ``verify`` overrides it): a damaged one raises ``CheckpointError`` naming
        the file. ``memory``: this rank's in-memory copy of the same checkpoint (``memory_copy``), read instead
        of the disk. Collective: every rank calls it."""
        strategy = self._check_objects(model, optimizer)
        self.phase("checkpoint load")
        self._meet()
        check = self.config.checkpoint.verify if verify is None else verify
        meta, rank_state, shared, same_world = self.checkpointer.load(Path(path), strategy, self.rank,
                                                                      self.world_size, check, memory)
        self.stepper.restore(shared, scheduler, dataloader, path)
        strategy.state.finish_load()
        if rank_state is not None:  # compressor residuals and the model's stream: the resumed run continues exactly
            self.comm.load_state_dict(rank_state["comm"])
            if "rng" in rank_state:
                self.rng.load_state_dict(rank_state["rng"])
        elif not same_world:
            self.logger.info("checkpoint saved at world size %s, loading at %d: per-rank RNG and compressor "
                             "residuals start fresh", meta.get("world_size"), self.world_size)
        self.logger.info("loaded %s (step %d)%s", path, self.steps, " from host memory" if memory is not None else "")
        self.stepper.write_progress()  # where this attempt starts, for the launcher's no-progress rule
        if self.prometheus is not None:  # training since this checkpoint is what a failure would lose
            self.prometheus.checkpoint_done()
        self.stepper.start_step()
        return meta.get("extra", {})

    def _check_objects(self, model: Any, optimizer: Any) -> Layout:
        strategy = self._require_strategy()
        if model is not None and model is not strategy.model:
            raise PlaitError("save/load got a model other than the one setup() returned; pass that one")
        if optimizer is not None and optimizer is not strategy.optimizer:
            raise PlaitError("save/load got an optimizer other than the one setup() returned; pass that one")
        return strategy

    @explained
    def full_state_dict(self, model: nn.Module | None = None, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """The whole model's weights under its single-process names, unsharded, on the CPU, on every rank
        (``rank0_only``: only rank 0's is sure to be filled, which spares the others the memory).
        Collective: gathers FSDP, tensor-parallel and pipeline shards."""
        strategy = self._check_objects(model, None)
        self.phase("export")
        return {k: v.detach().cpu() for k, v in strategy.state.full_model_state(rank0_only).items()}

    def export(self, model: nn.Module | None, path: str | Path, *, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
        """Write the weights under the single-process names (every rank calls it): ``*.safetensors`` is one file on
        rank 0; any other path a Hugging Face directory written shard by shard (``plait.checkpoint.weights``)."""
        return export_weights(self, model, Path(path), max_shard_bytes)
