"""GET /metrics on the aggregator's port: what it holds and did, in Prometheus's format, behind the token rule."""

from __future__ import annotations

from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from crowdtrain_agent.protocol import SliceReady, UploadRejected
from crowdtrain_backbone.server import BackboneServer

from .conftest import SLICE0, Agent, FakeSite, gradient, running_backbone, take_step, ticket
from .test_params_http import _get

NUMEL = SLICE0[1] - SLICE0[0]


def _samples(body: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    }


async def test_it_counts_uploads_steps_and_what_each_slice_holds(
    site: FakeSite, held: SliceReady, backbone: BackboneServer, agent: Agent
) -> None:
    await take_step(site, agent, version=0, lease_id=1)
    await take_step(site, agent, version=1, lease_id=2)
    wrong = await agent.upload(ticket(3, base_version=2), gradient(NUMEL + 1, 3))

    status, headers, body = await _get(f"http://127.0.0.1:{backbone.port}/metrics")

    samples = _samples(body)
    slice0 = (("campaign", "1"), ("slice", "0"))
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    assert isinstance(wrong, UploadRejected)
    assert samples[("crowdtrain_backbone_uploads_total", (("code", ""), ("result", "accepted")))] == 2
    assert samples[("crowdtrain_backbone_uploads_total", (("code", wrong.code), ("result", "rejected")))] == 1
    assert samples[("crowdtrain_backbone_ingest_bytes_total", ())] == 2 * NUMEL * 4  # fp32 on the wire
    assert samples[("crowdtrain_backbone_steps_applied_total", slice0)] == 2
    assert samples[("crowdtrain_backbone_apply_seconds_count", ())] == 2
    assert samples[("crowdtrain_backbone_slice_version", slice0)] == backbone.node.get_slice(1, 0).version == 2
    assert samples[("crowdtrain_backbone_versions_held", slice0)] == len(backbone.node.get_slice(1, 0).snapshots)
    assert samples[("crowdtrain_backbone_pending_bytes", ())] == backbone.node.budget.used
    assert samples[("crowdtrain_backbone_clipped_contributions_total", slice0)] == 0
    assert samples[("process_resident_memory_bytes", ())] > 0


async def test_with_a_token_configured_a_scrape_without_it_is_refused(site: FakeSite, tmp_path: Path) -> None:
    async with running_backbone(site, tmp_path / "checkpoints", metrics_token="agg-metrics-token") as server:
        url = f"http://127.0.0.1:{server.port}/metrics"
        anonymous = await _get(url, token=None)
        wrong = await _get(url, token="not-it")
        right = await _get(url, token="agg-metrics-token")

    assert anonymous[0] == 401 and b"CROWDTRAIN_BACKBONE_METRICS_TOKEN" in anonymous[2]
    assert wrong[0] == 401
    assert right[0] == 200 and b"crowdtrain_backbone_pending_bytes" in right[2]


async def test_without_a_token_a_scrape_a_proxy_relayed_is_refused(backbone: BackboneServer) -> None:
    url = f"http://127.0.0.1:{backbone.port}/metrics"

    direct = await _get(url, token=None)
    relayed = [
        await _get(url, {header: value}, token=None)
        for header, value in [("Forwarded", "for=203.0.113.9"), ("X-Real-IP", "203.0.113.9"), ("Via", "1.1 lb")]
    ]

    assert direct[0] == 200
    assert [status for status, _, _ in relayed] == [403, 403, 403]
    assert b"CROWDTRAIN_BACKBONE_METRICS_TOKEN" in relayed[0][2]
