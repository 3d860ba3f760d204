"""The JSON endpoints strangers reach answer any body with a clear 4xx, never a 500.

Bodies a fuzzer sent (a lone surrogate in ``device_code``, in an upload's file
name or dataset name; deep nesting; huge numbers) used to be answered 500.
"""

from __future__ import annotations

import json

import pytest
from django.contrib.auth import get_user_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.factories import logged_in, make_organizer
from tests.protocol.strategies import ANY_JSON

pytestmark = pytest.mark.django_db

# JSON text with lone surrogates inside strings, which json.dumps writes as "\udXXX" escapes.
SURROGATE_TEXT = st.text(alphabet=st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=3)
BODIES = st.one_of(
    ANY_JSON,
    st.dictionaries(
        st.sampled_from(
            ["device_code", "grant_type", "client_id", "filename", "name", "size", "format", "sha256", "sample_len"]
        ),
        st.one_of(ANY_JSON, SURROGATE_TEXT, st.integers(-(10**30), 10**30)),
        max_size=6,
    ),
)


@pytest.mark.parametrize(
    ("path", "body", "problem"),
    [
        (
            "/api/device/token",
            {"grant_type": "urn:ietf:params:oauth:grant-type:device_code", "device_code": "\ud800"},
            "device_code is not text",
        ),
        ("/datasets/uploads", {"filename": "a\udc00.txt", "size": 10, "format": "text"}, "filename is not text"),
        (
            "/datasets/uploads",
            {"filename": "a.txt", "name": "\ud800", "size": 10, "format": "text"},
            "name is not text",
        ),
        ("/api/device/token", {"device_code": "[" * 5000}, "missing grant_type"),
    ],
)
def test_a_lone_surrogate_is_a_named_400(path: str, body: dict[str, object], problem: str) -> None:
    client = logged_in(make_organizer("org"))

    response = client.post(path, json.dumps(body), content_type="application/json")

    assert response.status_code == 400
    assert problem in response.content.decode()


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(body=BODIES, path=st.sampled_from(["/api/device/code", "/api/device/token", "/datasets/uploads"]))
def test_any_json_body_is_answered_without_a_server_error(body: object, path: str) -> None:
    # Hypothesis runs every example in the test's one transaction: the first example makes the user.
    fuzzer = get_user_model().objects.filter(username="fuzz").first() or make_organizer("fuzz")
    client = logged_in(fuzzer, raise_request_exception=False)

    response = client.post(path, json.dumps(body), content_type="application/json")

    assert response.status_code < 500, response.content[:300]
