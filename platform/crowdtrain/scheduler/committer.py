"""Full steps written by a process of their own, not by the busy site process whose report filled them.

A step's write is a few statements over arrays, quick in a quiet process but several
times slower in a busy site process, whose threads take turns on one interpreter lock
with the event loop and the other scheduler calls; and the step after next waits for
it (figures in docs/performance.md, "Committer"). So where a committer runs (``manage.py
run_committer``, one or more, beside the site processes), the done report that
fills a step only queues it: the script that counts the report claims the step
and pushes ``campaign:step`` onto a Redis list, and a committer pops it, takes
the step's leases (``take.lua``, which renews the claim), writes it, tells the
aggregators and wakes the requests waiting for room. Only steps of at least
``CROWDTRAIN_COMMITTER_MIN_LEASES`` go (``handoff_args`` says why).

Nothing depends on a committer. Each one renews its entry in a sorted set of
committers (``HotState.committer_key``) every second, and a site process hands
steps over only while an entry is less than ``ALIVE_S`` old; without one (the
embedded default, a deployment that runs none, a committer that stopped) the
reporting thread writes the step itself, as before. A step handed to a
committer that dies before writing it is taken over when its claim lapses
(``COMMIT_CLAIM_S`` in the scripts), or at once when the committer that
took it, or every committer for a step still queued, has stopped renewing
its entry (``alive_since``): by the next report, or by a site process's
sweep. Two writers of one step are harmless: the step row's unique
index lets one win, and the other reads its result back (``commits``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
import socket
import threading
import time
from typing import Any

from django.conf import settings

from . import seam
from .commits import Commit, commit_full_steps
from .configs import campaign_config
from .hotrecords import full_step
from .hotstate import HotStateMissing, hot_state

logger = logging.getLogger(__name__)

ALIVE_S = 3.0  # a committer not heard from for this long is taken for gone
RENEW_S = 1.0  # how often a committer says it is alive (its wait for work is as long)
CHECK_S = 1.0  # how long a site process trusts its last look at the committers


class _Committers:
    """A site process's view of whether any committer runs, looked up at most once per ``CHECK_S``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._checked = -CHECK_S
        self._running = False
        self._state: object = None  # the hot state looked at: a new one (tests, a reset) is looked at again

    def running(self) -> bool:
        state = hot_state()
        now = time.monotonic()
        with self._lock:
            if now - self._checked < CHECK_S and self._state is state:
                return self._running
            self._checked, self._state = now, state
        try:
            running = bool(state.client.zrangebyscore(state.committer_key, state.clock() - ALIVE_S, "+inf", 0, 1))
        except Exception:  # Redis is away: the scheduler's own calls fail too, and say so
            logger.debug("could not look for committers", exc_info=True)
            running = False
        with self._lock:
            self._running = running
        return running


committers = _Committers()


def alive_since() -> float:
    """The hot state's time before which a committer's last word means it is gone.

    The scripts that may claim a full step take it as ``alive_since``: a step
    queued while no committer is left, or taken by one that stopped renewing
    its entry, is taken over at once rather than after ``COMMIT_CLAIM_S``.
    """
    return hot_state().clock() - ALIVE_S


def handoff_args(campaign_id: int) -> dict[str, float]:
    """The done script's arguments for handing a full step over: the campaign's id while a committer runs
    (else 0), the fewest leases a step must have to go (``CROWDTRAIN_COMMITTER_MIN_LEASES``), and
    ``alive_since``.

    Small steps stay with the site: the site that writes a step itself answers the reporting device's
    waiting request at once, which a committer cannot, and a small step's write is short. The scale
    bench's figures behind the threshold are in docs/performance.md ("Committer").
    """
    return {
        "handoff": campaign_id if committers.running() else 0,
        "handoff_least": settings.CROWDTRAIN_COMMITTER_MIN_LEASES,
        "alive_since": alive_since(),
    }


def parse_entry(text: str) -> tuple[int, int] | None:
    """``(campaign id, step)`` of a queue entry, or None for one this code did not write."""
    campaign, _, step = text.partition(":")
    if not all(part.isascii() and part.isdigit() for part in (campaign, step)):
        return None
    return int(campaign), int(step)


class Committer:
    """One committer process's work: wait for full steps, write them, tell the aggregators and the waiting.

    Args:
        name: this committer's entry among the running ones (host and process id by default).
    """

    def __init__(self, name: str | None = None) -> None:
        self.name = name or f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self.stopping = False
        self.committed = 0

    def announce(self) -> None:
        """Say this committer is alive (sites hand it steps for the next ``ALIVE_S``)."""
        state = hot_state()
        now = state.clock()
        with state.client.pipeline(transaction=False) as pipe:
            pipe.zadd(state.committer_key, {self.name: now})
            pipe.zremrangebyscore(state.committer_key, "-inf", now - 10 * ALIVE_S)  # long-gone ones
            pipe.execute()

    def withdraw(self) -> None:
        """Stop being handed steps; the sites write them themselves once they look again (``CHECK_S``)."""
        state = hot_state()
        state.client.zrem(state.committer_key, self.name)

    def next_entry(self, wait_s: float = RENEW_S) -> tuple[int, int] | None:
        """Wait up to ``wait_s`` for a full step; None if none came. ``serve`` keeps the entry renewed meanwhile."""
        state = hot_state()
        popped = state.client.blpop([state.commits_key], timeout=wait_s)
        if not popped:
            return None
        entry = parse_entry(str(popped[1]))
        if entry is None:
            logger.warning("ignoring a commit queue entry this site did not write: %.100r", popped[1])
        return entry

    def commit(self, campaign_id: int, step: int) -> list[Commit]:
        """Write the step if it is still the open one and full, and every step after it that is full already."""
        config = campaign_config(campaign_id)
        if config is None:
            return []
        try:
            answer = hot_state().run("take", config.hot_key, {"step": step, "name": self.name})
        except HotStateMissing:
            # Redis lost the campaign: the next call of the scheduler rebuilds it from the record, and the
            # step, still uncommitted there, fills again from its accepted leases and is claimed anew.
            logger.info("campaign %s: step %s was queued but the campaign's hot state is gone", campaign_id, step)
            return []
        if not answer.get("commit"):
            return []  # written meanwhile by a process that took over the claim
        commits = commit_full_steps(config, full_step(answer["commit"]))
        seam.publisher().publish_commits(commits)
        self.committed += len(commits)
        return commits

    async def serve(self) -> None:
        """Commit queued steps until ``stopping``; each one's aggregators and waiting requests hear of it here.

        The calls run in threads (``offloop``), which check their database connections now and then.
        """
        from crowdtrain.lib.offloop import offloop

        send_commits = seam.publisher().send_commits
        logger.info("committer %s: waiting for full steps", self.name)
        renewing = asyncio.create_task(self._keep_announcing())
        try:
            while not self.stopping:
                try:
                    entry = await offloop(self.next_entry)()
                    if entry is not None:
                        await send_commits(await offloop(self.commit)(*entry))
                except Exception:  # a database or Redis outage: the claim lapses and a site takes the step over
                    logger.exception("committer %s: a step could not be committed; carrying on", self.name)
                    await asyncio.sleep(RENEW_S)
        finally:
            renewing.cancel()
            try:
                await offloop(self.withdraw)()
            except Exception:
                logger.warning("committer %s: could not withdraw; it lapses in %s s", self.name, ALIVE_S)
        logger.info("committer %s: stopped after %s steps", self.name, self.committed)

    async def _keep_announcing(self) -> None:
        """Say this committer is alive now and every ``RENEW_S``, while it waits and while it writes a step.

        Its own task, not a step of the loop: a step whose write outlasts ``ALIVE_S``
        (thousands of leases on a busy database) would otherwise look abandoned,
        and a site would write it again.
        """
        from crowdtrain.lib.offloop import offloop

        while True:
            try:
                await offloop(self.announce)()
            except Exception:  # Redis is away: next_entry says so
                logger.debug("committer %s: could not renew its entry", self.name, exc_info=True)
            await asyncio.sleep(RENEW_S)

    def run(self) -> None:
        """Serve until SIGTERM or SIGINT; the step being written is finished first."""

        def stop(*_: Any) -> None:
            self.stopping = True

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        asyncio.run(self.serve())
