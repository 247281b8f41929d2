"""`make bench`: prepare the bench database, run every registered benchmark, print one table.

    make bench                       # the full run docs/benchmarks.md records
    make bench BENCH_SCALE=smoke     # tiny and once: proves the bench still runs (CI)
    .venv/bin/python bench/run.py --scale smoke --database-url postgres://.../other_db --fresh

The bench database is DATABASE_URL's server with the database `tollbooth_bench` (or
--database-url), created if missing (`--fresh` drops it first) and migrated. REDIS_URL is
required: the bench serves the production settings, which need it. Every figure is a ratio
against an anchor measured in the same run (docs/benchmarks.md says why). The table is
also written as JSON (var/bench/last.json). Exits 1 when a benchmark that is present fails.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import secrets
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the repository's packages
    sys.path.insert(0, str(ROOT))

from bench.common import Figure, Scale  # noqa: E402

# Every benchmark, by module; each exposes `run(scale) -> list[Figure]`. Imported only when
# run, so a module that is not there yet (written on another branch) is a "not present" row.
REGISTRY = (
    "bench.api_overhead",  # replay vs bare endpoint; prepaid purchase vs one-INSERT endpoint
    "bench.x402_seller",  # paid x402 call vs the x402 SDK's FastAPI seller; settlements
    "bench.scale",  # reconciliation of 10,000 pending; admin pages and CSV at 1M rows
    "bench.rpc_hot_path",  # a direct settlement's chain CPU: web3 (before) vs plain JSON-RPC
    "bench.webhooks_load",  # purchases' p50 with webhooks (1 dead, 1 slow endpoint) vs without
)
DEFAULT_DATABASE = "tollbooth_bench"
NOT_PRESENT = "not present"


@dataclass
class Row:
    figure: str
    module: str
    min: float | None = None
    median: float | None = None
    max: float | None = None
    goal: str = ""
    met: bool | None = None
    detail: str = ""
    ratios: list[float] | None = None
    extra: dict[str, str] | None = None
    status: str = "measured"  # measured | not present | failed

    @classmethod
    def of(cls, module: str, figure: Figure) -> Row:
        return cls(
            figure=figure.name,
            module=module,
            min=figure.minimum,
            median=figure.median,
            max=figure.maximum,
            goal=figure.goal,
            met=figure.meets_goal(),
            detail=figure.detail,
            ratios=list(figure.ratios),
            extra=dict(figure.extra),
        )


def bench_database_url(base_url: str, name: str = DEFAULT_DATABASE) -> str:
    """DATABASE_URL's server, another database on it."""
    parts = urlsplit(base_url)
    if not parts.scheme.startswith("postgres"):
        raise SystemExit(
            "bench: DATABASE_URL must point at PostgreSQL (the bench serves production)."
        )
    return urlunsplit(parts._replace(path=f"/{name}"))


def prepare_database(url: str, fresh: bool) -> None:
    """Create the database if missing (drop it first when fresh), on the same server."""
    import psycopg
    from psycopg import sql

    parts = urlsplit(url)
    name = parts.path.lstrip("/")
    admin_url = urlunsplit(parts._replace(path="/postgres"))
    with psycopg.connect(admin_url, autocommit=True) as admin:
        if fresh:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )
        exists = admin.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone()
        if not exists:
            admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))


def bench_environment(database_url: str) -> dict[str, str]:
    """What a deployment supplies, for the bench's own server and this process."""
    return {
        "DATABASE_URL": database_url,
        "DJANGO_SETTINGS_MODULE": "bench.settings",
        "DJANGO_SECRET_KEY": secrets.token_urlsafe(48),
        "DJANGO_ALLOWED_HOSTS": "127.0.0.1,localhost",
        "TOLLBOOTH_METRICS_TOKEN": secrets.token_urlsafe(24),
        "TOLLBOOTH_RECEIPT_KEY": "0x" + secrets.token_hex(32),  # generated: never a stored key
        # Throttles stay on (their counters are part of the cost) at a rate no run reaches.
        "TOLLBOOTH_THROTTLE_API_KEY_RATE": "10000000/min",
        "TOLLBOOTH_THROTTLE_ADDRESS_RATE": "10000000/min",
        # Jobs the purchases stage go to a queue of the bench's own, emptied at the end.
        "TOLLBOOTH_CELERY_QUEUE": f"tollbooth-bench-{os.getpid()}",
        "LOG_LEVEL": os.environ.get("LOG_LEVEL", "WARNING"),
        "GUNICORN_ACCESS_LOG": os.environ.get("GUNICORN_ACCESS_LOG", "-"),
    }


def setup_django() -> None:
    import django
    from django.core.management import call_command
    from django.db import connection

    django.setup()
    from bench.anchors import CREATE_ANCHOR_TABLE  # DRF: only once Django is set up

    call_command("migrate", "--noinput", verbosity=0)
    with connection.cursor() as cursor:
        cursor.execute(CREATE_ANCHOR_TABLE)


def drop_bench_queue() -> None:
    """The jobs the bench's purchases staged: no worker runs them; drop them with the queue."""
    from django.conf import settings
    from redis import Redis

    queue = settings.CELERY_TASK_DEFAULT_QUEUE
    # The queue, and the binding keys kombu's Redis transport keeps beside it.
    Redis.from_url(settings.REDIS_URL).delete(
        queue, f"_kombu.binding.{queue}", f"_kombu.binding_permanent.{queue}"
    )


def run_module(module_name: str, scale: Scale) -> list[Row]:
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name != module_name:
            raise
        return [Row(figure=module_name, module=module_name, detail=NOT_PRESENT, status=NOT_PRESENT)]
    started = time.monotonic()
    figures: list[Figure] = module.run(scale)
    print(f"bench: {module_name} done in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return [Row.of(module_name, figure) for figure in figures]


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _met(row: Row) -> str:
    if row.status != "measured":
        return "-"
    return {True: "yes", False: "NO", None: "-"}[row.met]


def table(rows: list[Row]) -> str:
    header = ("figure", "min", "median", "max", "goal", "met?", "detail")
    lines = [
        (
            r.figure,
            _number(r.min),
            _number(r.median),
            _number(r.max),
            r.goal or "-",
            _met(r),
            r.detail,
        )
        for r in rows
    ]
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header[:-1])]

    def render(cells: tuple[str, ...]) -> str:
        return " | ".join(
            [*(c.ljust(w) for c, w in zip(cells[:-1], widths, strict=True)), cells[-1]]
        )

    rule = "-+-".join("-" * w for w in widths) + "-+-" + "-" * 6
    return "\n".join([render(header), rule, *(render(line) for line in lines)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scale", choices=[s.value for s in Scale], default=Scale.FULL.value)
    parser.add_argument(
        "--database-url", help=f"default: DATABASE_URL's server, database {DEFAULT_DATABASE}"
    )
    parser.add_argument(
        "--fresh", action="store_true", help="drop and recreate the bench database first"
    )
    parser.add_argument("--json", type=Path, default=ROOT / "var" / "bench" / "last.json")
    parser.add_argument("--only", nargs="*", help="run only these registered modules")
    args = parser.parse_args(argv)
    scale = Scale(args.scale)

    base_url = args.database_url or os.environ.get("DATABASE_URL", "")
    if not base_url:
        print("bench: set DATABASE_URL (PostgreSQL) or pass --database-url.", file=sys.stderr)
        return 2
    if not os.environ.get("REDIS_URL"):
        print(
            "bench: set REDIS_URL (the production settings the bench serves need it).",
            file=sys.stderr,
        )
        return 2
    database_url = args.database_url or bench_database_url(base_url)
    started = time.monotonic()
    prepare_database(database_url, fresh=args.fresh)
    os.environ.update(bench_environment(database_url))
    setup_django()
    print(f"bench: database ready in {time.monotonic() - started:.0f} s", file=sys.stderr)

    load_at_start = os.getloadavg()
    modules = [m for m in REGISTRY if not args.only or m in args.only]
    rows: list[Row] = []
    failed = False
    try:
        for module_name in modules:
            try:
                rows.extend(run_module(module_name, scale))
            except Exception as error:  # one broken benchmark must not hide the others' figures
                failed = True
                traceback.print_exc()
                rows.append(
                    Row(
                        figure=module_name,
                        module=module_name,
                        detail=f"failed: {error!r}"[:300],
                        status="failed",
                    )
                )
    finally:
        drop_bench_queue()

    report = _report(rows, scale, database_url, load_at_start)
    print(table(rows))
    machine = report["machine"]
    print(
        f"\n{scale.value} run on {machine['cpus']} x {machine['cpu_model']}; load average "
        f"{machine['load_at_start']} at start, {machine['load_at_end']} at end (shared machine)"
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nbench: table written to {args.json}", file=sys.stderr)
    return 1 if failed else 0


def _report(
    rows: list[Row], scale: Scale, database_url: str, load_at_start: tuple[float, float, float]
) -> dict[str, Any]:
    return {
        "scale": scale.value,
        "finished_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {
            "cpus": os.cpu_count(),
            "cpu_model": cpu_model(),
            # The 1-minute load average: the machine is shared, hence ratios.
            "load_at_start": round(load_at_start[0], 2),
            "load_at_end": round(os.getloadavg()[0], 2),
        },
        "database": urlsplit(database_url).path.lstrip("/"),
        "figures": [asdict(row) for row in rows],
    }


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    sys.exit(main())
