import random
from datetime import timedelta

from core.backoff import backoff_delay


def test_each_try_waits_twice_the_last_up_to_the_cap_within_its_jitter():
    rng = random.Random(7)
    delays = [
        backoff_delay(tries, base_seconds=30, cap_seconds=300, jitter=(0.5, 1.0), rng=rng)
        for tries in range(1, 8)
    ]
    ceilings = [30, 60, 120, 240, 300, 300, 300]
    for delay, ceiling in zip(delays, ceilings, strict=True):
        assert timedelta(seconds=ceiling * 0.5) <= delay <= timedelta(seconds=ceiling)


def test_without_jitter_the_schedule_is_exact_and_a_zeroth_try_waits_the_base():
    exact = [
        backoff_delay(tries, base_seconds=2, cap_seconds=300, jitter=(1.0, 1.0))
        for tries in (0, 1, 2, 3, 9)
    ]
    assert [d.total_seconds() for d in exact] == [2, 2, 4, 8, 300]
