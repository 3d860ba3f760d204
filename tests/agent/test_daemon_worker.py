"""The agent's long-lived worker threads: calls run in order on one thread, results and errors come back."""

from __future__ import annotations

import asyncio
import platform
import sys
import threading

import pytest

from crowdtrain_agent.allocator import keep_freed_memory
from crowdtrain_agent.runtime import DaemonWorker


async def test_calls_run_in_order_on_one_daemon_thread() -> None:
    worker = DaemonWorker("test-worker")
    seen: list[tuple[int, threading.Thread]] = []

    def record(i: int) -> int:
        seen.append((i, threading.current_thread()))
        return i * i

    results = await asyncio.gather(*(worker.run(record, i) for i in range(5)))
    worker.close()

    assert results == [0, 1, 4, 9, 16]
    assert [i for i, _ in seen] == [0, 1, 2, 3, 4]
    threads = {thread for _, thread in seen}
    assert len(threads) == 1 and threads.pop().daemon
    assert all(thread is not threading.main_thread() for _, thread in seen)


async def test_an_error_reaches_the_caller_and_the_worker_goes_on() -> None:
    worker = DaemonWorker("test-worker")

    def fail() -> None:
        raise ValueError("bad lease")

    with pytest.raises(ValueError, match="bad lease"):
        await worker.run(fail)
    after = await worker.run(lambda: "still working")
    worker.close()

    assert after == "still working"


async def test_a_closed_worker_lets_its_thread_end() -> None:
    worker = DaemonWorker("test-worker-closing")
    thread = await worker.run(threading.current_thread)

    worker.close()
    thread.join(timeout=5)

    assert not thread.is_alive()


def test_malloc_keeps_freed_buffers_where_glibc_can_be_told_to() -> None:
    glibc = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"

    assert keep_freed_memory() is glibc


async def test_a_posted_call_runs_on_the_worker_after_those_queued_before_it() -> None:
    worker = DaemonWorker("test-worker")
    order: list[str] = []
    posted_ran = threading.Event()

    first = asyncio.ensure_future(worker.run(lambda: order.append("awaited")))
    await asyncio.sleep(0)  # lets the awaited call reach the queue first
    worker.post(lambda: (order.append("posted"), posted_ran.set()))
    await first
    ran = await asyncio.to_thread(posted_ran.wait, 5)
    worker.close()

    assert ran and order == ["awaited", "posted"]
