"""An organizer, her logged-in client and a text dataset she owns: what the campaign form tests start from."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import AbstractBaseUser
from django.test import Client

from crowdtrain.datasets.models import Dataset
from tests.factories import make_organizer, make_text_dataset


@pytest.fixture
def olga() -> AbstractBaseUser:
    return make_organizer("olga")


@pytest.fixture
def organizer_client(client: Client, olga: AbstractBaseUser) -> Client:
    client.force_login(olga)
    return client


@pytest.fixture
def text_dataset(olga: AbstractBaseUser) -> Dataset:
    dataset = make_text_dataset()  # samples of 9 bytes: a gpt with block_size 8
    Dataset.objects.filter(pk=dataset.pk).update(owner=olga)
    return Dataset.objects.get(pk=dataset.pk)
