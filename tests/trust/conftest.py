"""The trust tests run real programs: the e2e folder's fixtures (a seeded swarm per run)."""

from tests.e2e.conftest import seeded_run, service_env  # noqa: F401  (fixtures, found by name)
