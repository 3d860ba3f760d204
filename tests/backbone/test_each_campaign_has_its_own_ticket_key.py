"""The aggregator checks a ticket with the key of the campaign it names, learnt with a slice of that campaign.

A ticket signed with another campaign's key is a bad ticket; one for a campaign
this aggregator holds no slice of is refused as 'slice not held'. A 2.0 site
sends no key with its slices: then the welcome's one key serves every campaign.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from crowdtrain_agent.protocol import UploadRejected, campaign_key, verify_receipt

from .conftest import KEY, SLICE0, FakeSite, agent_connection, assignment, gradient, running_backbone, ticket

NUMEL = SLICE0[1] - SLICE0[0]


async def test_a_ticket_signed_with_another_campaigns_key_is_refused(site: FakeSite, tmp_path: Path) -> None:
    async with running_backbone(site, tmp_path / "checkpoints") as backbone, agent_connection(backbone) as agent:
        await site.assign(assignment(campaign_id=2))

        foreign = await agent.upload(ticket(1, campaign_id=2, key=campaign_key(KEY, 1)), gradient(NUMEL, 1))
        global_key = await agent.upload(ticket(2, campaign_id=2, key=KEY), gradient(NUMEL, 2))
        not_held = await agent.upload(ticket(3, campaign_id=3), gradient(NUMEL, 3))
        good = await agent.upload(ticket(4, campaign_id=2), gradient(NUMEL, 4))

    for reply in (foreign, global_key):
        assert isinstance(reply, UploadRejected) and reply.code == "bad ticket" and "signature" in reply.detail
    assert isinstance(not_held, UploadRejected) and not_held.code == "slice not held"
    assert "no slice of campaign 3" in not_held.detail
    assert verify_receipt(good.token, campaign_key(KEY, 2), campaign_id=2, lease_id=4, slice_index=0, num_samples=4)
    assert not verify_receipt(good.token, campaign_key(KEY, 1), campaign_id=2, lease_id=4, slice_index=0,
                              num_samples=4)  # fmt: skip


async def test_from_a_2_0_site_the_welcomes_key_serves_every_campaign(site: FakeSite, tmp_path: Path) -> None:
    site.welcome_key = KEY
    async with running_backbone(site, tmp_path / "checkpoints") as backbone, agent_connection(backbone) as agent:
        await site.assign(msgspec.structs.replace(assignment(campaign_id=5), ticket_key=""))
        reply = await agent.upload(ticket(1, campaign_id=5, key=KEY), gradient(NUMEL, 1))

    assert verify_receipt(reply.token, KEY, campaign_id=5, lease_id=1, slice_index=0, num_samples=4)
