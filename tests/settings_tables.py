"""What docs/settings.md's tables list, and what each program's source reads from the environment.

The tests built on these keep the two in step: a variable added to the code
without a row, or a row whose variable nothing reads any more, fails a test
that names it.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS_DOC = ROOT / "docs" / "settings.md"

# Receivers whose .get(NAME) / [NAME] read an environment variable: os.environ, or a mapping
# passed in its place and named after it (load_config(flags, environ), login_server(..., env)).
ENVIRON_NAMES = {"environ", "env"}
VARIABLE = re.compile(r"`([A-Z][A-Z0-9_]*)`")


def documented(table_after: str) -> set[str]:
    """The variables named (in backquotes) in the first column of the first table after a line.

    Args:
        table_after: the start of a line of docs/settings.md that precedes the table, e.g. ``"The site reads"``.
    """
    lines = SETTINGS_DOC.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(table_after))
    rows = []
    for line in lines[start + 1 :]:
        if line.startswith("|"):
            rows.append(line)
        elif rows:
            break
    names: set[str] = set()
    for row in rows[2:]:  # after the header and its |---| line
        names.update(VARIABLE.findall(row.split("|")[1]))
    return names


def _name(node: ast.expr, prefix: str) -> str | None:
    """The variable a read names: a string literal, or ENV_PREFIX + a string literal."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) and isinstance(node.right, ast.Constant):
        left = node.left
        if (isinstance(left, ast.Name) and left.id == "ENV_PREFIX") or (
            isinstance(left, ast.Attribute) and left.attr == "ENV_PREFIX"
        ):
            return prefix + str(node.right.value)
    return None


def _is_environ(node: ast.expr) -> bool:
    return (isinstance(node, ast.Name) and node.id in ENVIRON_NAMES) or (
        isinstance(node, ast.Attribute) and node.attr == "environ"
    )


def read_in(files: Iterable[Path], prefix: str = "") -> set[str]:
    """Every environment variable the given modules read by name.

    Counted: ``env_*("NAME", ...)`` (the site's typed readers), ``os.getenv(NAME)``,
    ``environ.get(NAME)`` and ``environ[NAME]``, and ``Setting(..., env=NAME)``, a setting of
    the loader (``crowdtrain_agent.settings_loader``). ``NAME`` is a literal or ``ENV_PREFIX +
    literal``; a name computed any other way is not seen, so keep reads literal.
    """
    names: set[str] = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            found: str | None = None
            if isinstance(node, ast.Call) and node.args:
                func = node.func
                if isinstance(func, ast.Name) and func.id.startswith("env_"):
                    found = _name(node.args[0], prefix)
                elif isinstance(func, ast.Name) and func.id == "Setting":
                    env = next((keyword.value for keyword in node.keywords if keyword.arg == "env"), None)
                    found = None if env is None else _name(env, prefix)
                elif isinstance(func, ast.Attribute) and (
                    func.attr == "getenv" or (func.attr == "get" and _is_environ(func.value))
                ):
                    found = _name(node.args[0], prefix)
            elif isinstance(node, ast.Subscript) and _is_environ(node.value):
                found = _name(node.slice, prefix)
            if found is not None:
                names.add(found)
    return names


def python_files(folder: Path, *, skip: Iterable[str] = ()) -> list[Path]:
    """The modules of a package folder, migrations and the named files left out."""
    skipped = set(skip)
    return [
        path for path in sorted(folder.rglob("*.py"))
        if "migrations" not in path.parts and path.name not in skipped
    ]  # fmt: skip


def mismatch(read: set[str], listed: set[str], where: str) -> str:
    """An assertion message naming what to add to, or remove from, the table."""
    parts = []
    if read - listed:
        parts.append(f"read but not in the table: {', '.join(sorted(read - listed))} (add a row to {where})")
    if listed - read:
        parts.append(f"in the table but read nowhere: {', '.join(sorted(listed - read))} (remove the row)")
    return "; ".join(parts)
