"""Who may open a page: the staff-only check every admin page shares."""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any

from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse


def staff_required(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """Staff only: anonymous visitors log in, a volunteer gets a plain 403.

    Django's ``staff_member_required`` would send volunteers to the admin's log-in form instead.
    """

    @wraps(view)
    @login_required
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        if not request.user.is_staff:
            raise PermissionDenied("only admins may open this page")
        return view(request, *args, **kwargs)

    return wrapper
