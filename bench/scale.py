"""Reconciliation and the back office at scale (issue 11, item 4).

Figures:
- reconciliation of N pending x402 settlements on a local anvil chain (10,000 full, 100
  smoke), half landed (confirmed) and half expired (failed): ratio = one round trip per
  settlement / the round trips made (goal >= 50); wall seconds in the detail (goal <= 10 s);
- the purchase admin at 1M purchases (full; 3,000 smoke): the list, each search kind and
  the purchase page; the refund admin (1M owed refunds): its list and searches; each
  through the real admin views with a logged-in superuser. Anchor: the
  admin index page in the same run (same session, user and template machinery, no purchase
  query), so the ratio is what the purchase table costs on top of any admin page. The
  absolute goal (<= 300 ms, <= 10 queries) is judged in the detail;
- the refund-owed CSV export of every refund (1M full), in a fresh process: ratio = its
  peak RSS / the same process's RSS before the export (the goal, <= 150 MB, in the detail).

The rows are seeded once with generate_series into the bench's own database
(`tollbooth_bench_scale_<scale>` on DATABASE_URL's server, or BENCH_SCALE_DATABASE), and
reused while they are there.

Run: `DATABASE_URL=postgres://... REDIS_URL=... .venv/bin/python -m bench.scale [smoke|full]
[reconciliation] [admin] [export]` (no figure names: all three).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from bench.common import Figure, Scale

REPO = Path(__file__).resolve().parents[1]
ADMIN_REPEATS = 5
SIZES = {
    Scale.SMOKE: {"purchases": 3_000, "settlements": 100, "export_timeout": 120},
    Scale.FULL: {"purchases": 1_000_000, "settlements": 10_000, "export_timeout": 900},
}
NETWORK = "eip155:31337"
ASSET = "0x" + "a0" * 20
PAY_TO = "0x" + "5e" * 20


# --- the bench's own database ----------------------------------------------------------------
def _bench_database_url(scale: Scale) -> str:
    base = os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/tollbooth")
    parts = urlsplit(base)
    # A name of one's own keeps two people's runs (and seeds) apart on one server.
    name = os.environ.get("BENCH_SCALE_DATABASE") or f"tollbooth_bench_scale_{scale.value}"
    return urlunsplit(parts._replace(path=f"/{name}"))


def _ensure_database(url: str) -> None:
    import psycopg

    parts = urlsplit(url)
    admin = urlunsplit(parts._replace(path="/postgres"))
    with psycopg.connect(admin, autocommit=True) as conn:
        name = parts.path.lstrip("/")
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone()
        if not exists:
            conn.execute(f'CREATE DATABASE "{name}"')


def _setup_django(scale: Scale) -> str:
    url = _bench_database_url(scale)
    _ensure_database(url)
    os.environ["DATABASE_URL"] = url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings.test")
    import django

    django.setup()
    from django.core.management import call_command
    from django.test.utils import setup_test_environment

    setup_test_environment()  # 'testserver' allowed, mail kept in memory
    call_command("migrate", verbosity=0)
    return url


# --- seeding: 1M purchases with their attempt, payment id and an owed refund ---------------
def _offering() -> Any:
    from purchases.models import Offering

    offering = Offering.objects.filter(slug="bench-scale").first()
    if offering is None:
        from tests.factories import OfferingFactory

        offering = OfferingFactory.create(
            slug="bench-scale", asset=ASSET, network=NETWORK, pay_to=PAY_TO, price=250_000
        )
    return offering


def _seed(count: int) -> None:
    from django.db import connection

    from purchases.models import Purchase

    if Purchase.objects.filter(ref__startswith="pur_seed").count() >= count:
        return
    offering = _offering()
    started = time.monotonic()
    tables = (
        "purchases_quote",
        "purchases_purchase",
        "purchases_idempotencyrecord",
        "payments_paymentattempt",
        "payments_refund",
    )
    with connection.cursor() as cursor:
        # Ids above every row already there (the bench database may hold other figures' rows).
        highest = ", ".join(f"COALESCE((SELECT max(id) FROM {t}), 0)" for t in tables)  # noqa: S608
        cursor.execute(f"SELECT GREATEST({highest})")
        base = int(cursor.fetchone()[0])
    params = {
        "lo": base + 1,
        "hi": base + count,
        "offering": offering.pk,
        "asset": ASSET,
        "network": NETWORK,
    }
    statements = [
        """INSERT INTO purchases_quote (id, public_id, quote_key, canonical_input, input_hash,
             price, asset, network, pay_to, offering_version, holds_stock, expires_at,
             created_at, state, offering_id)
           SELECT i, 'qt_seed' || i, 'seed' || i, '{}', 'h', 250000, %(asset)s, %(network)s,
             %(asset)s, 1, false, now(), now() - (%(hi)s - i) * interval '30 seconds',
             'accepted', %(offering)s
           FROM generate_series(%(lo)s, %(hi)s) i""",
        """INSERT INTO purchases_purchase (id, ref, amount, asset, network, rail, channel,
             payer, reason_code, created_at, updated_at, payment_state, fulfillment_state,
             offering_id, quote_id, duplicate_key)
           SELECT i, 'pur_seed' || i, 250000, %(asset)s, %(network)s, 'x402', 'http',
             '0x' || lpad(to_hex(i %% 50000), 40, '0'), '',
             now() - (%(hi)s - i) * interval '30 seconds', now(), 'paid', 'succeeded',
             %(offering)s, i, ''
           FROM generate_series(%(lo)s, %(hi)s) i""",
        """INSERT INTO purchases_idempotencyrecord (id, scope, key, principal,
             request_fingerprint, lease_token, response_headers, created_at, state,
             answer_is_live, response_text, recovery_point, purchase_id)
           SELECT i, 'x402', 'pay-seed-' || i, '0x' || lpad(to_hex(i %% 50000), 40, '0'), 'f',
             '', '{}', now(), 'completed', false, '', 'finished', i
           FROM generate_series(%(lo)s, %(hi)s) i""",
        """INSERT INTO payments_paymentattempt (id, rail, payer, network, asset, amount,
             fingerprint, settlement_reference, reason_code, created_at, updated_at, state,
             purchase_id, authorization_nonce, raw_transaction, unanswered_checks,
             resubmissions, tx_hash, idempotency_record_id, finality_seen, relayer_address)
           SELECT i, 'x402', '0x' || lpad(to_hex(i %% 50000), 40, '0'), %(network)s, %(asset)s,
             250000, 'f', '0x' || lpad(to_hex(i), 64, '0'), '', now(), now(), 'succeeded', i,
             '0x' || lpad(to_hex(i), 64, 'f'), '', 0, 0, '0x' || lpad(to_hex(i), 64, '0'), i,
             '{}', ''
           FROM generate_series(%(lo)s, %(hi)s) i""",
        """INSERT INTO payments_refund (id, method, amount, asset, network, payer,
             reason_code, transaction, paid_reference, paid_by, created_at, state,
             payment_attempt_id, purchase_id, note, proposed_by, decided_by,
             payback_tx_hash, payback_code, payback_evidence, match_tx_hash)
           SELECT i, 'pay_back', 250000, %(asset)s, %(network)s,
             '0x' || lpad(to_hex(i %% 50000), 40, '0'), 'late_settlement',
             '0x' || lpad(to_hex(i), 64, '0'), '', '', now(), 'owed', i, i, '', '', '',
             '', '', '{}', ''
           FROM generate_series(%(lo)s, %(hi)s) i""",
    ]
    with connection.cursor() as cursor:
        for sql in statements:
            cursor.execute(sql, params)
        for table in tables:
            cursor.execute(
                f"SELECT setval(pg_get_serial_sequence('{table}', 'id'), "  # noqa: S608
                f"(SELECT max(id) FROM {table}))"
            )
            cursor.execute(f"ANALYZE {table}")
    print(f"seeded {count} purchases in {time.monotonic() - started:.1f} s", file=sys.stderr)


# --- reconciliation ------------------------------------------------------------------------
def _reconciliation(count: int) -> Figure:
    from django.conf import settings
    from eth_account import Account

    from devtools.anvil import AnvilNode
    from devtools.settlement_backlog import settlement_backlog_create
    from devtools.test_token import deploy_test_usdc, mint
    from payments.models import PaymentAttempt
    from purchases.services.jobs import reconcile
    from tests.factories import OfferingFactory

    landed, expired = count // 2, count - count // 2
    # A run that died left its backlog pending against a chain that is gone: not ours now.
    PaymentAttempt.objects.filter(
        state__in=["recorded", "settlement_pending"], fingerprint="backlog"
    ).update(state="failed", reason_code="bench_abandoned")
    with AnvilNode() as node:
        w3 = node.w3()
        deployer, relayer, seller, payer = [Account.create() for _ in range(4)]
        for account in (deployer, relayer, payer):
            node.rpc("anvil_setBalance", [account.address, hex(10**24)])
        token = deploy_test_usdc(w3, deployer, "USDC", "2")
        mint(w3, token, deployer, payer.address, 250_000 * landed + 1)
        settings.X402_NETWORKS = {
            **settings.X402_NETWORKS,
            NETWORK: {
                "chain_id": 31337,
                "rpc_url": node.rpc_url,
                "token_address": token,
                "token_name": "USDC",
                "token_version": "2",
                "confirmations": 1,
                "confirmation_timeout": 2.0,
                "mode": "direct",
                "relayer_private_key": relayer.key.hex(),
                "facilitator_url": "",
                "facilitator_timeout": 1.5,
            },
        }
        offering = OfferingFactory.create(  # a slug of its own: the factory gets-or-creates
            slug=f"bench-reconcile-{token[2:10].lower()}",
            asset=token,
            network=NETWORK,
            pay_to=seller.address,
            price=250_000,
        )
        settlement_backlog_create(
            offering=offering,
            rpc_url=node.rpc_url,
            chain_id=31337,
            payer=payer,
            relayer=relayer,
            landed=landed,
            expired=expired,
        )
        from django.utils import timezone

        started, cpu_started = time.perf_counter(), time.process_time()
        stats = reconcile.reconcile_pending_settlements(now=timezone.now())
        seconds = time.perf_counter() - started
        cpu = time.process_time() - cpu_started
    trips = max(stats["rpc_round_trips"], 1)
    resolved = stats["confirmed"] + stats["failed"]
    return Figure(
        name=(
            f"reconciliation of {count:,} pending settlements: "
            "RPC round trips, one per settlement vs ours"
        ),
        ratios=[count / trips],
        goal=">= 50",
        detail=(
            f"{trips} round trips; {seconds:.2f} s wall (goal <= 10 s), {cpu:.2f} s CPU in "
            f"this process, load average {os.getloadavg()[0]:.1f}; "
            f"{stats['confirmed']} confirmed, {stats['failed']} failed, "
            f"{resolved}/{count} resolved, {stats['recorded_one_by_one']} one by one, "
            f"{stats['row_errors']} row errors"
        ),
        extra={"seconds": f"{seconds:.2f}", "round_trips": str(trips)},
    )


# --- the admin -----------------------------------------------------------------------------
def _timed(client: Any, url: str, data: dict[str, str] | None = None) -> tuple[float, int]:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    with CaptureQueriesContext(connection) as queries:
        started = time.perf_counter()
        # secure: the runner may have set Django up on the production settings (HTTPS only).
        response = client.get(url, data or {}, secure=True)
        elapsed = (time.perf_counter() - started) * 1000
    if response.status_code != 200:
        raise RuntimeError(f"{url} answered {response.status_code}")
    return elapsed, len(queries.captured_queries)


def _admin(count: int) -> list[Figure]:
    """The admin pages, served in this process as the test client serves them (plain static
    storage, no HTTPS redirect: the runner may have set Django up on production settings)."""
    from django.conf import settings
    from django.test import override_settings

    plain = {**settings.STORAGES, "staticfiles": {"BACKEND": _PLAIN_STATIC}}
    with override_settings(STORAGES=plain, SECURE_SSL_REDIRECT=False):
        return _admin_pages(count)


_PLAIN_STATIC = "django.contrib.staticfiles.storage.StaticFilesStorage"


def _rows_of(page: str) -> str:
    return "refunds" if page.startswith("refund") else "purchases"


def _bench_user() -> Any:
    """The superuser every admin figure (and the export's process) logs in as."""
    from django.contrib.auth.models import User

    return User.objects.filter(username="bench").first() or User.objects.create_user(
        username="bench", is_staff=True, is_superuser=True
    )


def _admin_pages(count: int) -> list[Figure]:
    from django.test import Client
    from django.urls import reverse

    from purchases.models import Purchase

    client = Client()
    client.force_login(_bench_user())
    # A row in the middle of the seeded ones (their ids are the seed's own numbers).
    target = Purchase.objects.filter(ref__startswith="pur_seed").order_by("pk")[count // 2]
    probe = target.pk
    wallet = "0x" + f"{probe % 50000:x}".rjust(40, "0")
    tx_hash = "0x" + f"{probe:x}".rjust(64, "0")
    changelist = reverse("admin:purchases_purchase_changelist")
    refunds = reverse("admin:payments_refund_changelist")
    pages: list[tuple[str, str, dict[str, str] | None]] = [
        ("list", changelist, None),
        ("search by purchase ref", changelist, {"q": target.ref}),
        ("search by payment id", changelist, {"q": f"pay-seed-{probe}"}),
        ("search by tx hash", changelist, {"q": tx_hash.upper().replace("0X", "0x")}),
        ("search by payer wallet", changelist, {"q": wallet}),
        ("purchase page", reverse("admin:purchases_purchase_change", args=[target.pk]), None),
        # Finance's refund list (every seeded purchase owes one): as it opens (owed), and
        # support's searches on it.
        ("refund list", refunds, None),
        ("refund search by purchase ref", refunds, {"q": target.ref}),
        ("refund search by payer wallet", refunds, {"q": wallet}),
        ("refund search by tx hash", refunds, {"q": tx_hash}),
    ]
    anchor_url = reverse("admin:index")
    for _, url, data in [("anchor", anchor_url, None), *pages]:
        _timed(client, url, data)  # warm: templates, content types, plan caches
    figures = []
    for name, url, data in pages:
        ratios, millis, queries = [], [], 0
        for _ in range(ADMIN_REPEATS):
            anchor_ms, _ = _timed(client, anchor_url)
            ours_ms, queries = _timed(client, url, data)
            ratios.append(ours_ms / anchor_ms)
            millis.append(ours_ms)
        median_ms = sorted(millis)[len(millis) // 2]
        ok = median_ms <= 300 and queries <= 10
        figures.append(
            Figure(
                name=f"admin {name} at {count:,} {_rows_of(name)} vs the admin index page",
                ratios=ratios,
                detail=(
                    f"{median_ms:.0f} ms median ({min(millis):.0f}-{max(millis):.0f}), "
                    f"{queries} queries; goal <= 300 ms and <= 10 queries: "
                    f"{'met' if ok else 'MISSED'}; load average {os.getloadavg()[0]:.1f}"
                ),
                extra={"ms": f"{median_ms:.1f}", "queries": str(queries)},
            )
        )
    return figures


# --- the refund-owed CSV export, in a process of its own ---------------------------------
_EXPORT_CHILD = """
import os, resource, sys, time
import django

def peak_kb():
    # VmHWM: this process's own peak. ru_maxrss is not: Linux carries the parent's across
    # fork and exec, so a bench process grown by the admin figures would read as ours.
    try:
        with open("/proc/self/status") as status:
            return next(int(x.split()[1]) for x in status if x.startswith("VmHWM:"))
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

django.setup()
from django.test.utils import setup_test_environment
setup_test_environment()
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse
from payments.models import Refund
client = Client()
client.force_login(User.objects.get(username="bench"))
first = Refund.objects.order_by("pk").values_list("pk", flat=True).first()
url = reverse("admin:payments_refund_changelist") + "?state=all"
# Warm: the first request's imports and code paths, on one ticked row (a batch of one).
warm = client.post(url, {"action": "export_csv", "index": "0", "_selected_action": [first]})
assert sum(chunk.count(b"\\n") for chunk in warm.streaming_content) == 2
before = peak_kb()
print(f"before {before}", flush=True)
started = time.perf_counter()
response = client.post(
    url,
    {"action": "export_csv", "select_across": "1", "index": "0", "_selected_action": [first]},
)
lines = 0
for chunk in response.streaming_content:
    lines += chunk.count(b"\\n")
    if lines % 50000 < chunk.count(b"\\n") + 1:
        rss = peak_kb()
        print(f"progress {lines} {rss} {time.perf_counter() - started:.1f}", flush=True)
rss = peak_kb()
print(f"done {lines} {rss} {time.perf_counter() - started:.1f}", flush=True)
"""


def _export(count: int, timeout: int) -> Figure:
    from django.db import connection

    # Its own process on the test settings, whatever the runner set Django up with, on the
    # database this process seeded (Django may have been set up before this module ran).
    _bench_user()  # the export may run without the admin figures before it
    db = connection.settings_dict
    credentials = db["USER"] + (f":{db['PASSWORD']}" if db.get("PASSWORD") else "")
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "DJANGO_SETTINGS_MODULE": "config.settings.test",
        "DATABASE_URL": f"postgres://{credentials}@{db['HOST']}:{db['PORT']}/{db['NAME']}",
    }
    finished = True
    with tempfile.TemporaryFile("w+") as out:
        try:
            subprocess.run(
                [sys.executable, "-c", _EXPORT_CHILD],
                cwd=REPO,
                env=env,
                stdout=out,
                stderr=subprocess.DEVNULL,
                timeout=timeout,
                check=True,
            )
        except subprocess.TimeoutExpired:
            finished = False
        out.seek(0)
        lines = [line for line in out.read().splitlines() if line]
    before = next(int(x.split()[1]) for x in lines if x.startswith("before"))
    last = [x for x in lines if x.startswith(("progress", "done"))][-1].split()
    rows, peak_kb, seconds = int(last[1]) - 1, int(last[2]), float(last[3])
    progress = [x.split() for x in lines if x.startswith("progress")]
    first_seconds = float((progress[0] if progress else last)[3])
    peak_mb = peak_kb / 1024
    state = "complete" if finished and last[0] == "done" else f"STOPPED at {timeout} s"
    return Figure(
        name=f"refund-owed CSV export of {count:,} refunds: peak RSS vs the process before it",
        ratios=[peak_kb / before],
        detail=(
            f"{rows:,} rows in {seconds:.1f} s ({state}); peak RSS {peak_mb:.0f} MB "
            f"(before {before / 1024:.0f} MB; goal <= 150 MB: "
            f"{'met' if peak_mb <= 150 and state == 'complete' else 'MISSED'}); "
            f"first row after {first_seconds:.1f} s; load average {os.getloadavg()[0]:.1f}"
        ),
        extra={"peak_rss_mb": f"{peak_mb:.0f}", "rows": str(rows), "seconds": f"{seconds:.1f}"},
    )


def run(scale: Scale) -> list[Figure]:
    sizes = SIZES[scale]
    _setup_django(scale)
    _seed(sizes["purchases"])
    figures = [_reconciliation(sizes["settlements"])]
    figures += _admin(sizes["purchases"])
    figures.append(_export(sizes["purchases"], sizes["export_timeout"]))
    return figures


def _show(figure: Figure) -> None:
    print(f"{figure.name}: {figure.median:.2f} (goal {figure.goal or '-'}) {figure.detail}")


if __name__ == "__main__":
    chosen = Scale(sys.argv[1]) if len(sys.argv) > 1 else Scale.SMOKE
    wanted = set(sys.argv[2:]) or {"reconciliation", "admin", "export"}
    sizes = SIZES[chosen]
    _setup_django(chosen)
    _seed(sizes["purchases"])
    print(f"load average {os.getloadavg()[0]:.1f} before", file=sys.stderr)
    if "reconciliation" in wanted:  # each figure as soon as it is measured
        _show(_reconciliation(sizes["settlements"]))
    if "admin" in wanted:
        for admin_figure in _admin(sizes["purchases"]):
            _show(admin_figure)
    if "export" in wanted:
        _show(_export(sizes["purchases"], sizes["export_timeout"]))
    print(f"load average {os.getloadavg()[0]:.1f} after", file=sys.stderr)
