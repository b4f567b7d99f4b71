"""verify's parallel reading on its own: results in order, at most 2 x jobs in flight."""

import threading
import time

from hs_capture.offline.verify.pool import bounded_map, pick


def test_results_come_in_order_and_the_window_is_bounded():
    lock, live, peak = threading.Lock(), [0], [0]
    started = []

    def work(i):
        with lock:
            live[0] += 1
            started.append(i)
        time.sleep(0.002 * (i % 3))
        with lock:
            live[0] -= 1
        return i * i

    seen = []
    consumed = []
    for r in bounded_map(work, list(range(40)), 3, lambda d, t: seen.append((d, t))):
        consumed.append(r)
        with lock:
            peak[0] = max(peak[0], len(started) - len(consumed))  # submitted but not yet handed out
    assert consumed == [i * i for i in range(40)]
    assert seen[-1] == (40, 40) and [d for d, _ in seen] == list(range(1, 41))
    assert peak[0] <= 2 * 3
    assert list(bounded_map(work, [], 2)) == []


def test_pick_is_all_or_a_reproducible_sample():
    items = list(range(100))
    assert pick(items, None, 0) == items and pick(items, 500, 0) == items
    a, b = pick(items, 7, 1), pick(items, 7, 1)
    assert a == b and len(set(a)) == 7 and pick(items, 7, 2) != a
