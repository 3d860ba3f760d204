"""docs/settings.md's site table lists every environment variable the site reads, and nothing else."""

from __future__ import annotations

import ast

from tests.settings_tables import ROOT, documented, mismatch, python_files, read_in

SITE = ROOT / "platform" / "crowdtrain"


def test_every_variable_the_site_reads_has_a_row_and_every_row_is_read() -> None:
    read = read_in(python_files(SITE))

    listed = documented("The site reads its settings")

    assert read == listed, mismatch(read, listed, "the site's table in docs/settings.md")


def test_settings_read_the_environment_only_through_the_typed_readers() -> None:
    tree = ast.parse((SITE / "settings.py").read_text())

    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}

    # A direct os.environ read would escape both the checks of crowdtrain.env and the scan above.
    assert "os" not in imported
