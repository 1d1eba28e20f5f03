"""The gloo multi-process harness: results by rank, and a failing rank's traceback in the error."""

import pytest
import torch
from _harness import MultiprocError, run_multiproc


def _sum_ranks(rank, world, scale):
    t = torch.tensor([float(rank)]) * scale
    torch.distributed.all_reduce(t)
    return {"rank": rank, "sum": t.item()}


def _fail_on_rank1(rank, world):
    if rank == 1:
        raise ValueError("boom on purpose")
    return rank


def test_results_by_rank():
    assert run_multiproc(_sum_ranks, 2, args=(2.0,)) == [{"rank": 0, "sum": 2.0}, {"rank": 1, "sum": 2.0}]


def test_failure_names_rank_and_traceback():
    with pytest.raises(MultiprocError) as e:
        run_multiproc(_fail_on_rank1, 2, timeout_s=60)
    msg = str(e.value)
    assert "rank 1 raised" in msg and "ValueError: boom on purpose" in msg
