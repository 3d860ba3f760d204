"""Overload slows new work and never destroys work already done.

A site process counts what it has in hand: sockets, handshakes still
authenticating, and scheduler calls in flight. Past its limits it turns away
*new* work only: a new socket is closed with 4013 (try again later) before
any database lookup, and a lease request is answered at once with a refusal
whose ``retry_after_s`` grows with the load. Done reports and releases are
never turned away: they carry work already uploaded, and they are what frees
the site.
"""

from __future__ import annotations

from dataclasses import dataclass

from django.conf import settings

# A refusal never asks an agent to wait longer than this, however busy the site.
MAX_RETRY_AFTER_S = 60.0
LAG_AT_FULL_LOAD_S = 0.5


@dataclass
class Admission:
    """One process's load and the decisions that follow from it."""

    sockets: int = 0
    handshakes: int = 0  # accepted sockets whose token is still being checked
    lease_calls: int = 0  # lease requests in the scheduler right now
    loop_lag_s: float = 0.0  # how late the event loop ran the last housekeeping round

    def admit_socket(self) -> bool:
        """Whether a new socket may go on to authentication (counted from here until ``socket_closed``)."""
        if self.handshakes >= settings.CROWDTRAIN_MAX_HANDSHAKES or self.sockets >= settings.CROWDTRAIN_MAX_SOCKETS:
            return False
        self.sockets += 1
        self.handshakes += 1
        return True

    def handshake_done(self) -> None:
        self.handshakes = max(0, self.handshakes - 1)

    def socket_closed(self) -> None:
        self.sockets = max(0, self.sockets - 1)

    def admit_lease_request(self) -> bool:
        return self.lease_calls < settings.CROWDTRAIN_MAX_LEASE_CALLS

    @property
    def load(self) -> float:
        """0 when idle, 1 at the limit of lease calls in flight or with the event loop half a second behind."""
        return max(self.lease_calls / max(1, settings.CROWDTRAIN_MAX_LEASE_CALLS), self.loop_lag_s / LAG_AT_FULL_LOAD_S)

    def retry_after(self, base_s: float) -> float:
        """``base_s`` stretched by the load: a busy site spreads its volunteers' next requests out."""
        return min(MAX_RETRY_AFTER_S, base_s * (1.0 + 4.0 * self.load))


admission = Admission()
