"""What browser tests hold: the live site, its outbox of e-mails, and the screenshot helper's type."""

from __future__ import annotations

import email
import email.policy
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from email.message import EmailMessage
from pathlib import Path
from typing import cast
from urllib.parse import urlsplit, urlunsplit

import pytest
from playwright.sync_api import Page, expect

from crowdtrain_launcher import Swarm

MAIL_SEPARATOR = b"\n" + b"-" * 79 + b"\n"  # what Django's file-based backend writes after each message
LINK = re.compile(r"https?://[^\s<>\"')]+")

# shot(page, "after login") -> the PNG's path
Shot = Callable[[Page, str], Path]


@dataclass(frozen=True)
class Mail:
    """One message the site sent, parsed from its outbox file."""

    subject: str
    to: list[str]
    body: str  # the text/plain part ("" when there is none)
    html: str | None
    message: EmailMessage

    @property
    def links(self) -> list[str]:
        """Every http(s) URL in the text part, then in the HTML part, in order."""
        return LINK.findall(self.body) + LINK.findall(self.html or "")


def parse_mail(raw: bytes) -> Mail:
    # policy.default makes the parser build an EmailMessage, with get_body() and decoded headers.
    message = cast(EmailMessage, email.message_from_bytes(raw, policy=email.policy.default))
    text = message.get_body(preferencelist=("plain",))
    html = message.get_body(preferencelist=("html",))
    to = message["To"]
    return Mail(
        subject=str(message["Subject"] or ""),
        to=[address.addr_spec for address in to.addresses] if to else [],
        body=text.get_content() if text is not None else "",
        html=html.get_content() if html is not None else None,
        message=message,
    )


@dataclass(frozen=True)
class Outbox:
    """The folder the site's file-based e-mail backend writes to (a file per connection, messages appended)."""

    folder: Path

    def messages(self) -> list[Mail]:
        """Every complete message, oldest first."""
        files = sorted(self.folder.glob("*.log"), key=lambda path: (path.stat().st_mtime_ns, path.name))
        found = []
        for path in files:
            # The last piece is empty, or a message still being written: only separated ones are complete.
            *complete, _rest = path.read_bytes().split(MAIL_SEPARATOR)
            found.extend(parse_mail(raw) for raw in complete)
        return found

    def newest(self, *, to: str | None = None, timeout_s: float = 10.0) -> Mail:
        """The newest message (to ``to``, when given), waiting up to ``timeout_s`` for one to arrive."""
        deadline = time.monotonic() + timeout_s
        while True:
            matching = [mail for mail in self.messages() if to is None or to in mail.to]
            if matching:
                return matching[-1]
            if time.monotonic() > deadline:
                sent = [f"{mail.to} {mail.subject!r}" for mail in self.messages()] or ["nothing"]
                pytest.fail(
                    f"no e-mail{f' to {to}' if to else ''} in {self.folder} within {timeout_s:.0f} s; "
                    f"the site sent: {'; '.join(sent)}. If the site's log shows the message, the site "
                    "is not reading CROWDTRAIN_EMAIL_URL (crowdtrain/settings.py)"
                )
            time.sleep(0.1)

    def clear(self) -> None:
        for path in self.folder.glob("*.log"):
            path.unlink()


@dataclass(frozen=True)
class LiveSite:
    """The site on daphne for this session: its base URL (no trailing slash), outbox and process."""

    url: str
    outbox: Outbox
    swarm: Swarm = field(repr=False)
    redis_url: str | None = None  # the site's channel layer and cache; None on the embedded defaults

    @property
    def log_path(self) -> Path:
        return self.swarm.children[0].log_path

    def check(self) -> None:
        """Raise ``LaunchError`` with the end of the site's log if daphne has exited."""
        self.swarm.check()


def site_database_url() -> str:
    """The URL of the test database pytest-django has created, for the site process (after ``django_db_setup``)."""
    from django.db import connection

    name = str(connection.settings_dict["NAME"])
    if connection.vendor == "postgresql":
        return urlunsplit(urlsplit(os.environ["DATABASE_URL"])._replace(path=f"/{name}"))
    if connection.vendor == "sqlite" and not connection.is_in_memory_db():
        return f"sqlite:///{Path(name).resolve()}"  # an absolute path: four slashes in all
    raise pytest.UsageError(
        f"browser tests share the test database with a site process, which {connection.vendor} {name!r} "
        "does not allow: run them on PostgreSQL (python -m tests.services ...) or the default SQLite file"
    )


# make_volunteer / make_organizer's password (tests/factories.py).
FACTORY_PASSWORD = "correct horse battery"


def log_in(page: Page, email: str, password: str = FACTORY_PASSWORD) -> None:
    """Log in through the site's form, as a person would, and wait until the page says so."""
    page.goto("/accounts/login/")
    page.get_by_label("Email").fill(email)
    page.get_by_label("Password:", exact=True).fill(password)
    page.get_by_role("button", name="Sign In").click()
    expect(page.get_by_role("button", name="Log out")).to_be_visible()
