"""Organizers reach their datasets from every page, and the new-campaign form leads to the upload page."""

from __future__ import annotations

import pytest

from tests.factories import logged_in, make_organizer, make_volunteer

pytestmark = pytest.mark.django_db


def test_organizers_find_datasets_in_the_navigation_and_volunteers_do_not() -> None:
    organizer_page = logged_in(make_organizer("olga")).get("/leaderboards/").content.decode()
    volunteer_page = logged_in(make_volunteer("vera")).get("/leaderboards/").content.decode()

    assert '<a href="/datasets/"' in organizer_page
    assert '<a href="/datasets/"' not in volunteer_page


def test_the_new_campaign_form_links_to_the_upload_page_without_a_ready_dataset() -> None:
    html = logged_in(make_organizer("olga")).get("/campaigns/new").content.decode()

    assert 'href="/datasets/new"' in html
