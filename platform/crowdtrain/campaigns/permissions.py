"""Who may download a shard: the volunteers of the campaigns that train on it."""

from __future__ import annotations

from django.db.models import Q

from crowdtrain.accounts.models import Device
from crowdtrain.datasets.permissions import data_holders

from .models import Campaign


def can_download_shard(device: Device, sha256: str) -> bool:
    """Whether ``device`` may fetch the shard with these bytes.

    Shards are content-addressed and shared between datasets, so a shard is
    open when any dataset holding it is open: used by a public campaign, or by
    no campaign at all (its hash is then never handed out by a lease, and the
    demo and code-made datasets keep working). A shard whose every dataset is
    used only by invite-only campaigns needs a device whose owner may work on
    one of them: invited, the campaign's owner, or staff.
    """
    holders = data_holders(sha256)
    if holders.filter(campaigns__isnull=True).exists():
        return True
    campaigns = Campaign.objects.filter(dataset__in=holders)
    if campaigns.filter(visibility=Campaign.Visibility.PUBLIC).exists():
        return True
    owner = device.owner
    if owner.is_staff:
        return True
    return campaigns.filter(Q(owner=owner) | Q(invited=owner)).exists()
