"""The layout's contract with the engine stays small (DESIGN.md: about 20 methods; optional capabilities are small
protocols).

``CONTRACT_*`` below is everything the engine may call on a layout (``plait.parallel.layout.LayoutContract``) and
``STATE`` everything checkpoints and weight I/O call on its ``state`` (``plait.checkpoint.layout_state``). Each test
fails when ``Layout``, the parameter server's ``ParameterServer`` or their state classes grow a public member
beyond these lists, when the protocols and the classes drift apart, or when the engine's source reads a layout member
outside the contract (or leaves one unread).
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Any

from torch import nn

import plait
from plait.checkpoint.layout_state import LayoutState, StateContract
from plait.parallel.capabilities import CheckpointJoin, OwnPace, Serving
from plait.parallel.layout import Layout, LayoutContract
from plait.ps.layout import ParameterServer
from plait.ps.layout_state import PsState

CONTRACT_METHODS = {
    "capability",                                                   # optional capabilities
    "build_optimizer", "scheduler_target", "wrap_forward", "begin",  # setup
    "set_sync", "backward", "forward_backward",                     # a micro-step
    "evaluate", "evaluation", "reduce_loss",                        # evaluation, the loss every rank agrees on
    "finish", "clip_and_step", "nonfinite_skip", "after_step", "zero_grad", "step_metrics",  # an optimizer step
    "describe", "report", "close",                                  # reports, the end
}
CONTRACT_PROPERTIES = {"model", "optimizer", "optimizers", "torch_collectives", "reduce_loss_every_step"}
CONTRACT_ATTRIBUTES = {"topo", "state", "setup_memory"}  # set on the instance
CONTRACT = CONTRACT_METHODS | CONTRACT_PROPERTIES | CONTRACT_ATTRIBUTES
# what the layout's drivers (DiLoCo, replica groups), its state and tests read: not the engine's
FOR_PARTS = {"composition", "named_parameters", "trainable", "grads"}
PARTS = {"stages", "policy", "experts", "split", "drivers", "cfg", "comm", "facts", "precision"}
STATE = {"state_dicts", "load_state_dicts", "save_planner", "load_planner", "finish_load", "model_entries", "retie",
         "prepare_weights", "export_weights", "full_model_state"}
PS_OWN = {"server_stats"}  # read by tests and rank 0's report
ENGINE = Path(__file__).resolve().parents[2] / "src" / "plait"


def _public(cls: type) -> set[str]:
    return {name for name in dir(cls) if not name.startswith("_")}


def _declared(protocol: type) -> set[str]:
    """The members a protocol's own body declares (methods, properties, annotated attributes)."""
    names = set(vars(protocol)) | set(getattr(protocol, "__annotations__", {}))
    return {name for name in names if not name.startswith("_")}


def test_the_contract_is_about_twenty_methods_and_layout_has_nothing_more() -> None:
    assert len(CONTRACT_METHODS) <= 20
    assert _declared(LayoutContract) == CONTRACT
    assert _public(Layout) == CONTRACT_METHODS | CONTRACT_PROPERTIES | FOR_PARTS
    for name in CONTRACT_PROPERTIES:
        assert isinstance(inspect.getattr_static(Layout, name), property), name


def test_the_parameter_server_implements_the_same_contract_plus_its_capabilities() -> None:
    capabilities = (Serving, OwnPace, CheckpointJoin)
    for protocol in capabilities:
        assert issubclass(ParameterServer, protocol), protocol.__name__
    extra = _public(ParameterServer) - _public(Layout)
    assert extra <= set().union(*(_declared(p) for p in capabilities)) | PS_OWN, extra
    assert _public(ParameterServer) >= CONTRACT_METHODS | CONTRACT_PROPERTIES


def test_the_state_objects_implement_one_small_protocol() -> None:
    assert _declared(StateContract) == STATE
    for cls in (LayoutState, PsState):
        assert _public(cls) == STATE, cls.__name__
        assert issubclass(cls, StateContract), cls.__name__


def test_a_composed_layout_is_the_contract_with_its_parts(tmp_path: Path) -> None:
    p = plait.Plait(run={"dir": str(tmp_path)}, train={"global_batch_size": 2, "micro_batch_size": 2},
                    observe={"progress": False, "trackers": []})
    model, _ = p.setup(nn.Linear(4, 2))
    layout = p.layout
    assert isinstance(layout, LayoutContract) and isinstance(layout.state, StateContract)
    assert {name for name in vars(layout) if not name.startswith("_")} == PARTS | CONTRACT_ATTRIBUTES
    model_sd, _ = layout.state.state_dicts()
    assert set(model_sd) == set(model.state_dict())
    p.close()


def _layout_uses(tree: ast.AST) -> set[str]:
    """Members read on a layout in the engine's code: ``layout.X``, ``strategy.X``, ``self.layout.X``,
    ``self.strategy.X``, ``self._require_strategy().X``."""

    def is_layout(node: Any) -> bool:
        if isinstance(node, ast.Name):
            return node.id in ("layout", "strategy")
        if isinstance(node, ast.Attribute):
            return node.attr in ("layout", "strategy")
        return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
            and node.func.attr == "_require_strategy"
    return {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute) and is_layout(node.value)}


def test_the_engine_calls_only_the_contract() -> None:
    files = [*(ENGINE / "engine").glob("*.py"), *(ENGINE / "train").glob("*.py"),
             ENGINE / "checkpoint" / "checkpointer.py", ENGINE / "checkpoint" / "export.py"]
    used = set().union(*(_layout_uses(ast.parse(f.read_text())) for f in files))
    assert used, "found no layout member read in the engine: the pattern is out of date"
    assert used <= CONTRACT, f"the engine reads layout members outside the contract: {sorted(used - CONTRACT)}"
    assert used == CONTRACT, f"contract members no engine code reads (drop them): {sorted(CONTRACT - used)}"
