"""Site-signed tickets for gradient uploads, and aggregator-signed receipts.

A *ticket* is what an agent shows an aggregator to upload the gradient of one
lease: the site signs it (HMAC-SHA256 with a key it shares only with the
aggregators), so an aggregator can check it without asking the site. A
*receipt* is the aggregator's signed answer that it holds one slice of that
lease; the agent hands receipts back to the site in its ``done`` report, so
the site never counts samples whose gradient no aggregator holds.

Each campaign has its own key (``campaign_key``): the site tells an
aggregator the key of a campaign only with a slice of it (``assign.ticket_key``,
protocol 2.1), so a leaked aggregator token signs for that aggregator's
campaigns alone. A 2.0 site signs every campaign with one key, sent in the
welcome.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time

from .errors import ProtocolError
from .frames import CloseCode
from .schema import Count, Id, Part, Real, Version, from_dict, to_dict


class Ticket(Part, frozen=True, kw_only=True):
    lease_id: Id
    campaign_id: Id
    device_id: Id
    base_version: Version
    num_samples: Count
    expires_at: Real  # unix time; a little after the lease deadline
    # 2.2: a verification copy of another volunteer's lease. The aggregator sketches the upload for
    # the site and keeps nothing: a copy never counts in a step, so the version window does not apply.
    check: bool = False


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _mac(key: bytes, payload: bytes) -> bytes:
    return hmac.new(key, payload, hashlib.sha256).digest()


def campaign_key(root: bytes, campaign_id: int) -> bytes:
    """The key that signs campaign ``campaign_id``'s tickets and receipts, derived from the site's root key.

    HMAC-SHA256 of a fixed label and the id: knowing one campaign's key tells
    nothing about another's, nor about the root (which never leaves the site).
    """
    return _mac(root, b"crowdtrain ticket key, campaign %d" % campaign_id)


def ticket_campaign(token: str) -> int:
    """The campaign a ticket names, read *before* its signature is checked, only to pick the key to check it with.

    Raises:
        ProtocolError: with close code BAD_TICKET if the token is not a ticket.
    """
    try:
        payload = json.loads(_unb64(token.split(".")[0]))
        campaign_id = payload["campaign_id"]
    except (ValueError, TypeError, KeyError, RecursionError):
        raise ProtocolError("bad ticket: not a Crowdtrain ticket", close_code=CloseCode.BAD_TICKET) from None
    if type(campaign_id) is not int or campaign_id < 0:
        raise ProtocolError("bad ticket: campaign_id is not an id", close_code=CloseCode.BAD_TICKET)
    return campaign_id


def ticket_is_check(token: str) -> bool:
    """Whether a ticket marks a verification copy, read without its key (the agent has none).

    The agent only uses it to leave its error feedback alone for a copy, whose
    upload the aggregator keeps nothing of; a wrong answer costs nothing else.
    """
    try:
        payload = json.loads(_unb64(token.split(".")[0]))
    except (ValueError, TypeError, RecursionError):
        return False
    return isinstance(payload, dict) and payload.get("check") is True


def sign_ticket(ticket: Ticket, key: bytes) -> str:
    """Encode and sign a ticket as ``<payload>.<signature>`` in base64url."""
    payload = json.dumps(to_dict(ticket), sort_keys=True, separators=(",", ":")).encode()
    return f"{_b64(payload)}.{_b64(_mac(key, payload))}"


def verify_ticket(token: str, key: bytes, *, now: float | None = None) -> Ticket:
    """Check a ticket's signature and expiry and return its contents.

    Raises:
        ProtocolError: with close code BAD_TICKET if the ticket is malformed,
            forged, or expired.
    """
    try:
        payload_b64, sig_b64 = token.split(".")
        payload, signature = _unb64(payload_b64), _unb64(sig_b64)
    except (ValueError, TypeError):
        raise ProtocolError("bad ticket: not a Crowdtrain ticket", close_code=CloseCode.BAD_TICKET) from None
    if not hmac.compare_digest(signature, _mac(key, payload)):
        raise ProtocolError("bad ticket: signature does not verify", close_code=CloseCode.BAD_TICKET)
    try:
        ticket = from_dict(Ticket, json.loads(payload), unknown=[])  # a newer site may add fields
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(f"bad ticket: {exc}", close_code=CloseCode.BAD_TICKET) from None
    if ticket.expires_at < (time.time() if now is None else now):
        raise ProtocolError(f"ticket for lease {ticket.lease_id} has expired", close_code=CloseCode.BAD_TICKET)
    return ticket


def _receipt_payload(campaign_id: int, lease_id: int, slice_index: int, num_samples: int) -> bytes:
    return f"receipt|{campaign_id}|{lease_id}|{slice_index}|{num_samples}".encode()


def sign_receipt(
    key: bytes, *, campaign_id: int, lease_id: int, slice_index: int, num_samples: int, sketch: bytes = b""
) -> str:
    """The token an aggregator returns after it accepted one slice of a lease.

    ``sketch`` (protocol 2.2: float32 bytes of the slice's gradient sketch, see
    ``crowdtrain_agent.sketch``) rides in the token as ``<sketch>.<signature>``,
    under the signature: the agent relays it to the site and cannot change it,
    so the site compares what the aggregator received, not what an agent claims.
    """
    mac = _b64(_mac(key, _receipt_payload(campaign_id, lease_id, slice_index, num_samples) + sketch))
    return f"{_b64(sketch)}.{mac}" if sketch else mac


def verify_receipt(
    token: str, key: bytes, *, campaign_id: int, lease_id: int, slice_index: int, num_samples: int
) -> bool:
    """Whether ``token`` is the receipt an aggregator would sign for that slice (with or without a sketch)."""
    try:
        sketch = receipt_sketch(token)
    except ValueError:
        return False
    expected = sign_receipt(
        key,
        campaign_id=campaign_id,
        lease_id=lease_id,
        slice_index=slice_index,
        num_samples=num_samples,
        sketch=sketch,
    )
    return hmac.compare_digest(token.encode(), expected.encode())


def receipt_sketch(token: str) -> bytes:
    """The sketch bytes a receipt carries (empty for a receipt without one); check the receipt first.

    Raises:
        ValueError: the token is not a receipt.
    """
    if "." not in token:
        return b""
    head, _, _ = token.partition(".")
    try:
        return _unb64(head)
    except (ValueError, TypeError):
        raise ValueError("not a Crowdtrain receipt") from None
