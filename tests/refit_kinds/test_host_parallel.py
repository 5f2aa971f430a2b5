"""Host work split over threads (:mod:`ckpt_core._internal.parallel`): units claimed one at a
time go to whichever part is free, each exactly once."""

from __future__ import annotations

import threading
import time

from ckpt_core._internal.parallel import Claims, run_parts


def test_claims_hand_each_number_out_once_in_ascending_order_across_threads() -> None:
    claims = Claims(20_000)
    taken: list[list[int]] = [[] for _ in range(4)]
    start = threading.Barrier(4)

    def claim(index: int) -> None:
        start.wait(timeout=30)
        taken[index].extend(claims)

    threads = [threading.Thread(target=claim, args=(index,)) for index in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sorted(number for numbers in taken for number in numbers) == list(range(20_000))
    assert all(numbers == sorted(numbers) for numbers in taken)
    assert list(claims) == []  # spent: no number is handed out twice


def test_a_slow_part_takes_fewer_units_than_a_fast_one() -> None:
    """A part held up on each unit (here, 20 ms of sleep) leaves the rest to the part that is
    not, where a fixed split would give each half."""
    claims = Claims(40)

    def part(index: int) -> list[int]:
        done = []
        for number in claims:
            done.append(number)
            if index == 0:
                time.sleep(0.02)
        return done

    slow, fast = run_parts(part, 2)
    assert sorted(slow + fast) == list(range(40))
    assert len(fast) > len(slow)
