"""The house's shape in four counts (issue 20), printed for a commit's tree:

- modules outside `core/` that write SQL text by hand (a string literal holding a
  statement: SELECT ... FROM, INSERT INTO, UPDATE ... SET, DELETE FROM, a CTE, LISTEN,
  pg_notify), the `sql.py` modules named apart;
- database-vendor branches (`vendor ==` / `vendor !=`, `on_postgresql()`) outside the `sql.py`
  modules;
- files over 400 lines.

Migrations are left out (a migration's SQL is its own). Run from the repository:

    .venv/bin/python bench/house_counts.py [TREE]   # TREE: another checkout (default: this one)
"""

from __future__ import annotations

import io
import re
import sys
import tokenize
from pathlib import Path

ROOT = Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else Path(__file__).resolve().parents[1]
APPS = (
    "doors",
    "backoffice",
    "purchases",
    "payments",
    "fulfillment",
    "core",
    "config",
)  # the product, not its tools
STATEMENT = re.compile(
    r"\bSELECT\b.*\bFROM\b|\bSELECT\s+(1|pg_)|\bINSERT\s+INTO\b|\bUPDATE\b[^\n]*\bSET\b|"
    r"\bDELETE\s+FROM\b|\bWITH\s+\w+\s+AS\s*\(|\bLISTEN\s+[\w{]|\bON CONFLICT\b",
    re.DOTALL,
)
VENDOR = re.compile(r"\bvendor\s*[!=]=|\bon_postgresql\(\)")


def modules() -> list[Path]:
    return sorted(
        path
        for app in APPS
        for path in (ROOT / app).rglob("*.py")
        if "migrations" not in path.parts
    )


def writes_sql(path: Path) -> bool:
    """Whether a string literal (adjacent literals joined, as Python joins them; docstrings
    left out) holds a statement."""
    joined: list[str] = []
    previous = tokenize.NEWLINE  # the last token before the literals: a docstring's is this
    starts = (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING)
    before = previous
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    for token in tokens:
        if token.type == tokenize.STRING:
            if not joined:
                before = previous
            joined.append(token.string)
        elif token.type in (tokenize.NL, tokenize.COMMENT) and joined:
            continue
        else:
            docstring = before in starts and token.type == tokenize.NEWLINE
            if joined and not docstring and STATEMENT.search(" ".join(joined)):
                return True
            joined = []
        if token.type not in (tokenize.NL, tokenize.COMMENT):
            previous = token.type
    return False


def main() -> int:
    found = modules()
    sql = [p for p in found if writes_sql(p)]
    outside_core = [p for p in sql if p.relative_to(ROOT).parts[0] != "core"]
    vendor = [
        (p, n)
        for p in found
        if p.name != "sql.py"
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if VENDOR.search(line)
    ]
    long = [(p, len(p.read_text().splitlines())) for p in found]
    long = [(p, n) for p, n in long if n > 400]
    rel = lambda p: p.relative_to(ROOT)  # noqa: E731
    print(
        f"modules outside core/ writing SQL by hand: {len(outside_core)}"
        f" ({sum(p.name == 'sql.py' for p in outside_core)} of them sql.py)"
    )
    for p in outside_core:
        print(f"  {rel(p)}")
    print(f"vendor branches outside sql.py modules: {len(vendor)}")
    for p, n in vendor:
        print(f"  {rel(p)}:{n}")
    print(f"files over 400 lines: {len(long)}")
    for p, n in sorted(long, key=lambda row: -row[1]):
        print(f"  {n:5d}  {rel(p)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
