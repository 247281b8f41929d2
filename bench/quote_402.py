"""What one unpaid anonymous 402 costs, two trees side by side in paired rounds (issue 22 §4):
CPU per 402 (this process, median), SQL statements and writes per 402, rows and bytes
written per 402 (the quote's and its event's rows, as PostgreSQL stores them).

Each round starts both trees at once (`--sequential`: one after the other, the order swapped
every round), each on its own database (DATABASE_URL's name + `_q402a` / `_q402b`, created
and migrated on first use), each POSTing the same valid input to /x402/<offering> through
Django's test client (the whole view: throttle, parsing, validation, sign-in challenge,
PAYMENT-REQUIRED). The figure is the median of the per-round CPU ratios after/before:

    DATABASE_URL=postgres://.../db REDIS_URL=redis://... .venv/bin/python bench/quote_402.py \\
        --before /work/main --after . --rounds 7 --requests 200 --input-kb 4

The worker (`--worker`) runs inside the tree it measures (cwd), so the same script measures
a tree that does not contain it.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
SLUG = "bench-402"


def worker(requests: int, input_kb: int) -> dict[str, Any]:
    sys.path.insert(0, os.getcwd())
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings.test")
    import django

    django.setup()
    from django.db import connection
    from django.test.utils import CaptureQueriesContext, setup_test_environment
    from rest_framework.test import APIClient

    setup_test_environment()
    connection.creation.create_test_db(verbosity=0, autoclobber=True, keepdb=True)
    from purchases.models import PurchaseEvent, Quote
    from tests.factories import OfferingFactory

    PurchaseEvent.objects.filter(quote__offering__slug=SLUG, purchase__isnull=True).delete()
    Quote.objects.filter(offering__slug=SLUG).delete()
    OfferingFactory.create(slug=SLUG)
    # Random cells: an input PostgreSQL cannot compress (the worst case for what is stored).
    rows = ["region,units"] + [f"{secrets.token_hex(3)},{i}" for i in range(input_kb * 1024 // 8)]
    body = {"title": "Sales", "csv": "\n".join(rows)[: input_kb * 1024]}
    client = APIClient()

    def ask() -> None:
        answer = client.post(f"/x402/{SLUG}", body, format="json")
        assert answer.status_code == 402, answer.content

    for _ in range(20):
        ask()
    with CaptureQueriesContext(connection) as captured:
        ask()
    control = ("SAVEPOINT", "RELEASE", "ROLLBACK", "BEGIN", "COMMIT")
    sql = [q["sql"] for q in captured.captured_queries]
    statements = [s for s in sql if not s.startswith(control)]
    writes = [s for s in statements if s.startswith(("INSERT", "UPDATE", "DELETE"))]
    last_quote = Quote.objects.order_by("-pk").values_list("pk", flat=True).first() or 0
    last_event = PurchaseEvent.objects.order_by("-pk").values_list("pk", flat=True).first() or 0
    cpu: list[float] = []
    for _ in range(requests):
        start = time.process_time()
        ask()
        cpu.append((time.process_time() - start) * 1000)
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*), coalesce(sum(pg_column_size(q.*)), 0), "
            "coalesce(sum(octet_length(q.canonical_input::text)), 0) FROM purchases_quote q "
            "WHERE q.id > %s",
            [last_quote],
        )
        quotes, quote_bytes, input_text_bytes = cursor.fetchone()
        cursor.execute(
            "SELECT count(*), coalesce(sum(pg_column_size(e.*)), 0) FROM purchases_purchaseevent e "
            "WHERE e.id > %s",
            [last_event],
        )
        events, event_bytes = cursor.fetchone()
    return {
        "cpu_ms": statistics.median(cpu),
        "statements": len(statements),
        "statements_with_control": len(sql),
        "writes": len(writes),
        "rows_per_402": (quotes + events) / requests,
        "bytes_per_402": (quote_bytes + event_bytes) / requests,
        # What the rows carry before PostgreSQL compresses the input (TOAST): sent and logged.
        "input_text_bytes_per_402": input_text_bytes / requests,
        "input_bytes": len(json.dumps(body)),
    }


def _start(tree: Path, database_url: str, requests: int, input_kb: int) -> subprocess.Popen[str]:
    env = {**os.environ, "DATABASE_URL": database_url}
    command = [str(tree / ".venv/bin/python"), str(HERE), "--worker"]
    command += ["--requests", str(requests), "--input-kb", str(input_kb)]
    return subprocess.Popen(
        command, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _result(tree: Path, running: subprocess.Popen[str]) -> dict[str, Any]:
    stdout, stderr = running.communicate()
    if running.returncode:
        sys.exit(f"{tree}: the worker failed\n{stdout[-3000:]}\n{stderr[-3000:]}")
    return dict(json.loads(stdout.strip().splitlines()[-1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--before", type=Path)
    parser.add_argument("--after", type=Path, default=Path("."))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--input-kb", type=int, default=4)
    parser.add_argument("--sequential", action="store_true")
    # The per-address throttle's default (TOLLBOOTH_THROTTLE_ADDRESS_RATE): 402s a minute.
    parser.add_argument("--throttle-per-min", type=int, default=120)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.requests, args.input_kb)))
        return 0
    if args.before is None:
        parser.error("--before is required")
    base = os.environ["DATABASE_URL"]
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    urls = {"before": f"{base}_q402a", "after": f"{base}_q402b"}
    rounds: list[dict[str, dict[str, Any]]] = []
    for index in range(args.rounds):
        order = ["before", "after"] if index % 2 == 0 else ["after", "before"]
        if args.sequential:
            results = {}
            for side in order:
                results[side] = _result(
                    trees[side], _start(trees[side], urls[side], args.requests, args.input_kb)
                )
        else:
            running = {
                side: _start(trees[side], urls[side], args.requests, args.input_kb)
                for side in order
            }
            results = {side: _result(trees[side], proc) for side, proc in running.items()}
        rounds.append(results)
        print(
            f"round {index + 1}: cpu before {results['before']['cpu_ms']:.2f} ms, "
            f"after {results['after']['cpu_ms']:.2f} ms, "
            f"ratio {results['after']['cpu_ms'] / results['before']['cpu_ms']:.3f}",
            flush=True,
        )
    ratios = [r["after"]["cpu_ms"] / r["before"]["cpu_ms"] for r in rounds]
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(
        f"CPU per anonymous 402 after/before, {args.rounds} rounds x {args.requests}, "
        f"input {rounds[0]['after']['input_bytes']} B: min {min(ratios):.3f} "
        f"median {statistics.median(ratios):.3f} max {max(ratios):.3f}"
    )
    for side in ("before", "after"):
        last = rounds[-1][side]
        cpus = [r[side]["cpu_ms"] for r in rounds]
        print(
            f"{side}: cpu median {statistics.median(cpus):.2f} ms; statements {last['statements']} "
            f"({last['statements_with_control']} with transaction control), writes "
            f"{last['writes']}, rows {last['rows_per_402']:.2f}, bytes {last['bytes_per_402']:.0f}"
            f" stored ({last['input_text_bytes_per_402']:.0f} of input before compression) per "
            f"402; at {args.throttle_per_min}/min per address: "
            f"{last['rows_per_402'] * args.throttle_per_min:.0f} rows, "
            f"{last['bytes_per_402'] * args.throttle_per_min / 1e6:.2f} MB stored, "
            f"{last['input_text_bytes_per_402'] * args.throttle_per_min / 1e6:.2f} MB of input "
            "a minute"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
