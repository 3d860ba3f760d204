"""Which volunteers look alike: the traits that keep a copy from going to the original's other account."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crowdtrain.accounts.models import Device, Team
from crowdtrain.verification import affinity
from tests.factories import make_device, make_user

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize(
    ("address", "prefix"),
    [
        ("8.8.4.77", "8.8.4.0/24"),
        ("::ffff:8.8.4.77", "8.8.4.0/24"),
        ("100.72.1.2", ""),
        ("2001:db8:1234:5678::1", ""),  # documentation range: private to Python
        ("2a00:1450:4001:81c::200e", "2a00:1450:4001::/48"),
        ("127.0.0.1", ""),
        ("10.1.2.3", ""),
        ("192.168.0.9", ""),
        ("169.254.1.1", ""),
        ("::1", ""),
        ("not an address", ""),
        ("", ""),
    ],
)
def test_a_network_prefix_is_known_only_for_public_addresses(address: str, prefix: str) -> None:
    assert affinity.network_prefix(address) == prefix


@given(st.text(max_size=80))
def test_any_text_as_an_address_gives_a_prefix_or_nothing(text: str) -> None:
    assert isinstance(affinity.network_prefix(text), str)


def test_behind_trusted_proxies_the_address_is_the_one_the_nearest_proxy_appended(settings: Any) -> None:
    scope = {"client": ("10.0.0.5", 40000), "headers": [(b"x-forwarded-for", b"6.6.6.6, 8.8.4.77")]}
    settings.ALLAUTH_TRUSTED_PROXY_COUNT = 0
    assert affinity.client_address(scope) == "10.0.0.5"
    settings.ALLAUTH_TRUSTED_PROXY_COUNT = 1
    assert affinity.client_address(scope) == "8.8.4.77", "not 6.6.6.6: the client wrote that one"
    settings.ALLAUTH_TRUSTED_PROXY_COUNT = 3
    assert affinity.client_address(scope) == "", "fewer addresses than proxies: unknown"


def test_a_fingerprint_needs_a_host_name_and_tells_machines_apart() -> None:
    laptop = {"hostname": "kitchen", "kind": "cuda", "name": "RTX 4090", "memory_bytes": 24 << 30, "threads": 16}
    assert affinity.fingerprint({**laptop, "hostname": ""}) == "" and affinity.fingerprint("junk") == ""
    assert affinity.fingerprint(laptop) == affinity.fingerprint(dict(laptop))
    assert affinity.fingerprint(laptop) != affinity.fingerprint({**laptop, "hostname": "garage"})


def test_accounts_that_share_a_machine_a_network_a_team_or_the_minute_they_joined_are_similar() -> None:
    alice, _ = make_device("alice")
    bob, _ = make_device("bob")
    tags = affinity.tags_of
    assert not affinity.similar(tags(alice.owner_id, widen=True), tags(bob.owner_id)), "joined a day apart"

    same_machine = {"hostname": "kitchen", "kind": "cpu", "name": "cpu", "memory_bytes": 8 << 30, "threads": 4}
    Device.objects.filter(pk__in=[alice.pk, bob.pk]).update(hardware=same_machine)
    affinity.clear_caches()
    assert affinity.similar(tags(alice.owner_id, widen=True), tags(bob.owner_id))

    Device.objects.filter(pk=bob.pk).update(hardware={"network": "203.0.113.0/24"})
    Device.objects.filter(pk=alice.pk).update(hardware={"network": "203.0.113.0/24", "hostname": "x"})
    affinity.clear_caches()
    assert affinity.similar(tags(alice.owner_id, widen=True), tags(bob.owner_id))

    Device.objects.filter(pk=bob.pk).update(hardware={})
    team = Team.objects.create(name="Crows")
    for device in (alice, bob):
        device.owner.profile.team = team
        device.owner.profile.save()
    affinity.clear_caches()
    assert affinity.similar(tags(alice.owner_id, widen=True), tags(bob.owner_id))

    carol = make_user("carol", joined_hours_ago=24.0 * 500 + 0.1)  # six minutes apart from the user made 500 days ago
    dave = make_user("dave", joined_hours_ago=24.0 * 500)
    assert affinity.similar(tags(carol.pk, widen=True), tags(dave.pk))
    eve = make_user("eve", joined_hours_ago=24.0 * 500 + 1.0)
    assert not affinity.similar(tags(eve.pk, widen=True), tags(dave.pk)), "an hour apart"
