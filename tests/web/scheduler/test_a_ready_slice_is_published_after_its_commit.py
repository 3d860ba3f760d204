from __future__ import annotations

from typing import Any

import pytest
from django.db import connection

from crowdtrain.scheduler import backbone
from crowdtrain.scheduler.hotstate import HotState, hot_state
from crowdtrain.scheduler.rebuild import load_campaign
from crowdtrain_agent.protocol import SliceReady
from tests.factories import make_campaign


@pytest.mark.django_db(transaction=True)
def test_a_ready_slice_is_published_once_other_processes_can_read_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # Published inside slice_ready's transaction, the news reached Redis before the row it describes
    # was committed: a site process rebuilding the hot state in between read "not ready" and installed
    # it, and its volunteers were told "0 of 1 slices ready" for as long as the run lasted.
    campaign = make_campaign(slices=1)
    s = campaign.slices.get()
    s.ready = False
    s.save(update_fields=["ready"])
    load_campaign(campaign.pk)
    assert hot_state().snapshot(campaign.hot_key.hex)["meta"]["run"] == "0"
    published: list[bool] = []
    run = HotState.run

    def watched(self: HotState, script: str, hot_key: str, args: dict[str, Any], **kw: Any) -> dict[str, Any]:
        if script == "configure":
            published.append(connection.in_atomic_block)
        return run(self, script, hot_key, args, **kw)

    monkeypatch.setattr(HotState, "run", watched)

    backbone.slice_ready(s.aggregator_id, SliceReady(campaign_id=campaign.pk, slice_index=0, version=0))

    assert published == [False]
    assert hot_state().snapshot(campaign.hot_key.hex)["meta"]["run"] == "1"
