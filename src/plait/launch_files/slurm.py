"""The sbatch script of ``plait launch slurm`` (see ``plait.launch_files`` for the choices it makes).

Preemption and time limits cost the job only its time off the cluster: the script asks for ``--requeue`` and
``--signal=B:USR1@<grace>``. The warning (USR1 to the batch shell, ``grace`` seconds before the time limit, or at
preemption where the cluster sends the job's own signal then) is passed to every task through ``srun``; a SIGTERM
(what a cluster sends at preemption otherwise) reaches the tasks directly. Either way each task only sets a flag
(``plait.fault.preempt``); at the next step boundary every rank saves and exits 75. The batch script then requeues
its own job with ``scontrol requeue $SLURM_JOB_ID`` (an array task: ``ARRAYID_INDEX``, as the array's id
requeues every task): it runs on the allocation's first node, outside any container
the tasks may run in (where ``scontrol`` is often missing), and a requeued job keeps its id, so it finds its run
directory and resumes from the newest checkpoint, at whatever node count it is given next. A job cancelled with
``scancel`` saves the same way but is not requeued.
"""

from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path

from plait.launch_files.shape import Cluster, SlurmJob


def _nodes(c: Cluster) -> str:
    return f"{c.min_nodes}-{c.nodes}" if c.elastic else str(c.nodes)


def sbatch_header(c: Cluster, job: SlurmJob, workdir: Path) -> list[str]:
    """The ``#SBATCH`` lines of the script."""
    out = "%x-%A_%a.out" if job.array else "%x-%j.out"
    head = [f"#SBATCH --job-name={job.name}", f"#SBATCH --nodes={_nodes(c)}",
            f"#SBATCH --ntasks-per-node={c.procs_per_node}", f"#SBATCH --chdir={workdir}", f"#SBATCH --output={out}",
            "#SBATCH --open-mode=append  # a requeued job goes on writing the same file",
            "#SBATCH --requeue",
            f"#SBATCH --signal=B:USR1@{job.grace_s}  # {job.grace_why}"]
    if c.gpus_per_node:
        head.append(f"#SBATCH --gres=gpu:{c.gpus_per_node}")
    if job.cpus_per_task:
        head.append(f"#SBATCH --cpus-per-task={job.cpus_per_task}")
    for flag, value in (("partition", job.partition), ("qos", job.qos), ("account", job.account),
                        ("time", job.time_limit)):
        if value:
            head.append(f"#SBATCH --{flag}={value}")
    if job.array:
        head.append(f"#SBATCH --array=0-{len(job.array) - 1}")
    return head


def _array_case(array: list[list[str]]) -> str:
    """Each array task's config changes, chosen by ``$SLURM_ARRAY_TASK_ID``."""
    if not array:
        return "TASK=()"
    cases = "\n".join(f"  {i}) TASK=({' '.join(map(shlex.quote, words))}) ;;" for i, words in enumerate(array))
    return ('case "${SLURM_ARRAY_TASK_ID:-0}" in\n' + cases +
            '\n  *) echo "plait: no config changes for array task $SLURM_ARRAY_TASK_ID" >&2; exit 2 ;;\nesac\n'
            'RUN_DIR="$RUN_DIR/task-$SLURM_ARRAY_TASK_ID"')


def slurm_script(config_path: str | Path, overrides: list[str], c: Cluster, job: SlurmJob, *,
                 python: str = sys.executable, workdir: str | Path | None = None) -> str:
    """The sbatch script (see the module docstring); ``python`` is the interpreter the nodes run plait with."""
    workdir = Path(workdir or Path.cwd()).resolve()
    config = Path(config_path).resolve()
    head = sbatch_header(c, job, workdir)
    srun = ["srun", "--kill-on-bad-exit=1"] + ([f"--cpus-per-task={job.cpus_per_task}"] if job.cpus_per_task else [])
    new_run = " ".join(['"$CONFIG"', '--run.dir="$RUN_DIR"', *map(shlex.quote, overrides), '"${TASK[@]}"'])
    job_dir = f"runs/{job.name}-$SLURM_ARRAY_JOB_ID" if job.array else f"runs/{job.name}-$SLURM_JOB_ID"
    shape = f"{c.min_nodes} to {c.nodes} node(s)" if c.elastic else f"{c.nodes} node(s)"
    world = (f"world size {c.min_nodes * c.procs_per_node} to {c.world_size}" if c.elastic
             else f"world size {c.world_size}")
    return f"""#!/bin/bash
# plait on SLURM: {shape} x {c.procs_per_node} process(es) = {world}
# ({f"{c.gpus_per_node} GPU(s) per node, one process each" if c.gpus_per_node else "CPU processes"}).
# Written by `plait launch slurm` on {time.strftime("%Y-%m-%d %H:%M")}. Submit with: sbatch <this file>
{chr(10).join(head)}
set -uo pipefail

CONFIG={shlex.quote(str(config))}
PYTHON={shlex.quote(python)}
# The run directory must be on a file system every node shares (checkpoints are written by every rank).
RUN_DIR="${{PLAIT_RUN_DIR:-{job_dir}}}"
MAX_RESTARTS={job.max_restarts}  # fault.max_restarts: rerun the step from the newest checkpoint this many times
{_array_case(job.array)}

# Rendezvous: rank 0 (first task of the first node) hosts the process group's TCP store; plait reads
# SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID for rank, world size and local device.
export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
export MASTER_PORT="${{PLAIT_MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}}"
export OMP_NUM_THREADS="${{SLURM_CPUS_PER_TASK:-1}}"
export PYTHONUNBUFFERED=1

# SLURM's warning (USR1, {job.grace_s} s before the time limit or at preemption) or a SIGTERM: pass it on to every
# task through srun; each saves at its next step boundary and exits 75 (never inside the signal handler).
step=""
forward() {{
  echo "plait: SIG$1 from SLURM: every rank saves at the next step boundary" >&2
  if [ -n "$step" ]; then kill "-$1" "$step" 2>/dev/null; fi
}}
trap 'forward USR1' USR1
trap 'forward TERM' TERM

# This job: an array task by its array id and index (the array's own id names every task of it).
JOB="${{SLURM_ARRAY_JOB_ID:+${{SLURM_ARRAY_JOB_ID}}_${{SLURM_ARRAY_TASK_ID}}}}"
JOB="${{JOB:-$SLURM_JOB_ID}}"
requeue() {{  # here, in the batch script: outside any container the tasks run in, where scontrol is
  if scontrol show job "$JOB" 2>/dev/null | grep -q "JobState=CANCELLED"; then
    echo "plait: cancelled; saved in $RUN_DIR (not requeued)." \
      "Continue with: PLAIT_RUN_DIR=$RUN_DIR sbatch <this file>" >&2
    exit 75
  fi
  echo "plait: preempted; saved in $RUN_DIR; requeueing job $JOB to resume from it" >&2
  if ! scontrol requeue "$JOB"; then
    echo "plait: scontrol requeue failed; continue with: PLAIT_RUN_DIR=$RUN_DIR sbatch <this file>" >&2
  fi
  exit 75
}}

attempt=0
while true; do
  if [ -e "$RUN_DIR/checkpoints/latest" ]; then
    set -- --resume "$RUN_DIR"
  else
    set -- {new_run}
  fi
  rm -f "$RUN_DIR/preempted.json"  # rank 0 writes it once every rank saved after a warning
  {" ".join(srun)} "$PYTHON" -m plait.cli train "$@" &
  step=$!
  status=0
  wait "$step" || status=$?
  while [ "$status" -gt 128 ] && kill -0 "$step" 2>/dev/null; do  # a trapped signal ended the wait, not the step
    status=0
    wait "$step" || status=$?
  done
  step=""
  if [ "$status" -eq 0 ]; then
    echo "plait: done; report: $PYTHON -m plait.cli report $RUN_DIR"
    exit 0
  fi
  if [ "$status" -eq 2 ]; then  # a configuration error: running it again would fail the same way
    exit 2
  fi
  # Every rank saved after the warning: continue in a new allocation. The marker counts when the exit status does
  # not say so: --kill-on-bad-exit ends the last tasks while they leave, once rank 0 has exited 75.
  if [ "$status" -eq 75 ] || [ -e "$RUN_DIR/preempted.json" ]; then
    requeue
  fi
  attempt=$((attempt + 1))
  if [ "$attempt" -gt "$MAX_RESTARTS" ]; then
    echo "plait: the run failed (exit $status) after $MAX_RESTARTS restart(s); errors in $RUN_DIR/errors" >&2
    exit "$status"
  fi
  echo "plait: the run failed (exit $status); restart $attempt of $MAX_RESTARTS from the newest checkpoint" >&2
done
"""
