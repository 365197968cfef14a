"""What replica groups went through (``fault.mode = "replicas"``), for the run's summary: the groups that left a
quorum (a failure), the groups that healed from a live peer, and the steps trained with fewer groups than configured.

torchft's Manager computes a quorum at every step boundary anyway. Its result names the groups in it (one replica id
per process: ``plait_replica_<g>:<uuid>``, so a replacement is a new id), the torchft step of the groups furthest
ahead and how many groups stand there (the others heal from them), and whether this group heals. torchft 0.2's
Manager reads that result on its quorum thread and keeps nothing of it but the participant count, so plait reads it
where the manager receives it: ``QuorumRecorder`` around the manager's client keeps the last one. Nothing is sent,
written or read from the device for it on the step.

Each group's process keeps its own record (``ReplicaEvents``: what the quorums it was in said) and reports it as the
``replicas`` block of its summary (``Plait.report``; ``plait train`` writes it to ``RUN_DIR/replica<g>/summary.json``).
``run_summary`` merges the groups' blocks into ``RUN_DIR/summary.json``: an event seen by several groups (every group
in a quorum sees the same result) counts once; one seen only by a process that died later is lost with it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from plait.config import ConfigError

_GROUP = re.compile(r"plait_replica_(\d+)(?::|$)")


def group_of(replica_id: str) -> int:
    """The replica group a torchft replica id names (``plait_replica_<g>:<uuid>``, as plait's manager names it)."""
    found = _GROUP.match(replica_id)
    if found is None:
        raise ConfigError(f"torchft replica id {replica_id!r} in this run's quorum was not made by plait "
                          "(plait_replica_<g>:<uuid>): give each run a Lighthouse of its own (fault.lighthouse) and "
                          "start every group with plait run --replicas or plait train")
    return int(found.group(1))


class QuorumRecorder:
    """The torchft manager's client, keeping the result of its last quorum (``last``); every other call passes
    through. torchft's quorum thread writes ``last`` before ``start_quorum`` returns on the main thread."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.last: Any = None

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        self.last = self._client._quorum(*args, **kwargs)
        return self.last

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


class ReplicaEvents:
    """One group's process's record of the quorums it was in (see the module docstring). ``step`` arguments are
    step boundaries: the optimizer steps completed when the quorum formed (the steps after it train with it)."""

    def __init__(self, group: int, groups: int, restarts: int) -> None:
        self.group, self.groups, self.restarts = group, groups, restarts
        self.left: list[dict[str, int]] = []  # {"group", "step"}: a group in the previous quorum is not in this one
        self.healed: list[dict[str, Any]] = []  # {"step", "count", "groups"}: groups that healed at this quorum
        self.fewer: list[list[int]] = []  # [first, last] runs of steps averaged over fewer groups than configured
        self._members: set[str] | None = None  # the replica ids of the last quorum (None: none seen yet)

    def quorum(self, result: Any, step: int, start: bool = False) -> None:
        """The quorum that formed at boundary ``step`` (a torchft ``QuorumResult``). ``start``: one of the run's
        first quorums, asked until every group is in: the groups still arriving then are not failures or joins."""
        ids = set(result.replica_ids)
        joined = set() if start or self._members is None else ids - self._members
        if not start and self._members is not None:
            self.left += [{"group": group_of(r), "step": step} for r in sorted(self._members - ids)]
        self._members = ids
        # the groups not at the furthest torchft step heal from those that are; at step 0 torchft's init_sync also
        # has every group take the first one's weights, which is the run's start, not a heal (all are at step 0)
        count = result.replica_world_size - result.max_world_size
        if count > 0:
            known = {group_of(r) for r in joined} | ({self.group} if result.heal else set())
            self.healed.append({"step": step, "count": count, "groups": sorted(known)})

    def trained(self, step: int, live: int) -> None:
        """Step ``step`` averaged the gradients of ``live`` groups."""
        if live >= self.groups:
            return
        if self.fewer and self.fewer[-1][1] == step - 1:
            self.fewer[-1][1] = step
        else:
            self.fewer.append([step, step])

    def summary(self) -> dict[str, Any]:
        """The ``replicas`` block of this group's summary."""
        return {"group": self.group, "restarts": self.restarts, **_block(self.groups, self.left, self.healed,
                                                                          self.fewer)}


def _block(groups: int, left: list[dict], healed: list[dict], fewer: list[list[int]]) -> dict[str, Any]:
    return {"groups": groups, "failures": len(left), "left": left, "heals": sum(h["count"] for h in healed),
            "healed": healed, "fewer_groups_steps": sum(b - a + 1 for a, b in fewer), "fewer_groups": fewer}


def combine(blocks: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's ``replicas`` block from its groups' (``ReplicaEvents.summary``): a departure of a group at a step, a
    quorum's heals and a step trained with fewer groups count once however many groups saw them; ``restarts`` sums
    the groups' agents' restarts."""
    left = sorted({(e["group"], e["step"]) for b in blocks for e in b["left"]}, key=lambda e: (e[1], e[0]))
    healed: dict[int, dict[str, Any]] = {}
    for h in (h for b in blocks for h in b["healed"]):
        seen = healed.setdefault(h["step"], {"step": h["step"], "count": h["count"], "groups": []})
        seen["count"] = max(seen["count"], h["count"])
        seen["groups"] = sorted(set(seen["groups"]) | set(h["groups"]))
    steps = sorted({s for b in blocks for a, z in b["fewer_groups"] for s in range(a, z + 1)})
    fewer: list[list[int]] = []
    for s in steps:
        if fewer and fewer[-1][1] == s - 1:
            fewer[-1][1] = s
        else:
            fewer.append([s, s])
    return {"restarts": sum(b["restarts"] for b in blocks),
            **_block(blocks[0]["groups"], [{"group": g, "step": s} for g, s in left],
                     [healed[s] for s in sorted(healed)], fewer)}


def run_summary(run_dir: Path, groups: int) -> dict[str, Any]:
    """``plait train``'s summary of a run in replica groups, written to ``RUN_DIR/summary.json``: each group's steps
    and final losses (from ``RUN_DIR/replica<g>/summary.json``) and the run's ``replicas`` block (``combine``)."""
    summaries = [json.loads((run_dir / f"replica{g}" / "summary.json").read_text()) for g in range(groups)]
    out = {"groups": [{"group": g, "summary": f"replica{g}/summary.json",
                       **{k: s.get(k) for k in ("steps", "final_train_loss", "final_val_loss")}}
                      for g, s in enumerate(summaries)],
           "replicas": combine([s["replicas"] for s in summaries])}
    (run_dir / "summary.json").write_text(json.dumps(out, indent=1))
    return out


def describe(block: dict[str, Any]) -> str:
    """One line of a ``replicas`` block for the end of a run."""
    left = ", ".join(f"group {e['group']} at step {e['step']}" for e in block["left"])
    healed = ", ".join(f"step {h['step']}" for h in block["healed"])
    return (f"{block['failures']} replica failure(s){f' ({left})' if left else ''}, {block['heals']} heal(s)"
            f"{f' ({healed})' if healed else ''}, {block['fewer_groups_steps']} step(s) with fewer than "
            f"{block['groups']} groups")
