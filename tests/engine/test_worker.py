"""`SplitWorker`: a chunk's decode in two parts on two threads keeps the order of the parts, hands
the first part's result to the second, keeps each error with its tag, and a whole call waits
until the second thread is idle."""

from __future__ import annotations

import threading
import time

import pytest

from avatarstream.engine.worker import SplitWorker


def test_parts_run_in_order_on_two_threads_and_overlap():
    w = SplitWorker("test-split")
    log, threads = [], {}

    def front(k: int):  # noqa: ANN202
        threads.setdefault("front", set()).add(threading.current_thread().name)
        log.append(("front", k))
        return k * 10

    def back(k: int):  # noqa: ANN202
        def run(x: int) -> None:
            threads.setdefault("back", set()).add(threading.current_thread().name)
            time.sleep(0.02)  # the next front part runs meanwhile
            log.append(("back", k, x))
        return run

    for k in range(4):
        w.submit_split(lambda k=k: front(k), back(k), tag=k)
    w.wait()
    w.close()
    assert [e for e in log if e[0] == "back"] == [("back", k, 10 * k) for k in range(4)]
    assert [e for e in log if e[0] == "front"] == [("front", k) for k in range(4)]
    assert threads["front"] == {"test-split"} and threads["back"] == {"test-split-back"}
    # front k+1 ran before back k finished: the two parts overlapped
    assert log.index(("front", 1)) < log.index(("back", 0, 0))
    assert w.calls == 4 and w.seconds > 0


def test_errors_keep_their_tag_and_a_failed_front_hands_nothing_on():
    w = SplitWorker("test-split-errors")
    ran = []

    def bad_front():  # noqa: ANN202
        raise ValueError("front broke")

    def bad_back(x):  # noqa: ANN001, ANN202
        raise RuntimeError(f"back broke on {x}")

    w.submit_split(bad_front, lambda x: ran.append(x), tag="a")
    w.submit_split(lambda: 7, bad_back, tag="b")
    w.submit_split(lambda: 8, lambda x: ran.append(x), tag="c")  # later calls still run
    w.wait()
    with pytest.raises(ValueError, match="front broke"):
        w.raise_if_failed()
    got = {(type(e).__name__, tag) for e, tag in w.failures()}
    assert got == {("ValueError", "a"), ("RuntimeError", "b")} and ran == [8]
    w.close()


def test_a_whole_call_waits_for_the_second_thread():
    w = SplitWorker("test-split-whole")
    log = []
    w.submit_split(lambda: 1, lambda x: (time.sleep(0.05), log.append("back")), tag=1)
    w.submit(lambda: log.append("whole"), tag=2)
    w.wait()
    w.close()
    assert log == ["back", "whole"]
