"""How a volunteer's own account is named to them (public pages use Profile.public_name instead)."""

from __future__ import annotations

from typing import Any


def account_name(user: Any) -> str:
    """The e-mail address people log in with; the username allauth derives from it means nothing to them."""
    return getattr(user, "email", "") or user.get_username()
