"""Each receiver handles every kind its direction tuple lets through, and nothing else gets through."""

from __future__ import annotations

from crowdtrain.gateway.consumers import AgentConsumer, BackboneConsumer
from crowdtrain_agent import control
from crowdtrain_agent.protocol import ALL_MESSAGES
from crowdtrain_agent.protocol.messages import (
    AGENT_TO_AGGREGATOR,
    AGENT_TO_SITE,
    AGGREGATOR_TO_AGENT,
    BACKBONE_TO_SITE,
    SITE_TO_AGENT,
    SITE_TO_BACKBONE,
    UploadBegin,
    Welcome,
)
from crowdtrain_backbone import node, site_link, uploads


def test_the_site_has_a_handler_for_every_kind_it_accepts() -> None:
    for consumer, accepted in ((AgentConsumer, AGENT_TO_SITE), (BackboneConsumer, BACKBONE_TO_SITE)):
        assert consumer.accepts == accepted
        missing = [
            cls.__name__ for cls in accepted if not callable(getattr(consumer, f"on_{cls.__struct_config__.tag}", None))
        ]
        assert missing == [], f"{consumer.__name__} accepts {missing} but has no on_<kind> for them"


def test_the_aggregator_and_the_agent_take_every_kind_sent_to_them() -> None:
    assert set(SITE_TO_BACKBONE) == set(node.ORDERS) | set(site_link.LINK_MESSAGES)
    assert set(SITE_TO_AGENT) == {Welcome, *control.REPLIES, *control.PUSHES}
    assert AGENT_TO_AGGREGATOR == (UploadBegin,) and uploads.AGENT_TO_AGGREGATOR is AGENT_TO_AGGREGATOR


def test_every_kind_travels_somewhere() -> None:
    directions = (
        AGENT_TO_SITE, SITE_TO_AGENT, BACKBONE_TO_SITE, SITE_TO_BACKBONE, AGENT_TO_AGGREGATOR, AGGREGATOR_TO_AGENT,
    )  # fmt: skip
    assert set(ALL_MESSAGES) == {cls for direction in directions for cls in direction}
