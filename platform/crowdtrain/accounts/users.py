"""The signed-in user of a request, typed for views that ``login_required`` protects."""

from __future__ import annotations

from django.contrib.auth.models import User
from django.http import HttpRequest


def signed_in_user(request: HttpRequest) -> User:
    """``request.user`` in a view behind ``login_required``, which lets no anonymous visitor through."""
    user = request.user
    assert isinstance(user, User), "login_required lets no anonymous visitor through"
    return user
