"""docs/settings.md's aggregator table lists every environment variable the aggregator reads, and nothing else."""

from __future__ import annotations

from dataclasses import fields

from crowdtrain_backbone.config import ENV_PREFIX, BackboneConfig
from tests.settings_tables import ROOT, documented, mismatch, python_files, read_in


def test_every_variable_the_aggregator_reads_has_a_row_and_every_row_is_read() -> None:
    # load_config reads every field of the config as ENV_PREFIX + its name, besides the literal reads.
    read = read_in(python_files(ROOT / "platform" / "crowdtrain_backbone"), ENV_PREFIX)
    read |= {ENV_PREFIX + field.name.upper() for field in fields(BackboneConfig)}

    listed = documented("The aggregator (`python -m crowdtrain_backbone`) reads")

    assert read == listed, mismatch(read, listed, "the aggregator's table in docs/settings.md")
