"""The configuration's sections: one dataclass per ``[section]``, each field's docstring the comment above it,
and ``Config`` holding them all. ``plait.config`` builds, parses and checks them (and re-exports every name
here); this module only declares them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from plait.config_layout import CommConfig, FaultConfig, LaunchConfig, ParallelConfig, PsConfig


class ConfigError(ValueError):
    """A user-facing configuration error; the message says what to change."""


@dataclass
class RunConfig:
    # Run directory: config, checkpoints, metrics and exported weights go here.
    # Empty means runs/plait-<timestamp>.
    dir: str = ""


@dataclass
class ModelConfig:
    # Registered model: gpt (plait's GPT, the default), cnn (a ResNet-style image classifier), or a name a
    # package registers under the plait.models entry-point group.
    name: str = "gpt"
    # "package.module:function" that returns the model (an nn.Module), called with [model.args] as
    # keyword arguments; overrides model.name. The module is imported from the working directory too.
    factory: str = ""
    # Keyword arguments for model.factory or a registered model that takes them (a TOML table).
    args: dict[str, Any] = field(default_factory=dict)
    # Weights to start from: a Hugging Face checkpoint directory (model.safetensors or its index and shards), a
    # .safetensors file, or a plait run directory. The model is then built on the meta device and each rank
    # reads only the slices it holds. Empty: initialised from train.seed.
    weights: str = ""
    # gpt: number of transformer blocks.
    n_layer: int = 4
    # gpt: width of the residual stream.
    d_model: int = 128
    # gpt: attention heads; d_model must divide by it.
    n_head: int = 4
    # gpt: context length in tokens (also the length of the text recipe's training windows).
    seq_len: int = 128
    # gpt: vocabulary size; 0 takes the tokenizer's (data.tokenizer; 256 for bytes). An explicit value must
    # cover the tokenizer's.
    vocab_size: int = 0
    # gpt: dropout probability on attention and residual branches; cnn: before the classifier.
    dropout: float = 0.0


@dataclass
class DataConfig:
    # Registered data set: empty picks the model's own (text for gpt, digits for cnn); text (a token
    # corpus cut into model.seq_len windows), digits (scikit-learn's 8x8 handwritten digits, the vision
    # extra), or a name a package registers under the plait.data entry-point group.
    name: str = ""
    # "package.module:function" that returns the training data set, a (train, eval) pair, or a dict with
    # "train" and "eval"; called with [data.args] as keyword arguments; overrides data.name.
    factory: str = ""
    # Keyword arguments for data.factory (a TOML table).
    args: dict[str, Any] = field(default_factory=dict)
    # text: empty for the embedded corpus; a UTF-8 text file or a flat uint16 token file (.bin), read as today
    # (bytes, one stream); or a file, directory or glob of .parquet, .jsonl/.json (JSON Lines), .arrow or .txt
    # (one document per line) files read as documents (docs/data.md).
    path: str = ""
    # text: the column (Parquet, Arrow) or key (JSON Lines) that holds each document's text.
    text_field: str = "text"
    # text: a local Hugging Face tokenizer: a directory with tokenizer.json, or the file; empty: bytes.
    tokenizer: str = ""
    # text: documents with the end-of-document token, packed into model.seq_len rows of
    # {input_ids, labels, position_ids, doc_ids}; auto: true when data.tokenizer is set.
    pack: bool | Literal["auto"] = "auto"
    # text, packed: attention stays inside each document (plait's GPT masks by doc_ids; a Hugging Face model
    # gets position ids that restart per document).
    document_mask: bool = False
    # text: read the documents as a stream (never held whole; files and row groups dealt to ranks) instead of
    # tokenising them once into a memory-mapped token cache.
    streaming: bool = False
    # text: validation documents (same forms as data.path); empty holds out data.val_fraction instead.
    val_path: str = ""
    # text: fraction held out for validation: of the documents (by a seeded hash of each), or of the tokens at
    # the end of a byte or .bin corpus.
    val_fraction: float = 0.05
    # DataLoader worker processes per rank (0 loads in the training process); streaming: the readers.
    num_workers: int = 0
    # text, streaming: documents in each reader's shuffle buffer.
    shuffle_buffer: int = 1000
    # text, cached: where the token cache goes; empty: a .plait-cache directory beside the data.
    cache_dir: str = ""
    # text, cached: processes that tokenise into the cache (0: one per CPU).
    tokenize_processes: int = 0


@dataclass
class TrainConfig:
    # Optimizer steps to run in total.
    steps: int = 300
    # Sequences per optimizer step, summed over all data-parallel ranks and accumulation micro-steps.
    global_batch_size: int = 32
    # Sequences per forward pass on one rank; 0: the batch size of the loader given to Plait.setup_dataloader,
    # else global_batch_size / dp (one micro-step per optimizer step). The accumulation it implies is logged.
    micro_batch_size: int = 0
    # Seed for weights, data order and dropout.
    seed: int = 1337
    # Compute precision: fp32, bf16 (autocast), fp16 (autocast with a dynamic loss scaler) or fp8 (bf16 with the
    # Linears multiplying in float8: torchao's Float8Linear; the fp8 extra; GPUs of compute capability 8.9+).
    precision: Literal["fp32", "bf16", "fp16", "fp8"] = "fp32"
    # Repeatable bit for bit on CPU: deterministic algorithms, one thread order.
    deterministic: bool = False
    # Validate every this many steps (0: only at the end).
    eval_every: int = 100
    # Validation sequences per evaluation (a fixed set, split over data-parallel ranks).
    eval_sequences: int = 128
    # Write a metrics line every this many steps.
    log_every: int = 10
    # Recompute transformer blocks in backward instead of keeping their activations: none, full (every
    # block), every_k (every checkpoint_every_k-th block) or selective (every block keeps the outputs of the
    # operators in checkpoint_save_ops and recomputes the rest: norms, activations, casts, tensor-parallel
    # all-gathers; torch's selective checkpointing, plait.parallel.activation_checkpoint).
    activation_checkpointing: Literal["none", "full", "every_k", "selective"] = "none"
    # k for activation_checkpointing=every_k.
    checkpoint_every_k: int = 2
    # activation_checkpointing=selective: the operators whose outputs are kept. Groups matmul (mm, addmm, bmm:
    # every Linear) and attention (scaled_dot_product_attention's kernels), or operator names as torch.ops
    # writes them (mm, aten.addmm, _c10d_functional.reduce_scatter_tensor). An entry naming no operator is an
    # error.
    checkpoint_save_ops: list[str] = field(default_factory=lambda: ["matmul", "attention"])
    # Keep the tensors each block saves for backward in host memory (pinned, copied on a side stream on a GPU)
    # and bring them back for its backward (plait.parallel.offload). Not with activation_checkpointing=full or
    # selective, whose blocks keep nothing to move.
    activation_offload: bool = False
    # torch.compile (plait.parallel.compile): auto (or true) compiles the whole model, and the loss with it, as one
    # region where the layout allows (one rank, data parallel, DDP, ZeRO-1/2, a parameter server), else each block
    # and the loss (FSDP2, activation checkpointing, tensor and pipeline parallelism); model or blocks ask for one;
    # false: eager. The choice is logged. Not with expert parallelism; on CPU the inductor backend needs g++.
    compile: bool | Literal["auto", "model", "blocks"] = False
    # torch.compile backend for train.compile: inductor (generated kernels), or another registered backend
    # such as aot_eager (traces forward and backward, runs them eagerly: no code generation, for checks).
    compile_backend: str = "inductor"
    # torch.compile mode for train.compile: default, max-autotune-no-cudagraphs (searched kernels),
    # max-autotune, or reduce-overhead (CUDA graphs, for static shapes).
    compile_mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = "default"
    # Loss of a batch: auto (the model's registered loss; for a factory model, hf when the batch holds
    # labels and the model returns .loss, classification for (x, y) with one label per sample, causal_lm
    # for (x, y) token batches), causal_lm, hf, classification, or "package.module:function" taking
    # (output, target).
    loss: str = "auto"

    @property
    def compute_precision(self) -> str:
        """The autocast and parameter-gather precision: fp8's is bf16 (only its Linears multiply in float8)."""
        return "bf16" if self.precision == "fp8" else self.precision


@dataclass
class OptimConfig:
    # Peak learning rate of AdamW.
    lr: float = 3e-3
    # Learning rate at the end of the cosine decay, as a fraction of lr.
    min_lr_ratio: float = 0.1
    # Steps of linear warmup from 0 to lr.
    warmup_steps: int = 30
    # Steps over which the cosine decays; 0 means train.steps. Set it to stop early and resume later
    # on the same schedule.
    decay_steps: int = 0
    # Decoupled weight decay on matrices (not on biases, norms or embeddings).
    weight_decay: float = 0.1
    # Clip the global gradient norm to this value (0 disables clipping; the gpt and cnn recipes of plait train
    # default to 1.0).
    grad_clip: float = 0.0
    # AdamW beta1.
    beta1: float = 0.9
    # AdamW beta2.
    beta2: float = 0.95
    # Fused AdamW kernel (one pass over each parameter; several times faster on CPU for large models) instead of the
    # per-parameter loop (CPU) or multi-tensor kernels (GPU); auto: fused when the parameters are on a GPU, where it
    # also skips a non-finite step on the device (no host read). Both are deterministic; they round differently in
    # the last bit.
    fused: bool | Literal["auto"] = "auto"
    # Skip the update of a step whose gradient norm is NaN or infinite. auto: where it costs nothing, that is where
    # every optimizer takes torch's found_inf (fused AdamW/Adam/SGD/Adagrad: plait's AdamW on a GPU) and under fp16
    # (the loss scaler's overflow skip, which a GradScaler loop makes too); elsewhere the update is applied, as in
    # your own loop, and the non-finite norm is reported at the next log step. true: skip always (an optimizer without
    # found_inf then reads one flag on the host per step). false: never (refused with fp16). plait train's recipes set
    # true.
    skip_nonfinite: bool | Literal["auto"] = "auto"


@dataclass
class CheckpointConfig:
    # Save a sharded checkpoint every this many steps (0: only at the end), or auto: the interval from the
    # measured save time and fault.mtbf_s by Young's rule, sqrt(2 x MTBF x save time).
    every: int | Literal["auto"] = 200
    # Number of most recent checkpoints kept on disk.
    keep: int = 2
    # Save asynchronously (TOML key checkpoint.async): training continues while the shards are written
    # (DCP's async save); the checkpoint becomes the latest only once it is complete and verified.
    async_save: bool = False
    # Check every file of a checkpoint against its SHA-256 manifest before loading it; a damaged one is
    # skipped for the previous good checkpoint, with a warning naming the file.
    verify: bool = True


@dataclass
class ObserveConfig:
    # Show a progress bar on rank 0.
    progress: bool = True
    # Experiment trackers that receive every metrics.jsonl record and the resolved config from rank 0, any of:
    # tensorboard (event files in RUN_DIR/tensorboard), wandb (Weights & Biases; the wandb extra; WANDB_MODE=offline
    # writes RUN_DIR/wandb only), mlflow (the mlflow extra; see observe.mlflow_uri). [] for none. A resumed run
    # continues the same tracker runs.
    trackers: list[Literal["tensorboard", "wandb", "mlflow"]] = field(default_factory=lambda: ["tensorboard"])
    # W&B project and MLflow experiment of the run (empty: WANDB_PROJECT / MLFLOW_EXPERIMENT_NAME, else each
    # library's default).
    experiment: str = ""
    # MLflow tracking URI: http(s)://server, sqlite:///path.db, file:/path... (empty: MLFLOW_TRACKING_URI, else
    # MLflow's default).
    mlflow_uri: str = ""
    # Serve Prometheus metrics over HTTP (path /metrics): rank r listens on this port + its local rank (0: off).
    prometheus_port: int = 0
    # Address the Prometheus endpoints bind: loopback unless Prometheus scrapes from another host (0.0.0.0).
    prometheus_host: str = "127.0.0.1"
    # Count the collectives torch issues (DDP, FSDP2, tensor and pipeline parallelism) into comm_bytes:
    # first_step counts them on the process's first training step and adds that figure to every later
    # step (their pattern is fixed by the layout and batch shape; counting slowed a small tp=2 step
    # by 33-53%), every_step counts each step, off leaves them out of comm_bytes.
    count_torch_collectives: str = "first_step"
    # Write RUN_DIR/report.html (plots and a bottleneck verdict, as `plait report RUN_DIR` makes it) when the
    # run ends; needs the report extra: pip install 'plait[report]'.
    report: bool = False


@dataclass
class MoeConfig:
    # Experts per MoE layer (0: no MoE; plait's GPT then has dense MLPs only).
    num_experts: int = 0
    # Experts each token is routed to (top-k token choice; ties go to the lower expert index).
    top_k: int = 2
    # Router scores: softmax (Switch, Mixtral) or sigmoid (DeepSeek-V3); gates renormalised when top_k > 1.
    score: Literal["softmax", "sigmoid"] = "softmax"
    # Group-limited routing (DeepSeek-V3): experts in num_groups equal groups, each token choosing among the
    # topk_groups groups with the highest sum of their two best scores (1: no groups).
    num_groups: int = 1
    # Groups each token may choose experts from (with num_groups > 1).
    topk_groups: int = 1
    # Gate weights multiplied by this after normalisation (DeepSeek-V3's routed_scaling_factor).
    route_scale: float = 1.0
    # Every n-th block of plait's GPT is MoE (blocks n-1, 2n-1, ...; 1: every block).
    every: int = 1
    # Hidden width of each expert's MLP (0: 4 x d_model / top_k, so active FLOPs equal a dense 4x MLP).
    d_hidden: int = 0
    # Assignments an expert takes per forward: ceil(factor x tokens x top_k / num_experts); 0 is dropless.
    capacity_factor: float = 0.0
    # Over capacity, keep each expert's highest-probability assignments (probs) or earliest tokens (position).
    drop_policy: Literal["probs", "position"] = "probs"
    # Load balancing: Switch auxiliary loss (aux), auxiliary-loss-free per-expert bias (bias), or none.
    balance: Literal["aux", "bias", "none"] = "aux"
    # Coefficient of the Switch load-balancing loss (balance = aux).
    aux_loss_coef: float = 0.01
    # Coefficient of the router z-loss, mean over tokens of logsumexp(logits)^2 (0: off).
    z_loss_coef: float = 0.0
    # Coefficient of DeepSeek-V3's sequence-wise balance loss, per sequence, with any balance (0: off).
    seq_aux_loss_coef: float = 0.0
    # balance = bias: how far each expert's bias moves per optimizer step (towards the mean load).
    bias_update_rate: float = 0.001
    # Always-on shared experts (DeepSeek style), each a dense MLP of moe.d_hidden, added to the routed output.
    shared_experts: int = 0
    # Expert-parallel dispatch: all-to-all in static shapes with no host read (alltoall), all-to-all with variable
    # splits sized by the routing, one host read per layer, eager only (alltoall_split), or all-gather (reference).
    dispatcher: Literal["alltoall", "alltoall_split", "allgather"] = "alltoall"
    # How experts run: one grouped GEMM per weight (grouped), one padded batched matmul (padded), a loop over
    # experts (loop), or auto: grouped where the device and dtype allow, else padded compiled, loop eager.
    experts: Literal["auto", "grouped", "padded", "loop"] = "auto"
    # plait plan memory: rows the busiest expert-parallel rank's experts receive over the balanced share (1:
    # balanced routing; plait plan memory --run-dir DIR measures it from DIR's logged tokens_per_expert).
    imbalance: float = 1.0


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    ps: PsConfig = field(default_factory=PsConfig)
    observe: ObserveConfig = field(default_factory=ObserveConfig)
    moe: MoeConfig = field(default_factory=MoeConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)

    @property
    def grad_accum(self) -> int:
        """Micro-steps per optimizer step on one rank."""
        t, dp = self.train, max(1, self.parallel.dp)
        return t.global_batch_size // ((t.micro_batch_size or t.global_batch_size // dp) * dp)
