"""Model factories for web tests: small datasets and campaigns that are ready to lease."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from allauth.account.models import EmailAddress
from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser
from django.test import Client
from django.utils import timezone

from crowdtrain.accounts.models import Device
from crowdtrain.accounts.tokens import hash_token
from crowdtrain.campaigns.keys import ticket_key
from crowdtrain.campaigns.models import Campaign
from crowdtrain.campaigns.organizers import grant_role
from crowdtrain.campaigns.setup import create_campaign
from crowdtrain.datasets.models import Dataset
from crowdtrain.datasets.sharding import create_text_dataset
from crowdtrain.scheduler.models import Aggregator, Lease, SliceAssignment
from crowdtrain_agent.protocol import LeaseDone, Receipt, sign_receipt

TINY_GPT = {"n_layer": 1, "n_head": 1, "n_embd": 8, "block_size": 8}


def make_user(username: str = "volunteer", *, joined_hours_ago: float | None = None) -> AbstractBaseUser:
    """A volunteer; each new one joined a day after the one before unless told (``verification.affinity``
    takes accounts that joined within minutes of each other for one person's)."""
    users = get_user_model().objects
    if joined_hours_ago is None:
        joined_hours_ago = 24.0 * (1000 - users.count())
    joined = timezone.now() - timedelta(hours=joined_hours_ago)
    return users.get_or_create(username=username, defaults={"date_joined": joined})[0]


def make_device(username: str = "volunteer", name: str = "laptop") -> tuple[Device, str]:
    device, token = Device.issue(make_user(username), name)
    device.last_seen_at = timezone.now()
    device.save(update_fields=["last_seen_at"])
    return device, token


def make_text_dataset(num_samples: int = 100, sample_len: int = 9, samples_per_shard: int = 30) -> Dataset:
    text = bytes((i * 7 + 3) % 251 for i in range(num_samples * sample_len))
    return create_text_dataset(f"text-{num_samples}", text, sample_len, shard_bytes=samples_per_shard * sample_len)


def make_aggregator(name: str = "agg-1") -> Aggregator:
    return Aggregator.objects.create(
        name=name,
        token_hash=hash_token(f"token-{name}"),
        upload_url=f"ws://127.0.0.1:1/{name}/upload",
        params_url=f"http://127.0.0.1:1/{name}/params/",
        connected=True,
        last_seen_at=timezone.now(),
    )


def make_campaign(dataset: Dataset | None = None, *, slices: int = 1, **fields: Any) -> Campaign:
    """A running campaign whose slices are assigned to live, ready aggregators."""
    dataset = dataset or make_text_dataset()
    options: dict[str, Any] = {"target_batch_size": 32, "microbatch_size": 4, "staleness": 0, "num_aggregators": slices,
                               "architecture": "gpt", "model_config": TINY_GPT}  # fmt: skip
    options.update(fields)
    campaign = create_campaign(name="test campaign", owner=make_user("organizer"), dataset=dataset, **options)
    campaign.state = Campaign.State.RUNNING
    campaign.save(update_fields=["state"])
    bounds = [campaign.param_count * i // slices for i in range(slices + 1)]
    for index in range(slices):
        SliceAssignment.objects.create(
            campaign=campaign,
            aggregator=make_aggregator(f"agg-{campaign.pk}-{index}"),
            index=index,
            start=bounds[index],
            end=bounds[index + 1],
            ready=True,
        )
    return campaign


def receipts_for(lease: Lease | int, sketch: bytes = b"") -> list[Receipt]:
    """The receipts the aggregators would sign for a lease; with ``sketch``, each carries it (verification)."""
    lease = lease if isinstance(lease, Lease) else Lease.objects.get(pk=lease)
    return [
        Receipt(
            slice_index=index,
            token=sign_receipt(ticket_key(lease.campaign_id), campaign_id=lease.campaign_id, lease_id=lease.pk,
                               slice_index=index, num_samples=lease.num_samples, sketch=sketch),
        )
        for index in lease.campaign.slices.values_list("index", flat=True)
    ]  # fmt: skip


def done_for(lease_id: int, loss: float = 1.0, sketch: bytes = b"") -> LeaseDone:
    lease = Lease.objects.get(pk=lease_id)
    return LeaseDone(
        lease_id=lease.pk,
        receipts=receipts_for(lease, sketch),
        num_samples=lease.num_samples,
        loss_sum=loss * lease.num_samples,
        compute_s=0.1,
    )


def commit_steps(campaign: Campaign, device: Device, steps: int) -> list[int]:
    """Lease and report one microbatch per step (the campaign's batch is one microbatch); returns the lease ids."""
    from crowdtrain.scheduler import leasing, reporting

    lease_ids = []
    for _ in range(steps):
        lease = leasing.request_lease(device.pk, None, 1000.0)
        reporting.report_done(device.pk, done_for(lease.lease_id))
        lease_ids.append(lease.lease_id)
    campaign.refresh_from_db()
    return lease_ids


def redo_samples(campaign: Campaign) -> int:
    """Samples waiting in the campaign's redo queue (expired, released or rejected leases' samples)."""
    from crowdtrain.scheduler.hotstate import hot_state

    return sum(count for _, _, count in hot_state().snapshot(campaign.hot_key.hex)["redo"])


def make_volunteer(name: str, *, password: str = "correct horse battery", verified: bool = True) -> AbstractBaseUser:
    """A volunteer as sign-up leaves them: e-mail login, address verified unless told otherwise."""
    email = f"{name}@example.org"
    user = get_user_model().objects.create_user(username=name, email=email, password=password)
    EmailAddress.objects.create(user=user, email=email, primary=True, verified=verified)
    return user


def make_organizer(name: str) -> AbstractBaseUser:
    """A volunteer who holds the organizer role (the group migration 0003 creates)."""
    user = make_volunteer(name)
    grant_role(user)
    return user


def make_admin(name: str = "admin") -> AbstractBaseUser:
    user = make_volunteer(name)
    user.is_staff = True
    user.save(update_fields=["is_staff"])
    return user


def make_persona(who: str) -> AbstractBaseUser | None:
    """Someone who is not a campaign's owner, by role, for permission tests; None for "anonymous".

    Roles: "other organizer" (otto), "volunteer" (vera), "admin" (ada), "anonymous".
    """
    return {
        "other organizer": lambda: make_organizer("otto"),
        "volunteer": lambda: make_volunteer("vera"),
        "admin": lambda: make_admin("ada"),
        "anonymous": lambda: None,
    }[who]()


def logged_in(user: AbstractBaseUser | None = None, **client_options: Any) -> Client:
    """A test client with ``user``'s session, as if they had logged in; an anonymous one when ``user`` is None.

    ``client_options`` go to ``Client``: ``enforce_csrf_checks=True`` for tests of the CSRF check,
    ``raise_request_exception=False`` to read a server error's response.
    """
    client = Client(**client_options)
    if user is not None:
        client.force_login(user)
    return client


def work_one_lease(campaign: Campaign, device_id: int) -> None:
    """Lease and report one lease as an agent would, with valid receipts; both must succeed."""
    from crowdtrain.scheduler import leasing, reporting
    from crowdtrain_agent.protocol import Lease as LeaseMessage

    lease = leasing.request_lease(device_id, campaign.pk, None)
    assert isinstance(lease, LeaseMessage), lease
    assert reporting.report_done(device_id, done_for(lease.lease_id)).ack.accepted


def commit_leases(campaign: Campaign, device_ids: list[int], leases: int) -> None:
    """Work ``leases`` leases, the devices taking turns."""
    for i in range(leases):
        work_one_lease(campaign, device_ids[i % len(device_ids)])


def work_until_committed(campaign: Campaign, device_ids: list[int], steps: int) -> None:
    """Work leases, the devices taking turns, until ``steps`` steps are committed (whatever the lease size)."""
    turn = 0
    while Campaign.objects.get(pk=campaign.pk).committed_steps < steps:
        work_one_lease(campaign, device_ids[turn % len(device_ids)])
        turn += 1
