"""Each all-reduce algorithm equals ``dist.all_reduce`` on 2, 3 and 4 gloo ranks.

One spawn per world size runs every algorithm on every case (spawning dominates the runtime).
Tolerances: integer-valued fp32 inputs must match bitwise (every partial sum is exact); random
fp32 inputs may differ by summation order, bounded by ``n * eps32 * sum|x|`` (checked as
rtol=atol=1e-5 for these magnitudes); bf16 inputs are summed in fp32 and rounded once, so they
must equal the fp32 sum of the bf16 inputs rounded to bf16 within 1 bf16 ulp (rtol 2**-7).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers import run_ranks

from plait.comm.algorithms import AllReduceConfigError, get_allreduce, node_ids_for_ranks

# Large enough that a ring segment exceeds the 1 MiB chunk target, so pipelining is exercised.
_CHUNKED = 2 * 262_144 * 4 + 5
_NODES = {2: {"ranks_per_node": 1}, 3: {"node_ids": [0, 0, 1]}, 4: {"ranks_per_node": 2}}


def _inputs(numel: int, n: int, kind: str, case: int) -> list[torch.Tensor]:
    """Every rank's input for one case, generated identically on all ranks."""
    out = []
    for r in range(n):
        g = torch.Generator().manual_seed(1000 * case + r)
        if kind == "int":
            out.append(torch.randint(-1000, 1000, (numel,), generator=g).float())
        elif kind == "float":
            out.append(torch.randn(numel, generator=g))
        else:
            out.append(torch.randn(numel, generator=g).to(torch.bfloat16))
    return out


def _mismatch(got: torch.Tensor, want: torch.Tensor, kind: str) -> str | None:
    if kind == "int":
        return None if torch.equal(got, want) else f"max err {(got - want).abs().max()}"
    tol = {"float": 1e-5, "bf16": 2**-7}[kind]
    try:
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    except AssertionError as e:
        return str(e).splitlines()[-1]
    return None


def _all_cases(rank: int, n: int) -> list[str]:
    algos = {name: get_allreduce(name, **(_NODES[n] if name == "hierarchical" else {}))
             for name in ("ring", "halving_doubling", "hierarchical")}
    sizes = [0, 1, n - 1, n + 1, 1001, _CHUNKED]
    failures = []
    case = 0
    for numel in sizes:
        for kind in ("int", "float", "bf16"):
            if numel == _CHUNKED and kind == "bf16":
                continue
            case += 1
            xs = _inputs(numel, n, kind, case)
            ref = xs[rank].clone()
            dist.all_reduce(ref)
            exact = torch.stack([x.float() for x in xs]).sum(0).to(xs[0].dtype) if numel else ref
            for name, fn in algos.items():
                got = xs[rank].clone()
                fn(got, None)
                for what, want in (("backend", ref), ("exact", exact)):
                    err = _mismatch(got, want, kind)
                    if err:
                        failures.append(f"{name} numel={numel} {kind} vs {what}: {err}")
    # A non-contiguous input (a transposed view) is reduced into place.
    base = torch.arange(12.0).reshape(3, 4) * (rank + 1)
    for name, fn in algos.items():
        view = base.clone().t()
        fn(view, None)
        if not torch.equal(view, torch.arange(12.0).reshape(3, 4).t() * (n * (n + 1) // 2)):
            failures.append(f"{name} non-contiguous input")
    if n == 4:
        failures += _on_subgroup(rank)
    return failures


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_algorithms_equal_backend_all_reduce(world_size: int) -> None:
    # World size 4 also checks a 3-rank subgroup of ranks {1, 2, 3}.
    results = run_ranks(_all_cases, world_size)
    assert results == [[] for _ in range(world_size)], results


def _on_subgroup(rank: int) -> list[str]:
    """On the group of global ranks {1, 2, 3}, group ranks must be translated to global ones."""
    sub = dist.new_group([1, 2, 3])  # every rank of the job takes part in creating a group
    if rank == 0:
        return []
    failures = []
    for name, kw in (("ring", {}), ("halving_doubling", {}), ("hierarchical", {"node_ids": [0, 1, 1]})):
        t = torch.full((5,), float(rank))
        get_allreduce(name, **kw)(t, sub)
        if not torch.equal(t, torch.full((5,), 6.0)):
            failures.append(f"{name} on a subgroup gave {t.tolist()}")
    return failures


def test_unknown_algorithm_and_missing_layout_are_clear_errors() -> None:
    with pytest.raises(AllReduceConfigError, match="choose one of backend, ring"):
        get_allreduce("tree")
    with pytest.raises(AllReduceConfigError, match="needs the node layout"):
        get_allreduce("hierarchical")
    assert issubclass(AllReduceConfigError, ValueError)


def test_node_ids_for_a_strided_group() -> None:
    # A data-parallel group of global ranks 1, 3, 5, 7 on hosts of 4 ranks: two per host.
    assert node_ids_for_ranks([1, 3, 5, 7], 4) == [0, 0, 1, 1]
    with pytest.raises(AllReduceConfigError, match="at least 1"):
        node_ids_for_ranks([0], 0)
