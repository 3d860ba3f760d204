"""The "Compute in this tab" page (issue 36): logged-in volunteers only, cross-origin isolated, set up by the site."""

from __future__ import annotations

import json
import re
from pathlib import Path
from wsgiref.headers import Headers

import pytest
from django.conf import settings
from django.test import Client

from crowdtrain.campaigns.isolation import ISOLATION_HEADERS, isolate_tab_static
from crowdtrain.campaigns.models import Campaign
from tests.factories import logged_in, make_campaign, make_volunteer

pytestmark = pytest.mark.django_db


def tab_config(html: str) -> dict[str, object]:
    match = re.search(r'<script id="tab-config" type="application/json">(.*?)</script>', html, re.S)
    assert match, "the page carries its config as a json_script"
    return json.loads(match[1])


def test_a_volunteer_gets_an_isolated_page_that_names_every_endpoint_of_this_site() -> None:
    campaign = make_campaign()
    vera = make_volunteer("vera")

    page = logged_in(vera).get(f"/campaigns/{campaign.pk}/tab/")

    assert page.status_code == 200
    assert page["Cross-Origin-Opener-Policy"] == "same-origin"
    assert page["Cross-Origin-Embedder-Policy"] == "require-corp"
    config = tab_config(page.content.decode())
    assert config == {
        "campaign_id": campaign.pk,
        "user_id": vera.pk,
        "ws_url": "ws://testserver/ws/agent/",
        "shard_url": "http://testserver/api/shards/",
        "browser_api_url": f"/api/campaigns/{campaign.pk}/browser/",
        "tab_device_url": "/devices/tab/",
        "worker_url": "/static/build/tab-worker.js",
        "ort_url": "http://testserver/static/build/ort/",
        "webgpu": False,
    }
    assert 'src="/static/build/tab-page.js"' in page.content.decode()


def test_webgpu_is_asked_for_only_by_choice() -> None:
    campaign = make_campaign()

    page = logged_in(make_volunteer("vera")).get(f"/campaigns/{campaign.pk}/tab/?webgpu=1")

    assert tab_config(page.content.decode())["webgpu"] is True


def test_strangers_log_in_first_and_drafts_and_invite_only_campaigns_stay_hidden() -> None:
    campaign = make_campaign()
    anonymous = logged_in().get(f"/campaigns/{campaign.pk}/tab/")
    assert anonymous.status_code == 302 and "/accounts/login/" in anonymous["Location"]

    vera = logged_in(make_volunteer("vera"))
    Campaign.objects.filter(pk=campaign.pk).update(state=Campaign.State.DRAFT)
    assert vera.get(f"/campaigns/{campaign.pk}/tab/").status_code == 404
    Campaign.objects.filter(pk=campaign.pk).update(state=Campaign.State.RUNNING, visibility=Campaign.Visibility.INVITE)
    assert vera.get(f"/campaigns/{campaign.pk}/tab/").status_code == 404
    assert vera.post(f"/campaigns/{campaign.pk}/tab/").status_code in (404, 405)


def test_the_join_page_offers_the_tab_to_volunteers_and_a_login_to_strangers() -> None:
    campaign = make_campaign()

    mine = logged_in(make_volunteer("vera")).get(f"/campaigns/{campaign.pk}/join").content.decode()
    theirs = logged_in().get(f"/campaigns/{campaign.pk}/join").content.decode()

    assert f'href="/campaigns/{campaign.pk}/tab/">Compute in this tab</a>' in mine
    assert f'?next=/campaigns/{campaign.pk}/tab/">Log in to compute in this tab</a>' in theirs


@pytest.mark.parametrize(
    ("url", "isolated"),
    [
        ("/static/build/tab-worker.js", True),
        ("/static/build/tab-page.js", True),
        ("/static/build/ort/ort-wasm-simd-threaded.wasm", True),
        ("/static/build/ort/ort.wasm.min.mjs", True),
        ("/static/build/charts.js", False),
        ("/static/css/site.css", False),
    ],
)
def test_the_tabs_static_files_are_served_isolated_and_nothing_else(url: str, isolated: bool) -> None:
    headers = Headers([("Content-Type", "text/javascript")])  # what whitenoise hands the hook

    isolate_tab_static(headers, "/somewhere" + url, url)  # type: ignore[arg-type]

    assert all(headers.get(name) == value for name, value in ISOLATION_HEADERS.items()) is isolated
    assert (len(headers.items()) > 1) is isolated


def test_the_site_serves_the_built_worker_and_onnxruntime_isolated_and_compressed(client: Client) -> None:
    build = Path(settings.BASE_DIR) / "frontend" / "static" / "build"
    if not (build / "ort" / "ort-wasm-simd-threaded.wasm").is_file():
        pytest.fail(f"the tab is not built: run `make charts` (npm run build in frontend/) first; {build} lacks it")

    for url, kind in [
        ("/static/build/tab-worker.js", "text/javascript"),
        ("/static/build/ort/ort.wasm.min.mjs", "text/javascript"),
        ("/static/build/ort/ort-wasm-simd-threaded.wasm", "application/wasm"),
    ]:
        answer = client.get(url, HTTP_ACCEPT_ENCODING="gzip, deflate, br")
        assert answer.status_code == 200, url
        assert answer["Content-Encoding"] == "br", f"{url}: the build writes a brotli copy that whitenoise sends"
        assert answer["Content-Type"].startswith(kind), url
        assert answer["Cross-Origin-Embedder-Policy"] == "require-corp", url
        assert answer["Cross-Origin-Opener-Policy"] == "same-origin", url
