"""The oracle bound (loadtests/oracle_bound.py) on hand-checked demand: a policy told each
bucket's arrival count holds the bucket's mean rate, which misses a burst inside the bucket;
the headroom found keeps the share; the optimum at a coarser resolution costs more."""

from __future__ import annotations

import numpy as np
import pytest

from fleet.tracesim.hindsight import Demand, schedule_of
from loadtests.oracle_bound import bound, rate_oracle


def demand(*arrivals: float) -> Demand:
    """Intervals of 10 s; one replica serves 10 requests of an interval within the SLO."""
    return Demand(10.0, np.full(len(arrivals), 10.0), np.array(arrivals, dtype=float), 1.0)


def test_the_rate_oracle_holds_each_buckets_mean_rate_through_the_bucket() -> None:
    d = demand(*[10] * 6, 0, 40, 0, *[10] * 6)           # a burst of 4 replicas' worth inside one bucket of 3
    reps = rate_oracle(d, block=3, headroom=1.0, low=1, startup_s=20.0, drain_s=0.0)
    assert list(reps[6:9]) == [2, 2, 2]                  # 40 over 3 intervals' 30: the mean needs 2
    assert list(reps[:6]) == [1] * 6 and list(reps[9:]) == [1] * 6
    assert schedule_of(d, reps, 20.0).missed == pytest.approx(20)   # the burst's interval gets 2 of 4


def test_the_headroom_found_keeps_the_share_and_the_coarse_optimum_costs_more() -> None:
    d = demand(*[10] * 6, 0, 40, 0, *[10] * 6)
    row = bound(d, startup_s=20.0, drain_s=0.0, low=1, share=0.99, resolution_s=30.0)
    assert row.mean_rate.within_share < 0.99 <= row.kept.within_share
    # One headroom for every bucket: 40 arrivals in 30 s need h x 40 / 30 > 3, so h just above 2.25,
    # and the quiet buckets then hold ceil(2.25) = 3.
    assert 2.25 < row.headroom <= 2.26 and list(row.kept.replicas[6:9]) == [4, 4, 4]
    assert row.kept.replicas[0] == 3
    fine = bound(d, startup_s=20.0, drain_s=0.0, low=1, share=0.99, resolution_s=10.0)
    assert fine.blocked.replica_s < row.blocked.replica_s     # the burst's 4 for one interval, not three
    assert fine.headroom == 1.0 and fine.kept.missed == 0
