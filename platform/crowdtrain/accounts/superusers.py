"""A superuser made with ``manage.py createsuperuser`` can log in on the site's own page at once.

Volunteers prove their address by the link allauth mails them (mandatory
verification); the operator typed theirs at a terminal of the server itself,
which proves as much. Without this, their first log-in would stop at "verify
your e-mail", with the mail perhaps going to a console nobody reads.
"""

from __future__ import annotations

import logging
from typing import Any

from allauth.account.models import EmailAddress

logger = logging.getLogger(__name__)


def verify_superuser_email(sender: Any, instance: Any, created: bool, raw: bool = False, **kwargs: Any) -> None:
    """post_save of the user model: give a superuser's address a verified, primary EmailAddress row."""
    if raw or not instance.is_superuser or not instance.email:
        return
    # One address, one account (ACCOUNT_UNIQUE_EMAIL): a volunteer who already holds it keeps it.
    if EmailAddress.objects.filter(email__iexact=instance.email).exists():
        return
    EmailAddress.objects.create(user=instance, email=instance.email, verified=True, primary=True)
    logger.info("superuser %s: %s counts as verified", instance.pk, instance.email)
