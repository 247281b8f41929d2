"""Re-running the demo keeps what staff changed in the admin; only the chain facts move."""

from __future__ import annotations

import hashlib
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import call_command

from core.actors import Actor
from devtools.demo_seed import OFFERINGS_FILE, demo_seed
from purchases.models import Offering
from purchases.services.quote.offerings import offering_update

FIRST_TOKEN = "0x" + "1" * 40
SECOND_TOKEN = "0x" + "2" * 40


@pytest.mark.django_db
def test_a_second_seed_keeps_admin_edits_and_moves_only_the_token(settings, tmp_path) -> None:
    settings.VAR_DIR = tmp_path
    demo_seed(asset=FIRST_TOKEN)
    report = Offering.objects.get(slug="csv-report")
    edited = offering_update(
        offering_id=report.pk,
        changes={"price": 300_000, "title": "Renamed by support", "stock": 7,
                 "result_retention": timedelta(hours=1)},
        actor=Actor.staff("support"),
    )  # fmt: skip

    demo_seed(asset=SECOND_TOKEN)

    again = Offering.objects.get(slug="csv-report")
    assert (again.price, again.title, again.stock) == (300_000, "Renamed by support", 7)
    assert again.result_retention == timedelta(hours=1)
    assert again.asset == SECOND_TOKEN
    assert again.version == edited.version + 1  # the asset is part of the terms
    assert Offering.objects.count() == 3


@pytest.mark.django_db
def test_the_sample_upstreams_offering_follows_the_upstream_to_its_new_port(
    settings, tmp_path
) -> None:
    from fulfillment.models import Upstream
    from purchases.models import PurchaseEvent

    settings.VAR_DIR = tmp_path
    seeded = demo_seed(asset=FIRST_TOKEN, upstream_url="http://127.0.0.1:8766/work")
    assert seeded["offerings"][-1] == "counted-echo" and Offering.objects.count() == 4
    upstream = Upstream.objects.get(offering__slug="counted-echo")
    assert (upstream.kind, upstream.secret_env) == ("http", "TOLLBOOTH_DEMO_UPSTREAM_SECRET")
    upstream.timeout_seconds = 9  # tuned by staff: kept
    upstream.save()

    demo_seed(asset=FIRST_TOKEN, upstream_url="http://127.0.0.1:9000/work")

    upstream.refresh_from_db()
    assert (upstream.url, upstream.timeout_seconds) == ("http://127.0.0.1:9000/work", 9)
    added, moved = PurchaseEvent.objects.filter(subject="offering.upstream_changed").order_by("pk")
    assert (added.reason_code, added.evidence["file"]) == ("upstream_added", "offerings.yaml")
    assert (moved.actor_type, moved.actor) == ("system", "seed_demo")
    assert moved.evidence["changed"] == {
        "url": ["http://127.0.0.1:8766/work", "http://127.0.0.1:9000/work"]
    }


@pytest.mark.django_db
def test_the_demo_seeds_its_offerings_from_the_example_catalog_file(settings, tmp_path) -> None:
    """A seller copies docs/examples/offerings.yaml: the demo runs on that very file."""
    from fulfillment.executors.report import REPORT_INPUT_SCHEMA
    from purchases.models import PurchaseEvent

    settings.VAR_DIR = tmp_path
    demo_seed(asset=FIRST_TOKEN, upstream_url="http://127.0.0.1:8766/work")

    sha = hashlib.sha256(OFFERINGS_FILE.read_bytes()).hexdigest()
    rows = Offering.objects.order_by("slug")
    assert [(o.slug, o.catalog_file, o.catalog_sha256) for o in rows] == [
        (slug, "offerings.yaml", sha)
        for slug in ("counted-echo", "csv-report", "limited-report", "word_stats")
    ]
    limited = Offering.objects.get(slug="limited-report")
    assert (limited.price, limited.stock, limited.refund_policy) == (1_000_000, 3, "escalate")
    assert limited.input_schema == REPORT_INPUT_SCHEMA  # the file's schema is the executor's
    assert (limited.asset, limited.network) == (FIRST_TOKEN, "eip155:31337")
    created = PurchaseEvent.objects.filter(subject="offering.created")
    assert {(e.actor_type, e.actor, e.evidence["file_sha256"]) for e in created} == {
        ("system", "seed_demo", sha)
    }


@pytest.mark.django_db
def test_the_example_catalog_file_applies_as_it_is_and_a_second_time_changes_nothing() -> None:
    out = StringIO()
    call_command("offerings", "apply", str(OFFERINGS_FILE), "--by", "seller", stdout=out)
    assert "4 created, 0 changed, 0 deactivated, 0 unchanged" in out.getvalue()
    again = StringIO()
    call_command("offerings", "apply", str(OFFERINGS_FILE), "--by", "seller", stdout=again)
    assert "nothing to change: 0 created, 0 changed, 0 deactivated, 4 unchanged" in again.getvalue()
