"""The credit ledger: append-only, at most one entry of each kind per lease.

Totals are sums over the ledger, never counters updated in place: a grant and its
reversal are both kept, so any total can be recomputed and audited, and a
rollback or a quarantine takes credit back by adding entries, not by editing
history (as a bank ledger does).
"""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone

from crowdtrain.accounts.models import Device, Team
from crowdtrain.campaigns.models import Campaign
from crowdtrain.scheduler.models import Lease
from crowdtrain_agent.credit import FLOPS_PER_CREDIT

__all__ = ["FLOPS_PER_CREDIT", "FORMULA", "CreditEntry"]
FORMULA = (
    "One credit is one billion floating-point operations (a gigaFLOP) of accepted work: the samples of each lease "
    "whose step was committed, times the model's FLOPs per sample (forward and backward pass). It is granted when "
    "the step commits (for a lease picked for verification, once another volunteer's copy agrees with it), and "
    "taken back if that step is rolled back or the volunteer is quarantined."
)


class CreditEntry(models.Model):
    """One lease's credit (a grant), its taking back (a reversal or quarantine: negative amounts), or its return."""

    class Kind(models.TextChoices):
        GRANT = "grant", "granted"
        REVERSAL = "reversal", "reversed"  # the step was rolled back
        QUARANTINE = "quarantine", "taken back (quarantine)"
        RESTORE = "restore", "given back (cleared)"  # an admin cleared the volunteer

    lease = models.ForeignKey(Lease, on_delete=models.CASCADE, related_name="credit_entries")
    kind = models.CharField(max_length=10, choices=Kind.choices)
    volunteer = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="credit_entries")
    device = models.ForeignKey(Device, null=True, on_delete=models.SET_NULL, related_name="credit_entries")
    # The team when the work was credited: leaving a team takes no credit away from it.
    team = models.ForeignKey(Team, null=True, blank=True, on_delete=models.SET_NULL, related_name="credit_entries")
    campaign = models.ForeignKey(Campaign, on_delete=models.CASCADE, related_name="credit_entries")
    samples = models.BigIntegerField()
    flops = models.FloatField()
    reason = models.CharField(max_length=200, blank=True)
    created_at = models.DateTimeField(default=timezone.now, db_index=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["lease", "kind"], name="credit_one_entry_of_each_kind")]
        indexes = [
            models.Index(fields=["volunteer", "created_at"]),
            models.Index(fields=["team", "created_at"]),
            models.Index(fields=["campaign", "created_at"]),
        ]
        verbose_name_plural = "credit entries"

    def __str__(self) -> str:
        return f"{self.get_kind_display()} {self.credit:.6g} for lease {self.lease_id}"

    @property
    def credit(self) -> float:
        return self.flops / FLOPS_PER_CREDIT
