"""Parameter server: ``parallel.mode = "ps"``.

The last ``ps.servers`` ranks serve, the others are workers. Each server holds a size-balanced slice
of all parameters (``shard``) and runs the optimizer on it (``state``: versions, per-worker clocks and
the consistency modes sync, async, ssp, backup and dc); workers push gradients and pull parameters
over c10d point-to-point messages on a gloo group of their own (``protocol``, ``server``, ``worker``).
``ParameterServer`` (``strategy``) plugs it into ``plait.Plait``: the user's loop, the Trainer and
``plait train`` run unchanged on the workers, while ``Plait.setup`` on a server rank serves until
every worker has finished and then ends the process (``ServerDone``, exit status 0).
"""

from plait.ps.protocol import PsError
from plait.ps.roles import ServerDone, check_ps
from plait.ps.state import ShardState, dc_compensate

__all__ = ["PsError", "ServerDone", "ShardState", "check_ps", "dc_compensate"]
