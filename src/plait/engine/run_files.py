"""Where one run's files go: the run directory every rank agrees on, the error directory the launcher reads,
and the progress and pid files of the restart policy (``plait.fault.restart``)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch.distributed as dist

from plait.fault.restart import write_pid, write_progress
from plait.runtime.dist import FOLLOW_RUN_DIR_ENV, RUN_DIR_NOTE, error_dir_from_env, error_file


class RunFiles:
    """The run's directories (rank 0 chooses ``runs/plait-<time>`` when ``run.dir`` is empty, every rank
    gets it) and the launcher's files. Collective when the run directory must be agreed."""

    def __init__(self, run_dir: str, rank: int, world_size: int) -> None:
        self.rank = rank
        self.run_dir = self._agree(run_dir, world_size)
        launcher_dir = error_dir_from_env(self.run_dir / "errors")
        # Where the launcher looks for progress and worker pids: its error directory's parent.
        self.state_dir = launcher_dir.parent
        self.error_dir = launcher_dir
        if os.environ.get(FOLLOW_RUN_DIR_ENV):  # plait run: reports go to RUN_DIR/errors, the launcher told
            self.error_dir = (self.run_dir / "errors").resolve()
            if rank == 0:
                note = self.state_dir / RUN_DIR_NOTE
                note.parent.mkdir(parents=True, exist_ok=True)
                tmp = note.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(str(self.run_dir.resolve()))
                os.replace(tmp, note)
        error_file(self.error_dir, rank).unlink(missing_ok=True)
        write_pid(self.state_dir, rank)

    @staticmethod
    def _agree(run_dir: str, world_size: int) -> Path:
        if run_dir:
            return Path(run_dir)
        run_id = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("SLURM_JOB_ID")
        name = [f"runs/plait-{run_id or time.strftime('%Y%m%d-%H%M%S')}"]
        if world_size > 1:
            dist.broadcast_object_list(name, src=0)
        return Path(name[0])

    @property
    def error_path(self) -> Path:
        """This rank's error report (its first line is what the launcher prints)."""
        return error_file(self.error_dir, self.rank)

    def write_progress(self, steps: int, saved: int | None, start: int) -> None:
        """Rank 0 notes how far the run got, for the launcher's restart decision."""
        if self.rank == 0 and self.state_dir is not None:
            write_progress(self.state_dir, steps=steps, saved=saved, start=start)
