"""One average for the CLI's ``allreduce`` strategy and SyncReplicas' all-reduce exchange
(``gradfleet.distributed.transport.all_reduce``): the same gradients in, the same averaged
gradients out, and both equal to the rule written out here in float64 -- dense gradients summed
over the N ranks and divided by N (a missing one counts as zeros), each sparse row divided by
the number of ranks whose gradient holds it (TF's ``SparseConditionalAccumulator``). Three gloo
ranks (``run_ranks``, never hanging)."""

from __future__ import annotations

import pytest
import torch

from gradfleet.distributed.testing import run_ranks

from . import mean_rule_ranks as mr

pytestmark = pytest.mark.slow

WORLD = 3


def reference() -> list[torch.Tensor | None]:
    """The rule, from every rank's gradients, parameter by parameter in the model's order."""
    grads = [mr.gradients(r) for r in range(WORLD)]
    out: list[torch.Tensor | None] = []
    for name, shape in mr.SHAPES.items():
        given = [g[name] for g in grads if g[name] is not None]
        if not given:
            out.append(None)
        elif not given[0].is_sparse:
            out.append(sum(given) / WORLD)
        else:
            total = torch.zeros(shape, dtype=torch.float64)
            senders = torch.zeros(shape[0], dtype=torch.float64)
            for g in given:
                rows = g.coalesce().indices()[0]
                total += g.to_dense()
                senders[rows] += 1  # coalesced: each row once per rank
            held = senders.nonzero().reshape(-1)
            values = total[held] / senders[held].unsqueeze(1)
            mean = torch.sparse_coo_tensor(held[None], values, shape, check_invariants=True)
            out.append(mean.coalesce())
    return out


def _same(got: torch.Tensor | None, want: torch.Tensor | None) -> None:
    if want is None:
        assert got is None
        return
    assert got is not None and got.is_sparse == want.is_sparse
    if want.is_sparse:
        assert got.is_coalesced()
        assert torch.equal(got.indices(), want.indices())
        got, want = got.values(), want.values()
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.fixture(scope="module")
def averaged() -> list[dict]:
    return run_ranks(mr.both, WORLD, timeout=120, pg_timeout=30)


@pytest.mark.timeout(180)
def test_cli_allreduce_and_the_exchange_average_alike(averaged):
    want = reference()
    # the data holds rows that only some ranks send: the rule is not "divide by N" there
    senders = torch.zeros(mr.EMB_ROWS)
    for rows in mr.ROWS.values():
        senders[sorted(set(rows))] += 1
    assert senders.tolist() == [1, 2, 3, 0, 0]
    for rank, out in enumerate(averaged):
        assert out["exchange"]["transport"] == "allreduce"
        for path in ("cli", "exchange"):
            assert out[path]["error"] is None, (rank, path, out[path]["error"])
            (seen,) = out[path]["seen"]  # one step, given the averages
            for got, ref in zip(seen, want, strict=True):
                _same(got, ref)


@pytest.mark.timeout(180)
def test_a_variable_dense_on_one_rank_and_sparse_on_another_is_refused_alike(averaged):
    for out in averaged:
        for path, owner in (("cli_mixed", "allreduce"), ("exchange_mixed", "SyncReplicas")):
            error = out[path]["error"]
            assert error is not None and error.startswith(owner), error
            assert "variables [2] got dense gradients on some ranks and sparse" in error
            assert out[path]["seen"] == []  # nothing applied
