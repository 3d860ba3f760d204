"""Who may do what with datasets and shards: organizers upload, invited volunteers download."""

from __future__ import annotations

from typing import Any

from django.db.models import Q

from crowdtrain.accounts.models import Device

from .models import Campaign, Dataset, Pretrained, Upload
from .organizers import is_organizer

__all__ = [
    "can_download_shard",
    "data_holders",
    "is_organizer",
    "visible_datasets",
    "visible_pretrained",
    "visible_uploads",
]


def visible_datasets(user: Any) -> Any:
    """The datasets ``user`` may see and use: their own, or all of them for staff."""
    datasets = Dataset.objects.all()
    return datasets if user.is_staff else datasets.filter(owner=user)


def visible_pretrained(user: Any) -> Any:
    """The pretrained weights ``user`` may see and start from: their own, or all of them for staff."""
    weights = Pretrained.objects.all()
    return weights if user.is_staff else weights.filter(owner=user)


def visible_uploads(user: Any) -> Any:
    """Uploads belong to their owner alone: staff see datasets, not other people's half-sent files."""
    return Upload.objects.filter(owner=user)


def data_holders(sha256: str) -> Any:
    """The datasets whose shards, or whose tokenizer, are the stored object ``sha256``."""
    # A tokenizer counts only for a dataset it made: a failed upload's name for one proves nothing.
    made = Q(tokenizer_sha256=sha256, status=Dataset.Status.READY)
    return Dataset.objects.filter(Q(shards__sha256=sha256) | made).distinct()


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
