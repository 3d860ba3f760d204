from __future__ import annotations

from unittest import mock

from django.db import DatabaseError
from django.test import Client


def test_livez_says_the_process_answers_even_when_the_database_does_not() -> None:
    with mock.patch("django.db.backends.base.base.BaseDatabaseWrapper.ensure_connection", side_effect=DatabaseError):
        response = Client().get("/livez")

    assert response.status_code == 200
    assert response.json() == {"status": "live"}
