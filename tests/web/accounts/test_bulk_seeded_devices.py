"""seed_run's bulk_agents: many devices at once, each with a working token that is stored only as a hash."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from django.core.management import call_command

from crowdtrain.accounts.models import Device, Profile
from crowdtrain.accounts.tokens import hash_token

pytestmark = pytest.mark.django_db


def _seed(tmp_path: Path, spec: dict[str, object]) -> dict[str, object]:
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    out = io.StringIO()
    call_command("seed_run", "--spec", str(spec_path), stdout=out)
    return json.loads(out.getvalue())


def test_it_creates_bulk_devices_whose_tokens_authenticate(tmp_path: Path) -> None:
    seeded = _seed(tmp_path, {"bulk_agents": 5})

    tokens = seeded["bulk_agents"]
    assert isinstance(tokens, list) and len(tokens) == 5
    devices = [Device.authenticate(token) for token in tokens]
    assert [d.name for d in devices if d is not None] == [f"sim-{i}" for i in range(1, 6)]
    assert len({d.owner_id for d in devices if d is not None}) == 5  # one volunteer per device


def test_it_stores_bulk_tokens_only_as_hashes(tmp_path: Path) -> None:
    tokens = _seed(tmp_path, {"bulk_agents": 3})["bulk_agents"]

    stored = set(Device.objects.values_list("token_hash", flat=True))
    assert isinstance(tokens, list)
    assert stored == {hash_token(token) for token in tokens}
    assert not stored & set(tokens)


def test_it_gives_bulk_volunteers_profiles(tmp_path: Path) -> None:
    _seed(tmp_path, {"bulk_agents": 2})

    assert Profile.objects.filter(user__devices__name__startswith="sim-").count() == 2
