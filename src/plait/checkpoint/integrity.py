"""Checkpoint integrity: a SHA-256 manifest written with every checkpoint, checked before it is loaded.

``write_manifest(path)`` hashes every file of a complete checkpoint directory (DCP shards and
``.metadata``, per-rank state, shared state) into ``manifest.json``, written atomically before
``meta.json`` (which marks the checkpoint complete). ``verify(path)`` recomputes the hashes and lists
what is wrong: a missing, truncated, changed or unexpected file, a missing manifest.
``newest_good(run_dir)`` walks a run's checkpoints from the newest and returns the first that verifies,
with the problems of the ones it skipped, so a damaged checkpoint costs the steps since the previous
one, never the run. A checkpoint of a step recorded as a loss spike is never treated as good.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

MANIFEST = "manifest.json"
_UNHASHED = {MANIFEST, "meta.json"}  # meta.json is written after the manifest and names the step


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file() and p.name not in _UNHASHED)


def write_manifest(path: Path) -> dict[str, dict[str, int | str]]:
    """Hash every file under ``path`` into ``path/manifest.json`` (written atomically); returns it."""
    path = Path(path)
    entries = {str(p.relative_to(path)): {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in _files(path)}
    tmp = path / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"files": entries}, indent=1))
    os.replace(tmp, path / MANIFEST)
    return entries


def verify(path: Path) -> list[str]:
    """What is wrong with the checkpoint at ``path`` (empty: it is whole)."""
    path = Path(path)
    if not (path / "meta.json").is_file():
        return [f"{path / 'meta.json'} is missing (the save did not complete)"]
    manifest_file = path / MANIFEST
    if not manifest_file.is_file():
        return [f"{manifest_file} is missing"]
    try:
        expected = json.loads(manifest_file.read_text())["files"]
    except (ValueError, KeyError):
        return [f"{manifest_file} is not a valid manifest"]
    problems = []
    for rel, entry in expected.items():
        f = path / rel
        if not f.is_file():
            problems.append(f"{f} is missing")
        elif f.stat().st_size != entry["bytes"]:
            problems.append(f"{f} has {f.stat().st_size} bytes, the manifest says {entry['bytes']} (truncated?)")
        elif _sha256(f) != entry["sha256"]:
            problems.append(f"{f} does not match its SHA-256 in the manifest (the file changed)")
    extra = [str(p.relative_to(path)) for p in _files(path) if str(p.relative_to(path)) not in expected]
    problems += [f"{path / rel} is not in the manifest" for rel in extra]
    return problems


@dataclass
class Found:
    """The newest checkpoint that verified (None: none did) and what was wrong with newer ones."""

    path: Path | None
    skipped: dict[str, list[str]] = field(default_factory=dict)


def checkpoints_newest_first(run_dir: Path) -> list[Path]:
    root = Path(run_dir) / "checkpoints"
    return sorted((p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp")), reverse=True)


def spike_steps(run_dir: Path) -> set[int]:
    """Steps recorded as loss spikes in the run's fault log (their checkpoints are not good)."""
    log = Path(run_dir) / "fault.jsonl"
    steps: set[int] = set()
    if log.is_file():
        for line in log.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("event") == "spike" and not rec.get("replay"):  # a replay's checkpoint of the step may be good
                steps.add(int(rec["step"]))
    return steps


def newest_good(run_dir: Path, check: bool = True, before_step: int | None = None) -> Found:
    """The newest complete, verified checkpoint of ``run_dir`` (optionally of a step below ``before_step``),
    skipping damaged ones and those of loss-spike steps."""
    found = Found(None)
    bad_steps = spike_steps(run_dir)
    for path in checkpoints_newest_first(run_dir):
        step = int(path.name.split("_")[1])
        if before_step is not None and step >= before_step:
            continue
        if step in bad_steps:
            found.skipped[str(path)] = [f"step {step} was a loss spike"]
            continue
        problems = verify(path) if check else ([] if (path / "meta.json").is_file() else ["incomplete"])
        if not problems:
            found.path = path
            return found
        found.skipped[str(path)] = problems
    return found
