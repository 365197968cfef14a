"""Hugging Face safetensors checkpoints read and written shard by shard: every rank reads only the slices it
holds and writes only its own shards.

The format is the one ``save_pretrained`` writes: ``model.safetensors`` when one file holds the model, else
``model.safetensors.index.json`` naming ``model-0000k-of-0000n.safetensors`` files; plus ``config.json``. A
weights PATH is such a directory, one ``.safetensors`` file, or a plait run directory (its export,
``RUN_DIR/model/``, or ``model.safetensors`` of runs before directories were written).

Library first, where it does the job. Writing goes through torch's ``torch.distributed.checkpoint`` (DCP) with
its ``HuggingFaceStorageWriter``: every rank writes its shards, and ``enable_consolidation`` assembles the
``model-0000k-of-0000n.safetensors`` files one tensor at a time (``_consolidate_hf_safetensors``: one full
tensor in memory at a time, on the coordinating rank). torch names even a lone file ``model-00001-of-00001``
beside an index; plait renames it ``model.safetensors`` and drops the index, as ``save_pretrained`` has it.
Checked on torch 2.13 with gloo here. The 2.11 sources could not be read on this machine; the class is public
since torch 2.8, whose writer took ``save_sharded`` / ``consolidated_output_path`` instead of
``save_distributed`` / ``enable_consolidation``: a writer without those arguments ends in a message naming the
single-file export instead.

Reading does not use torch's ``HuggingFaceStorageReader``, measured: it maps each file and copies each slice out
of the mapping before copying it into the shard, so while a file is read a rank holds the file's pages it
touched plus a copy of its largest slice. For a 2 GB Llama in 500 MB files that was 0.3 GB per rank above the
shard at 2 ranks (``bench/bigmodel.py``). plait reads each slice's contiguous runs with positioned reads
(``os.preadv``) straight into the shard's storage: its memory is the shard, and no collective is involved.

What plait adds, and why:

* **Which tensors a rank holds, under which names.** Reading and writing take this rank's entries under the
  single-process model's names (``LayoutState.model_entries``): a pipeline stage's layers only, an expert-parallel
  rank's experts as a slice of the global tensor, a later stage's copy of a tied embedding under the name the
  checkpoint has; each DTensor's placements say which slice (FSDP2's dim-0 shards, Megatron row and column
  shards, both at once). torch's classes know files, not layouts.
* **Names through the model's own conventions.** Tied weights are read once under whichever of their names
  the checkpoint has (``save_pretrained`` drops the tied head); a checkpoint of the base model (no
  ``base_model_prefix.``) loads into the model with a head and the other way round, as ``from_pretrained``
  does; keys the model lists in ``_keys_to_ignore_on_load_unexpected`` are ignored. transformers 5's
  per-model renames and merges (a Mixtral's experts, one tensor per expert in the checkpoint, fused in the
  model) are applied to the headers (``plait.checkpoint.hf_convert``): a fused tensor is read from the blocks
  its slice overlaps. A conversion other than a stack or a concatenation ends in a ``WeightsError``.
* **Checks before anything is read.** plait reads the headers first (a few KB per file) and rejects, on
  every rank alike (no rank is left waiting for another), a PATH that does not exist, an index naming a
  missing file, a truncated file, and missing, unexpected, wrong-shape and wrong-dtype tensors, in one
  ``WeightsError`` naming them and the nearest names.
* **dtype.** Floating-point tensors are converted to the dtype of the model's tensor (its fp32 master weights;
  ``train.precision`` bf16/fp16 computes in lower precision from them). A checkpoint tensor of another kind
  (integer for a floating parameter, or the other way round) is a wrong dtype.
"""

from __future__ import annotations

import difflib
import itertools
import json
import math
import os
import re
import shutil
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from plait.config import ConfigError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
RUN_EXPORT = "model"  # RUN_DIR/model/: the trainer's end-of-run export
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F8_E4M3": getattr(torch, "float8_e4m3fn", torch.uint8),
              "F8_E5M2": getattr(torch, "float8_e5m2", torch.uint8)}
DEFAULT_SHARD_BYTES = 2 * 1024**3


class WeightsError(ConfigError):
    """Weights that cannot be loaded into this model; the message names what is wrong and what to do."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the checkpoint: a tensor of one file, or (``blocks``) a tensor the model holds fused that
    the checkpoint stores as several (``plait.checkpoint.hf_convert``); ``file`` is then the first block's."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    file: Path
    start: int = 0  # where the tensor's bytes begin in the file
    blocks: tuple[Block, ...] = ()


@dataclass(frozen=True)
class Block:
    """A checkpoint tensor (``key``, ``info``) as the block of a fused tensor at ``offset``, seen with ``shape``
    (its own shape with size-1 dims inserted where tensors were stacked: the same bytes in the same order)."""

    key: str
    info: TensorInfo
    offset: tuple[int, ...]
    shape: tuple[int, ...]


@dataclass
class Checkpoint:
    """A resolved weights PATH: its files and every tensor's shape, dtype and file (from the headers only)."""

    path: Path
    files: list[Path]
    tensors: dict[str, TensorInfo]


def _fail(msg: str) -> WeightsError:
    return WeightsError(msg)


def checkpoint_files(path: str | Path) -> tuple[Path, list[Path]]:
    """(the checkpoint directory or file, its safetensors files) for a weights PATH (see the module docstring)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise _fail(f"weights {p} does not exist; give a Hugging Face checkpoint directory ({SINGLE} or {INDEX}), "
                    "a .safetensors file, or a plait run directory")
    if p.is_file():
        if p.suffix != ".safetensors":
            raise _fail(f"weights {p} is not a .safetensors file; plait loads safetensors only (no pickled "
                        "checkpoints: convert it with save_pretrained(safe_serialization=True))")
        return p, [p]
    run_export = p / RUN_EXPORT
    if (run_export / INDEX).is_file() or (run_export / SINGLE).is_file():  # a plait run directory's export
        p = run_export
    elif not (p / INDEX).is_file() and not (p / SINGLE).is_file() and (p / "metrics.jsonl").is_file():
        raise _fail(f"run directory {p} has no exported weights ({RUN_EXPORT}/ or {SINGLE}); they are written when "
                    "a run finishes (finish or --resume the run)")
    if (p / INDEX).is_file():
        try:
            weight_map = json.loads((p / INDEX).read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise _fail(f"{p / INDEX} is not a safetensors index (a JSON object with a weight_map): {e}") from None
        files = sorted({p / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise _fail(f"{p / INDEX} names {len(missing)} shard file(s) that are not in {p}: "
                        f"{', '.join(missing[:5])}; copy the whole checkpoint directory")
        return p, files
    if (p / SINGLE).is_file():
        return p, [p / SINGLE]
    found = sorted(p.glob("*.safetensors"))
    if (p / "pytorch_model.bin").exists() or (p / "pytorch_model.bin.index.json").exists():
        raise _fail(f"{p} holds a pickled checkpoint (pytorch_model.bin); plait loads safetensors only: save it "
                    "with save_pretrained(safe_serialization=True)")
    if not found:
        raise _fail(f"{p} has no {SINGLE}, no {INDEX} and no .safetensors file")
    return p, found


def read_header(file: Path) -> dict[str, TensorInfo]:
    """The tensors a safetensors file declares, checked against its size (a truncated file is an error)."""
    size = file.stat().st_size
    try:
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                raise ValueError("the header is longer than the file")
            header = json.loads(f.read(n))
    except (struct.error, ValueError, UnicodeDecodeError) as e:
        raise _fail(f"{file} is not a readable safetensors file ({e}); it may be truncated: copy it again") from None
    out, end = {}, 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _ST_DTYPES.get(info.get("dtype", ""))
        if dtype is None:
            raise _fail(f"{file}: tensor {name} has dtype {info.get('dtype')!r}, which plait does not read")
        out[name] = TensorInfo(tuple(info["shape"]), dtype, file, 8 + n + int(info["data_offsets"][0]))
        end = max(end, int(info["data_offsets"][1]))
    if 8 + n + end > size:
        raise _fail(f"{file} is truncated: its header declares {8 + n + end} bytes, the file has {size}; copy it "
                    "again")
    return out


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Resolve a weights PATH and read every file's header (no tensor data)."""
    root, files = checkpoint_files(path)
    tensors: dict[str, TensorInfo] = {}
    for f in files:
        tensors.update(read_header(f))
    return Checkpoint(root, files, tensors)


def _near(name: str, pool: Iterable[str]) -> str:
    near = difflib.get_close_matches(name, list(pool), n=1, cutoff=0.5)
    return f"{name} (nearest: {near[0]})" if near else name


def _listed(what: str, items: list[str]) -> str:
    more = f" and {len(items) - 5} more" if len(items) > 5 else ""
    return f"{what}: {', '.join(items[:5])}{more}"


def _kind(dtype: torch.dtype) -> str:
    return "float" if dtype.is_floating_point else "bool" if dtype == torch.bool else "integer"


def candidates(name: str, prefix: str) -> list[str]:
    """The checkpoint names ``name`` may have: itself, without or with the base model's prefix."""
    out = [name]
    if prefix and name.startswith(prefix + "."):
        out.append(name[len(prefix) + 1:])
    elif prefix:
        out.append(f"{prefix}.{name}")
    return out


def match_names(groups: dict[str, list[str]], shapes: dict[str, Any], dtypes: dict[str, torch.dtype],
                ckpt: Checkpoint, *, prefix: str = "", ignore: list[str] | None = None,
                what: str = "the model") -> dict[str, str]:
    """For each tied group (canonical name -> its state-dict names), the checkpoint name it is read from;
    raises one ``WeightsError`` naming every missing, unexpected, wrong-shape and wrong-dtype tensor."""
    chosen: dict[str, str] = {}
    missing, shape_err, dtype_err = [], [], []
    for canon, names in groups.items():
        found = next((c for n in names for c in candidates(n, prefix) if c in ckpt.tensors), None)
        if found is None:
            missing.append(_near(canon, ckpt.tensors))
            continue
        info, shape, dtype = ckpt.tensors[found], tuple(shapes[canon]), dtypes[canon]
        if info.shape != shape:
            shape_err.append(f"{found} (checkpoint {list(info.shape)}, model {list(shape)})")
        elif _kind(info.dtype) != _kind(dtype):
            dtype_err.append(f"{found} (checkpoint {str(info.dtype)[6:]}, model {str(dtype)[6:]})")
        chosen[canon] = found
    used = set(chosen.values())
    every = {c for names in groups.values() for n in names for c in candidates(n, prefix)}
    patterns = [re.compile(p) for p in ignore or []]
    unexpected = [_near(k, every) for k in ckpt.tensors
                  if k not in used and k not in every and not any(p.search(k) for p in patterns)]
    problems = [_listed(w, x) for w, x in (("missing", missing), ("unexpected", unexpected),
                                           ("wrong shape", shape_err), ("wrong dtype", dtype_err)) if x]
    if problems:
        raise _fail(f"weights {ckpt.path} do not fit {what}: {'; '.join(problems)}. Load a checkpoint of this "
                    "model (same config), or build the model to match it")
    return chosen


def local_boxes(t: torch.Tensor) -> list[tuple[torch.Tensor, tuple[int, ...]]]:
    """What this rank holds of ``t`` as rectangular boxes of the whole tensor: (a view of the storage it fills,
    the view's offset in the whole tensor). A DTensor's local shard at the offset its placements give (FSDP2's
    dim-0 shard, a Megatron row or column shard, both at once); a DTensor split with ``_StridedShard`` on a 1-D
    mesh (tensor parallelism's packed ``[gate; up]`` expert weights, ``plait.parallel.tensor.strided``) as one
    box per packed block, which ``compute_local_shape_and_global_offset`` cannot describe (it gives one offset);
    a plain tensor whole."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return [(t, (0,) * t.dim())]
    from torch.distributed.tensor.placement_types import _StridedShard

    if t.device_mesh.ndim == 1 and isinstance(t.placements[0], _StridedShard):
        # of each of the split_factor blocks of the split dim, rank r holds chunk r of n, stored one after another
        d, s = t.placements[0].dim, t.placements[0].split_factor
        n, r = t.device_mesh.size(), t.device_mesh.get_local_rank()
        block = t.shape[d] // s
        chunk = block // n
        local = t.to_local()
        return [(local.narrow(d, b * chunk, chunk), tuple(b * block + r * chunk if i == d else 0
                                                           for i in range(t.dim()))) for b in range(s)]
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return [(t.to_local(), tuple(offset))]


def _read_region(f: Any, info: TensorInfo, dest: torch.Tensor, offset: tuple[int, ...]) -> None:
    """Read the block of the file's tensor at ``offset`` of ``dest``'s shape into ``dest`` (CPU, contiguous, the
    file's dtype) with positioned reads: one per contiguous run (the dims after the last sliced one are whole)."""
    full, shape, item = info.shape, tuple(dest.shape), info.dtype.itemsize
    strides = [math.prod(full[d + 1:]) for d in range(len(full))]
    k = max((d for d in range(len(full)) if shape[d] != full[d]), default=0)
    run = (shape[k] * strides[k] if full else 1) * item
    buf = memoryview(dest.reshape(-1).view(torch.uint8).numpy())
    done = 0
    for idx in itertools.product(*(range(offset[d], offset[d] + shape[d]) for d in range(k))):
        first = sum(i * strides[d] for d, i in enumerate(idx)) + (offset[k] * strides[k] if full else 0)
        got = os.preadv(f, [buf[done:done + run]], info.start + first * item)
        if got != run:
            raise _fail(f"{info.file} ended while reading it; it may be truncated: copy it again")
        done += run


def _read_into(fd: int, info: TensorInfo, view: torch.Tensor, offset: tuple[int, ...]) -> None:
    """The block of ``info`` at ``offset`` into ``view``: straight into its storage, or through a temporary of
    its size when ``view`` is not contiguous CPU memory of the file's dtype."""
    direct = view.is_contiguous() and view.dtype == info.dtype and view.device.type == "cpu"
    dest = view if direct else torch.empty(tuple(view.shape), dtype=info.dtype)
    with torch.no_grad():
        _read_region(fd, info, dest, offset)
        if not direct:
            view.copy_(dest)


def _read_blocks(fd_of: Any, info: TensorInfo, local: torch.Tensor, offset: tuple[int, ...]) -> None:
    """A fused tensor's part at ``offset`` (``local``'s shape) from the blocks that overlap it, each one's
    overlap read into its place in ``local``."""
    for b in info.blocks:
        lo = [max(o, bo) for o, bo in zip(offset, b.offset, strict=True)]
        hi = [min(o + n, bo + bn) for o, n, bo, bn in zip(offset, local.shape, b.offset, b.shape, strict=True)]
        if any(h <= lo_ for lo_, h in zip(lo, hi, strict=True)):
            continue
        view = local[tuple(slice(lo_ - o, h - o) for lo_, h, o in zip(lo, hi, offset, strict=True))]
        part = TensorInfo(b.shape, b.info.dtype, b.info.file, b.info.start)
        _read_into(fd_of(part.file), part, view, tuple(lo_ - bo for lo_, bo in zip(lo, b.offset, strict=True)))


def load_into(state: dict[str, torch.Tensor], ckpt: Checkpoint) -> None:
    """Read ``state`` (checkpoint name -> this rank's tensor: plain or DTensor) in place from ``ckpt``: only the
    bytes of this rank's slice of each tensor, straight into its storage (a temporary of the slice's size only
    when the dtype or device differs; of one block's overlap for a fused tensor whose part there is not
    contiguous). No collective: every rank reads its own."""
    fds: dict[Path, int] = {}

    def fd_of(file: Path) -> int:
        if file not in fds:
            fds[file] = os.open(file, os.O_RDONLY)
        return fds[file]

    try:
        for name, t in state.items():
            info = ckpt.tensors[name]
            for local, offset in local_boxes(t):
                if local.numel() == 0:
                    continue
                if info.blocks:
                    _read_blocks(fd_of, info, local, offset)
                else:
                    _read_into(fd_of(info.file), info, local, offset)
    finally:
        for fd in fds.values():
            os.close(fd)


def file_indices(sizes: dict[str, int], max_bytes: int = DEFAULT_SHARD_BYTES) -> dict[str, int]:
    """Name -> file number (1..n): tensors in order, a new file when the next would pass ``max_bytes``."""
    out, index, filled = {}, 1, 0
    for name, size in sizes.items():
        if filled and filled + size > max_bytes:
            index, filled = index + 1, 0
        out[name] = index
        filled += size
    return out


def save_from(state: dict[str, torch.Tensor], out: Path, indices: dict[str, int], group: Any = None,
              coordinator: bool = True) -> None:
    """Write ``state`` (this rank's tensors under the names to write) as a Hugging Face directory at ``out``,
    named as ``save_pretrained`` names it: ``model.safetensors`` when ``indices`` holds one file, else
    ``model-0000k-of-0000n.safetensors`` and the index. Every rank writes its shards in parallel (DCP), then the
    coordinating rank assembles the files from them, one tensor at a time, and removes the shards. Tensors that
    are not floating point (never sharded, a few bytes: BatchNorm's step counters) are added to the last file.
    Collective over ``group``; ``coordinator``: whether this rank is group rank 0."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    out.mkdir(parents=True, exist_ok=True)
    floating = {k: v for k, v in state.items() if v.is_floating_point()}
    others = _gather_small({k: v for k, v in state.items() if not v.is_floating_point()}, group)
    try:
        writer = HuggingFaceStorageWriter(str(out), fqn_to_index_mapping={k: i for k, i in indices.items()
                                                                          if k not in others},
                                          save_distributed=True, enable_consolidation=True)
    except TypeError:
        raise _fail("exporting to a directory needs torch's HuggingFaceStorageWriter with save_distributed and "
                    "enable_consolidation (torch >= 2.9); export to a .safetensors file instead") from None
    dcp.save(floating, storage_writer=writer, process_group=group)
    if coordinator:
        shutil.rmtree(out / "sharded", ignore_errors=True)
        _name_files(out, others)


def _gather_small(tensors: dict[str, torch.Tensor], group: Any) -> dict[str, torch.Tensor]:
    """Every rank's ``tensors`` (small, never sharded: BatchNorm's step counters) on every rank. torch's
    consolidation reads floating-point tensors only (2.13: ``torch.finfo`` of each dtype), so these go
    around it."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return dict(tensors)
    parts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, {k: v.detach().cpu() for k, v in tensors.items()}, group=group)
    return {k: v for part in parts for k, v in part.items()}


def _name_files(out: Path, others: dict[str, torch.Tensor]) -> None:
    """Add ``others`` to the last of torch's files at ``out``; then a lone file becomes ``model.safetensors``
    without an index, and several keep their names and the index: the names ``save_pretrained`` gives, which
    tools that read Hugging Face directories expect."""
    index = json.loads((out / INDEX).read_text())
    files = sorted(set(index["weight_map"].values()))
    if others:
        _append_tensors(out / files[-1], others)
        index["weight_map"].update(dict.fromkeys(others, files[-1]))
        metadata = index.setdefault("metadata", {})
        metadata["total_size"] = metadata.get("total_size", 0) + sum(v.numel() * v.element_size()
                                                                     for v in others.values())
    if len(files) == 1:
        os.replace(out / files[0], out / SINGLE)
        (out / INDEX).unlink()
    else:
        (out / INDEX).write_text(json.dumps(index, indent=2))


def _append_tensors(file: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Add ``tensors`` (a few bytes) to the safetensors ``file``: safetensors serialises them, their header
    entries join the file's with offsets after its data, and the file's data is streamed through unread (never
    a whole shard in memory). Replaced in one rename: a crash leaves the file as it was."""
    from safetensors.torch import save

    blob = save({k: v.detach().cpu().contiguous() for k, v in tensors.items()})
    (n,) = struct.unpack("<Q", blob[:8])
    added = json.loads(blob[8:8 + n])
    added.pop("__metadata__", None)
    tmp = file.with_name(file.name + ".tmp")
    with open(file, "rb") as src, open(tmp, "wb") as dst:
        (m,) = struct.unpack("<Q", src.read(8))
        header = json.loads(src.read(m))
        data_bytes = file.stat().st_size - 8 - m
        for info in added.values():
            info["data_offsets"] = [data_bytes + o for o in info["data_offsets"]]
        text = json.dumps({**header, **added}, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        dst.write(struct.pack("<Q", len(text)) + text)
        shutil.copyfileobj(src, dst, 16 << 20)
        dst.write(blob[8 + n:])
    os.replace(tmp, file)


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a weights PATH, whole (for one process: ``plait sample``, tests, a user's script)."""
    from safetensors import safe_open

    ckpt = open_checkpoint(path)
    out: dict[str, torch.Tensor] = {}
    for f in ckpt.files:
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():  # noqa: SIM118 - safe_open is not a dict
                out[k] = st.get_tensor(k)
    return out
