"""A tab asks for a campaign's browser verdict and graphs, by device token or session; strangers learn nothing."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.core.files.base import ContentFile
from django.core.files.storage import default_storage
from django.test import Client, override_settings
from django.utils import timezone

from crowdtrain.browser import checking
from crowdtrain.browser.models import BrowserGraph, graph_storage_name
from crowdtrain.campaigns.models import Campaign
from crowdtrain_agent.models import get_model
from tests.factories import logged_in, make_campaign, make_device, make_volunteer

pytestmark = pytest.mark.django_db

BIG, ONE = "a" * 64, "b" * 64


@pytest.fixture(autouse=True)
def graphs_on() -> Iterator[None]:
    with override_settings(CROWDTRAIN_BROWSER_GRAPHS=True):
        yield


def passed(campaign: Campaign) -> BrowserGraph:
    row = checking.request_check(campaign.architecture, campaign.model_config, campaign.microbatch_size, queue=False)
    assert row is not None
    BrowserGraph.objects.filter(pk=row.pk).update(
        status="passed", reason="gpt: the browser graph's gradients match PyTorch's", sha256=BIG, sha256_one=ONE,
        bytes=5, bytes_one=3, manifest={"microbatch_size": 4}, memory_bytes=12345, ratio=0.99,
        checked_at=timezone.now(),
    )  # fmt: skip
    default_storage.save(graph_storage_name(BIG), ContentFile(b"onnx!"))
    default_storage.save(graph_storage_name(ONE), ContentFile(b"one"))
    return BrowserGraph.objects.get(pk=row.pk)


def as_device(token: str) -> Client:
    return Client(headers={"Authorization": f"Bearer {token}"})


def test_a_device_gets_a_passed_campaigns_graphs() -> None:
    campaign = make_campaign()
    passed(campaign)
    _, token = make_device("vera")

    answer = as_device(token).get(f"/api/campaigns/{campaign.pk}/browser/")

    assert answer.status_code == 200
    assert answer.json() == {
        "status": "passed",
        "reason": "gpt: the browser graph's gradients match PyTorch's",
        "microbatch_size": 4,
        "graphs": {
            "4": {"sha256": BIG, "url": f"/browser/graphs/{BIG}.onnx", "bytes": 5},
            "1": {"sha256": ONE, "url": f"/browser/graphs/{ONE}.onnx", "bytes": 3},
        },
        "manifest": {"microbatch_size": 4},
        "memory_bytes": 12345,
        "flops_per_sample": get_model("gpt").flops_per_sample(campaign.model_config),
    }
    assert answer.json()["flops_per_sample"] > 0


def test_a_wide_graph_is_listed_by_its_batch_and_its_bytes_are_served() -> None:
    campaign = make_campaign()
    row = passed(campaign)
    wide = "c" * 64
    BrowserGraph.objects.filter(pk=row.pk).update(wide_size=16, sha256_wide=wide, bytes_wide=4)
    default_storage.save(graph_storage_name(wide), ContentFile(b"wide"))
    _, token = make_device("vera")

    graphs = as_device(token).get(f"/api/campaigns/{campaign.pk}/browser/").json()["graphs"]
    served = as_device(token).get(f"/browser/graphs/{wide}.onnx")

    assert sorted(graphs, key=int) == ["1", "4", "16"]
    assert graphs["16"] == {"sha256": wide, "url": f"/browser/graphs/{wide}.onnx", "bytes": 4}
    assert served.status_code == 200 and b"".join(served.streaming_content) == b"wide"  # type: ignore[attr-defined]


def test_a_logged_in_volunteer_gets_the_graph_bytes_cacheable_for_ever() -> None:
    campaign = make_campaign()
    passed(campaign)
    client = logged_in(make_volunteer("vera"))

    answer = client.get(f"/browser/graphs/{BIG}.onnx")
    again = client.get(f"/browser/graphs/{BIG}.onnx", headers={"If-None-Match": f'"{BIG}"'})

    assert answer.status_code == 200 and b"".join(answer.streaming_content) == b"onnx!"  # type: ignore[attr-defined]
    assert answer["ETag"] == f'"{BIG}"' and answer["Cache-Control"] == "public, max-age=31536000, immutable"
    assert answer["Content-Length"] == "5"
    assert again.status_code == 304


def test_a_pending_campaign_says_so_with_no_graphs() -> None:
    campaign = make_campaign()
    _, token = make_device("vera")

    answer = as_device(token).get(f"/api/campaigns/{campaign.pk}/browser/").json()

    assert answer["status"] == "pending" and answer["graphs"] == {} and answer["memory_bytes"] == 0
    assert answer["reason"] == "its model is being checked for browsers"


def test_a_refused_campaign_gives_the_reason_and_its_graph_is_not_served() -> None:
    campaign = make_campaign()
    row = passed(campaign)
    BrowserGraph.objects.filter(pk=row.pk).update(status="refused", reason="gpt: gradients differ")
    _, token = make_device("vera")

    answer = as_device(token).get(f"/api/campaigns/{campaign.pk}/browser/").json()
    graph = as_device(token).get(f"/browser/graphs/{BIG}.onnx")

    assert (answer["status"], answer["reason"], answer["graphs"]) == ("refused", "gpt: gradients differ", {})
    assert graph.status_code == 404 and graph.json() == {"error": "unknown graph"}


@pytest.mark.parametrize("path", ["/api/campaigns/{id}/browser/", f"/browser/graphs/{BIG}.onnx"])
def test_a_revoked_device_is_forbidden_and_a_bad_token_or_nobody_unauthorized(path: str) -> None:
    campaign = make_campaign()
    passed(campaign)
    device, token = make_device("vera")
    device.revoked_at = timezone.now()
    device.save(update_fields=["revoked_at"])
    url = path.format(id=campaign.pk)

    revoked, wrong, nobody = as_device(token).get(url), as_device("ctd_nope").get(url), Client().get(url)

    assert revoked.status_code == 403 and "revoked" in revoked.json()["error"]
    assert wrong.status_code == 401 and nobody.status_code == 401


def test_a_campaign_the_caller_may_not_see_is_a_404_like_one_that_does_not_exist() -> None:
    secret = make_campaign(visibility=Campaign.Visibility.INVITE)
    passed(secret)
    _, token = make_device("vera")

    hidden = as_device(token).get(f"/api/campaigns/{secret.pk}/browser/")
    missing = as_device(token).get("/api/campaigns/999999/browser/")

    assert hidden.status_code == missing.status_code == 404
    assert hidden.json() == {"error": f"no campaign {secret.pk}"}


@pytest.mark.parametrize("name", ["A" * 64, "a" * 63, "../../etc/passwd", "a" * 64 + "x"])
def test_a_malformed_or_unknown_graph_name_is_a_404(name: str) -> None:
    campaign = make_campaign()
    passed(campaign)
    _, token = make_device("vera")

    answer = as_device(token).get(f"/browser/graphs/{name}.onnx")

    assert answer.status_code == 404
