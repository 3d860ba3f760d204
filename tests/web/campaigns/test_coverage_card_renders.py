"""The shard coverage card renders where a campaign page includes it, pointing its script at the feed."""

from __future__ import annotations

import pytest
from django.contrib.staticfiles import finders
from django.template import Context, Template

from tests.factories import make_campaign

pytestmark = pytest.mark.django_db


def test_the_card_renders_when_included_with_a_campaign() -> None:
    campaign = make_campaign()
    page = Template('{% include "campaigns/_coverage.html" %}')

    html = page.render(Context({"campaign": campaign}))

    assert '<section class="card coverage"' in html and "Shard coverage" in html
    assert 'id="coverage-map"' in html and f'data-url="/api/campaigns/{campaign.pk}/coverage"' in html
    for state in ("verified", "done", "accepted", "leased", "rejected", "returned", "untouched"):
        assert f'data-coverage-count="{state}"' in html and f"coverage-swatch coverage-{state}" in html


def test_its_script_and_styles_are_served_as_static_files() -> None:
    assert finders.find("js/coverage-map.js") and finders.find("css/coverage.css")
