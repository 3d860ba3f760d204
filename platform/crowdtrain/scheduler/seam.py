"""What the scheduler core asks of the services above it, which it never imports.

The core (hot state, leasing, commits) sits below verification, credit and the
gateway: they build on its leases and steps. Yet a lease may be a verification
copy, a volunteer's standing bounds what they are leased, a committed step
grants credit and must reach the aggregators. Each of those services installs
its part here when its app is ready (``AppConfig.ready``); the core calls it
through this seam with plain data (ids, the campaign's ``CampaignConfig``, lease
records, protocol messages). So the imports point one way, and a reader of
the lease path meets four named doors instead of four other apps.

A part that is not installed is a set-up error, not a silent no-op: every
process that runs the scheduler runs ``django.setup()``, which installs them all.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol, cast

if TYPE_CHECKING:
    from crowdtrain_agent.protocol import Lease as LeaseMessage
    from crowdtrain_agent.protocol import LeaseDone

    from .commits import Commit
    from .configs import CampaignConfig
    from .hotrecords import LeaseRecord


class Verification(Protocol):
    """Verification copies on the lease path (``crowdtrain.verification.checks``)."""

    def take_copy(self, config: CampaignConfig, device_id: int) -> LeaseMessage | None: ...
    def is_copy_marker(self, text: str) -> bool: ...
    def maybe_pick(self, config: CampaignConfig, device_id: int, done: LeaseDone, record: LeaseRecord) -> bool: ...
    def copy_done(self, config: CampaignConfig, device_id: int, done: LeaseDone, problem: str, marker: str) -> str: ...
    def copy_released(self, lease_id: int, reason: str, *, device_id: int | None = None, marker: str = "") -> None: ...
    def creditable(self, leases: list[LeaseRecord]) -> list[tuple[int, int, int]]: ...


class Standing(Protocol):
    """Who owns a device and what their record allows (``crowdtrain.verification.standing``)."""

    def owner_of(self, device_id: int) -> int | None: ...
    def probation(self, campaign_cap: int, organizer_id: int, volunteer_id: int | None) -> int: ...
    def refusal(self, volunteer_id: int | None) -> str: ...
    def held(self, volunteer_id: int | None) -> str: ...


class Credit(Protocol):
    """The ledger (``crowdtrain.credit.ledger``): committed work is granted, rolled-back work taken back."""

    def grant(
        self,
        campaign_id: int,
        flops_per_sample: float,
        leases: Sequence[tuple[int, int, int]],
        when: datetime | None = None,
    ) -> None: ...
    def reverse(self, lease_ids: Iterable[int], reason: str, when: datetime | None = None) -> None: ...


class Publisher(Protocol):
    """The sockets (``crowdtrain.gateway.outbox``): aggregators hear of commits, waiting requests of room."""

    def publish_commits(self, commits: Iterable[Commit]) -> None: ...
    async def send_commits(self, commits: Iterable[Commit]) -> None: ...
    async def wake(self, campaign_id: int, channels: Iterable[str], *, copy: bool = False) -> None: ...


class SeamMissing(RuntimeError):
    """A service the scheduler calls was never installed: its app is missing from INSTALLED_APPS."""


_parts: dict[str, Any] = {}


def install(*, verification: Verification | None = None, standing: Standing | None = None,
            credit: Credit | None = None, publisher: Publisher | None = None) -> None:  # fmt: skip
    """Called by each service's ``AppConfig.ready`` with its part (a module that has the functions will do)."""
    given = {"verification": verification, "standing": standing, "credit": credit, "publisher": publisher}
    _parts.update({name: part for name, part in given.items() if part is not None})


def _part(name: str, app: str) -> Any:
    try:
        return _parts[name]
    except KeyError:
        raise SeamMissing(
            f"the scheduler needs {app} ({name}), which no app installed: add {app} to INSTALLED_APPS"
        ) from None


def verification() -> Verification:
    return cast(Verification, _part("verification", "crowdtrain.verification"))


def standing() -> Standing:
    return cast(Standing, _part("standing", "crowdtrain.verification"))


def credit() -> Credit:
    return cast(Credit, _part("credit", "crowdtrain.credit"))


def publisher() -> Publisher:
    return cast(Publisher, _part("publisher", "crowdtrain.gateway"))
