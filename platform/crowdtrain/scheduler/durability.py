"""How much committed work a crash could cost a campaign now, and the bound the site keeps it under.

A version is *complete* when every slice confirmed a checkpoint of it in the
aggregators' shared storage; a crash goes back to the newest one, so the steps
committed since are what it costs. Checkpoints that fail (storage down, disk
full) let that grow without anyone noticing, so past
``CROWDTRAIN_CHECKPOINT_LAG_MAX`` checkpoint intervals the campaign stops:
no step at or past ``newest complete + bound`` commits and no lease is given
for one (volunteers hear why), until a checkpoint completes and training goes on
by itself. Work already done is kept: reports of leases in flight are counted,
and their step commits once it may.
"""

from __future__ import annotations

from dataclasses import dataclass

from django.conf import settings
from django.db.models import Count

from crowdtrain.campaigns.models import Campaign

from .models import Checkpoint


def complete_versions(campaign: Campaign) -> list[int]:
    """Versions, ascending, that every slice of the campaign has a confirmed checkpoint of, on its timeline."""
    rows = (
        Checkpoint.objects.filter(campaign=campaign, version__lte=campaign.committed_steps)
        .values("version")
        .annotate(slices=Count("slice_index", distinct=True))
        .filter(slices__gte=campaign.num_aggregators)
        .order_by("version")
    )
    return [row["version"] for row in rows]


@dataclass(frozen=True)
class Durability:
    """Where a campaign's checkpoints stand against its committed steps."""

    newest_complete: int  # 0 (the seeded init, which every slice can rebuild) while none is
    lag: int  # committed steps a crash of any aggregator would cost now
    hold: int  # the first step that may not commit (-1: no bound)
    usual: int  # the most lag of a campaign whose checkpoints keep up: one interval plus the pipeline's own

    @property
    def holding(self) -> bool:
        return self.hold >= 0 and self.lag >= self.hold - self.newest_complete

    @property
    def late(self) -> bool:
        """A checkpoint interval was missed (or the campaign is held)."""
        return self.lag > self.usual or self.holding

    def why(self, campaign_id: int) -> str:
        """What volunteers and the organizer read while the campaign waits for its checkpoints."""
        return (
            f"campaign {campaign_id} waits for its checkpoints: the newest complete one is version "
            f"{self.newest_complete}, and no more than {self.hold - self.newest_complete} steps may be committed "
            "past it (what a crash could cost); the aggregators cannot write to their checkpoint storage. "
            "Training goes on by itself once they can"
        )


def durability(campaign: Campaign) -> Durability:
    """The campaign's checkpoint lag and the step it may not commit (two aggregate queries)."""
    complete = complete_versions(campaign)
    newest = complete[-1] if complete else 0
    every, most = campaign.checkpoint_every, settings.CROWDTRAIN_CHECKPOINT_LAG_MAX
    # One interval plus the pipeline's own lag (the staleness window, the step being applied and the one
    # being checkpointed). The bound is never below it: a campaign that checkpoints every step must not wait
    # on every confirmation.
    usual = every + campaign.staleness + 2
    bound = max(most * every, usual) if every > 0 and most > 0 else 0
    hold = newest + bound if bound > 0 else -1
    return Durability(newest_complete=newest, lag=max(0, campaign.committed_steps - newest), hold=hold, usual=usual)


def hold_fields(campaign: Campaign) -> dict[str, object]:
    """The hot state's ``hold`` (the first step that may not commit) and ``hold_why`` (what volunteers hear)."""
    lag = durability(campaign)
    return {"hold": lag.hold, "hold_why": lag.why(campaign.pk)}
