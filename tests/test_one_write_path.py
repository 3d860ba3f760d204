"""Hand-written SQL lives in one module, ``crowdtrain/lib/batchsql.py`` (issue 35).

Every other module writes through the ORM, and no module outside it chooses a statement by backend:
a table whose rows are written by a statement here on PostgreSQL and by model saves elsewhere on
SQLite has two write paths that can drift apart. Read from the source, as the layer test does.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SQL_HOME = ROOT / "platform" / "crowdtrain" / "lib" / "batchsql.py"
# A string that opens with a statement's keyword, as SQL is written in this codebase (upper case).
STATEMENT = re.compile(r"^\s*(INSERT INTO|UPDATE \S+ SET|DELETE FROM|SELECT \S.* FROM|WITH \w+ AS \()")


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def findings(source: str, name: str) -> list[str]:
    """Where ``source`` writes SQL by hand or asks which backend it runs on."""
    tree = ast.parse(source, name)
    docstrings = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            docstrings |= {id(part) for part in node.values}  # read whole below, with its fields as {}
            text = "".join(p.value if isinstance(p, ast.Constant) else "{}" for p in node.values)
            if STATEMENT.match(str(text)):
                found.append(f"{name}:{node.lineno}: SQL {text.strip()[:40]!r}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            if STATEMENT.match(node.value):
                found.append(f"{name}:{node.lineno}: SQL {node.value.strip()[:40]!r}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in {"raw", "extra"}:
            found.append(f"{name}:{node.lineno}: {ast.unparse(node.func)}()")
        elif isinstance(node, ast.Attribute) and node.attr in {"cursor", "vendor"}:
            if isinstance(node.value, ast.Name) and node.value.id == "connection":  # not a Redis pipeline's cursor
                found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Name) and node.id == "RawSQL":
            found.append(f"{name}:{node.lineno}: RawSQL")
    return found


def _sources() -> list[Path]:
    # The site's tables; the launcher's statements create databases, not rows.
    site = ROOT / "platform" / "crowdtrain"
    return sorted(path for path in site.rglob("*.py") if "migrations" not in path.parts and path != SQL_HOME)


def test_no_module_but_batchsql_writes_sql_or_picks_a_backend() -> None:
    found = [hit for path in _sources() for hit in findings(path.read_text(), str(path.relative_to(ROOT)))]
    assert not found, "move these statements into crowdtrain/lib/batchsql.py (one write path per table):\n" + "\n".join(
        found
    )


def test_batchsql_is_where_the_statements_are() -> None:
    # The home itself holds statements: the scan above would pass vacuously if it could see none.
    assert len(findings(SQL_HOME.read_text(), "batchsql.py")) >= 8


@pytest.mark.parametrize(
    "snippet",
    [
        'db.execute(f"UPDATE {t} SET a = 1")',
        "if connection.vendor == 'postgresql': pass",
        "with connection.cursor() as db: pass",
        "Lease.objects.raw('x')",
        "qs.annotate(x=RawSQL('1', []))",
        'sql = "INSERT INTO leases VALUES (1)"',
    ],
)
def test_the_scan_catches(snippet: str) -> None:
    assert findings(snippet, "snippet.py")


@pytest.mark.parametrize(
    "snippet",
    [
        '"""UPDATE rows SET nothing: a docstring may say so."""',
        "pipe = redis.pipeline(); pipe.cursor",
        "x = 'Select a file'",
    ],
)
def test_the_scan_leaves_alone(snippet: str) -> None:
    assert not findings(snippet, "snippet.py")
