"""docs/settings.md's agent tables list every environment variable the agent reads, and nothing else."""

from __future__ import annotations

from crowdtrain_agent.config import ENV_PREFIX
from tests.settings_tables import ROOT, documented, mismatch, python_files, read_in


def test_every_variable_the_agent_reads_has_a_row_and_every_row_is_read() -> None:
    read = read_in(python_files(ROOT / "agent" / "src" / "crowdtrain_agent"), ENV_PREFIX)

    listed = documented("The agent (`crowdtrain-agent run`) takes")
    listed |= {ENV_PREFIX + suffix for suffix in documented("Each control's variable is")}

    assert read == listed, mismatch(read, listed, "the agent's tables in docs/settings.md")
