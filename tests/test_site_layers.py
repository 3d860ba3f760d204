"""The site's imports point one way: each app builds on the apps below it, never on those above (issue 35).

Read from the source, every import statement including those inside functions:
a lazy import is still a dependency a reader must follow. The layers, lowest
first, are ``LAYERS``; the rules and the reasons are in docs/architecture.md.

- A service module (anything not at the site's edge) imports only its own app,
  apps below it, and ``crowdtrain.lib``. The scheduler core reaches the services
  above it through ``scheduler/seam.py``; models changing tell the layers above
  them by Django signals (``campaigns.signals``, ``devices.signals``).
- Edge modules (views, pages, URLs, admin, forms, app configs, management
  commands, the gateway's consumers) may use any app's services, and no service
  imports an edge module.
- ``crowdtrain.lib`` imports no app.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

SITE = Path(__file__).resolve().parents[1] / "platform" / "crowdtrain"

# Lowest first. The helpers left at the package root (env, batchsql, periodic) rank with lib.
LAYERS = ["lib", "accounts", "datasets", "browser", "campaigns", "scheduler", "devices", "credit", "verification",
          "ops", "gateway"]  # fmt: skip
# The site's wiring at its root: it assembles every app.
WIRING = {
    "crowdtrain",
    "crowdtrain.settings",
    "crowdtrain.urls",
    "crowdtrain.asgi",
    "crowdtrain.celery",
}
# A module whose name (or one of its packages) says it is at the site's edge.
EDGE_NAMES = {"views", "pages", "api", "urls", "admin", "forms", "apps", "routing", "consumers", "templatetags",
              "management"}  # fmt: skip


def _modules() -> dict[str, Path]:
    found = {}
    for path in SITE.rglob("*.py"):
        if "migrations" in path.parts:
            continue
        parts = ("crowdtrain", *path.relative_to(SITE).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The site modules ``name`` imports, wherever in it the import is."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        # The package root itself is only the Celery app's wiring, imported along with any of its modules.
        found |= {target for target in targets if target in MODULES and target not in (name, "crowdtrain")}
    return found


IMPORTS = {name: _imports(name, path) for name, path in MODULES.items()}


def app_of(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 2 else "lib"  # the root's helpers rank with lib


def is_edge(name: str) -> bool:
    parts = name.split(".")
    return name in WIRING or any(part in EDGE_NAMES or part.endswith("_views") for part in parts[2:])


def _violations() -> list[str]:
    found = []
    for name, imported in sorted(IMPORTS.items()):
        if is_edge(name):
            continue
        rank = LAYERS.index(app_of(name))
        for other in sorted(imported):
            if is_edge(other):
                found.append(f"{name} imports {other}, an edge module: a service never builds on a page")
            elif LAYERS.index(app_of(other)) > rank:
                found.append(f"{name} imports {other}, of {app_of(other)}, a layer above {app_of(name)}")
    return found


def test_every_app_of_the_site_has_a_layer() -> None:
    apps = {app_of(name) for name in MODULES}
    assert apps <= set(LAYERS), f"give these apps a place in LAYERS (and docs/architecture.md): {apps - set(LAYERS)}"


def test_no_service_imports_a_layer_above_it_or_a_page() -> None:
    violations = _violations()
    assert not violations, "imports against the layers:\n" + "\n".join(violations)


def test_no_import_circle_between_apps() -> None:
    # Implied by the layers for services; checked on its own so a circle is named whole when one appears.
    between: dict[str, set[str]] = defaultdict(set)
    for name, imported in IMPORTS.items():
        if not is_edge(name):
            between[app_of(name)] |= {app_of(other) for other in imported if app_of(other) != app_of(name)}

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})) for nxt in between[start])

    circles = sorted(app for app in between if reaches(app, app, {app}))
    assert not circles, f"apps that import themselves through others: {circles}"


@pytest.mark.parametrize("bad", ["crowdtrain.scheduler.leasing", "crowdtrain.lib.metrics"])
def test_the_rule_catches_an_import_upwards(bad: str) -> None:
    # The check itself can fail: an import of the gateway from the scheduler core or lib is caught.
    IMPORTS[bad].add("crowdtrain.gateway.outbox")
    try:
        assert any(v.startswith(f"{bad} imports crowdtrain.gateway.outbox") for v in _violations())
    finally:
        IMPORTS[bad].discard("crowdtrain.gateway.outbox")
