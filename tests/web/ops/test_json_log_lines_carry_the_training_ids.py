"""With CROWDTRAIN_LOG_FORMAT=json, each line is one JSON object, and the training path's lines carry their ids."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from crowdtrain.scheduler import endings, leasing
from crowdtrain_agent.logformat import JsonFormatter
from tests.conftest import FakeClock
from tests.factories import make_campaign, make_device, work_until_committed

pytestmark = pytest.mark.django_db


@pytest.fixture
def json_lines() -> Iterator[io.StringIO]:
    """The crowdtrain loggers' lines, formatted as the site formats them under CROWDTRAIN_LOG_FORMAT=json."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("crowdtrain")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield stream
    logger.removeHandler(handler)
    logger.setLevel(old_level)


def _records(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_the_training_path_logs_campaign_lease_device_and_step_ids(json_lines: io.StringIO, clock: FakeClock) -> None:
    campaign = make_campaign()
    device, _ = make_device()

    work_until_committed(campaign, [device.pk], 1)
    overdue = leasing.request_lease(device.pk, campaign.pk, None)
    clock.advance(overdue.deadline_s + 60)
    endings.expire_all_overdue()

    records = _records(json_lines)
    assert all({"time", "level", "logger", "message"} <= set(r) for r in records)
    issued = [r for r in records if "issued to device" in str(r["message"])]
    reported = [r for r in records if "reported by device" in str(r["message"])]
    committed = [r for r in records if "step 0 committed" in str(r["message"])]
    expired = [r for r in records if r.get("lease_id") == overdue.lease_id and "expired" in str(r["message"])]
    assert issued and all({r["campaign_id"], r["device_id"]} == {campaign.pk, device.pk} for r in issued)
    assert all(isinstance(r["lease_id"], int) and "step" in r for r in issued + reported)
    assert committed and committed[0]["campaign_id"] == campaign.pk and committed[0]["step"] == 0
    assert expired and expired[0]["campaign_id"] == campaign.pk and expired[0]["level"] == "INFO"


def test_an_exception_stays_on_one_line_with_its_ids() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("tests.ops.json")
    logger.addHandler(handler)
    logger.propagate = False

    try:
        raise ValueError("boom\nsecond line")
    except ValueError:
        logger.exception("failed", extra={"lease_id": 11})
    logger.warning("after")

    failed, after = (json.loads(line) for line in stream.getvalue().splitlines())
    assert failed["lease_id"] == 11 and "ValueError: boom" in failed["exception"]
    assert "lease_id" not in after and after["level"] == "WARNING" and after["logger"] == "tests.ops.json"
