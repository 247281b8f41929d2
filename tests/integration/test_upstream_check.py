"""`manage.py upstream_check` and the offering page's "Check upstream" button: they reach a
real upstream, report its secret, reachability, latency and auth, and never cause an effect
(the upstream's own count stays 0; only a declared dry-run target is called)."""

from __future__ import annotations

import re
from io import StringIO

import pytest
from django.contrib.messages import get_messages
from django.core.management import CommandError, call_command
from django.urls import reverse

from fulfillment.models import Upstream
from purchases.models import Offering
from tests.admin.test_admin import _change, _staff
from tests.factories import OfferingFactory
from tests.fixtures.sample_upstream import SECRET_ENV, SampleUpstream

pytestmark = pytest.mark.django_db


def offering_on(upstream: SampleUpstream, **config: object) -> Offering:
    offering = OfferingFactory.create(executor="http")
    Upstream.objects.create(
        offering=offering,
        kind="http",
        url=upstream.url + "/work",
        **{"secret_env": SECRET_ENV, "dry_run": {"method": "GET", "path": "/health"}, **config},
    )
    return offering


def run(slug: str) -> str:
    out = StringIO()
    call_command("upstream_check", slug, stdout=out)
    return out.getvalue()


def test_the_command_reports_reachability_latency_and_auth(
    sample_upstream: SampleUpstream,
) -> None:
    out = run(offering_on(sample_upstream).slug)
    assert f"{SECRET_ENV} is set" in out
    assert re.search(r"reachable: 127\.0\.0\.1:\d+ accepts connections \(\d+ ms\)", out)
    assert re.search(r"auth: GET /health answered 200 in \d+ ms", out)
    assert out.rstrip().endswith("ok")
    assert sample_upstream.stats()["effects"] == 0


def test_the_command_names_what_is_wrong(
    sample_upstream: SampleUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    offering = offering_on(sample_upstream, dry_run={})
    monkeypatch.delenv(SECRET_ENV)
    with pytest.raises(CommandError):
        run(offering.slug)
    monkeypatch.setenv(SECRET_ENV, "s3cret-for-tests")
    out = run(offering.slug)
    assert "none declared: the operation is never called" in out
    sample_upstream.kill()
    report = StringIO()
    with pytest.raises(CommandError):
        call_command("upstream_check", offering.slug, stdout=report)
    assert "NOT reachable" in report.getvalue()
    with pytest.raises(CommandError, match="no offering"):
        run("no-such-offering")


def test_the_admin_button_is_its_own_form_and_reports(sample_upstream: SampleUpstream) -> None:
    offering = offering_on(sample_upstream)
    client = _staff("root", superuser=True)
    page = client.get(_change(offering)).content.decode()
    check_url = reverse("admin:purchases_offering_upstream_check", args=[offering.pk])
    form_at = page.index(f'action="{check_url}"')
    # The button's form closes before the offering's own form opens: never nested in it.
    assert page.index("</form>", form_at) < page.index('id="offering_form"')
    assert client.get(check_url).status_code == 403  # POST only
    response = client.post(check_url)
    assert response.status_code == 302
    shown = [str(m) for m in get_messages(response.wsgi_request)]  # type: ignore[attr-defined]
    assert any("accepts connections" in m for m in shown)
    assert "Upstream check: ok" in shown
    assert sample_upstream.stats()["effects"] == 0


def test_during_a_rotation_the_check_reports_both_secrets(
    sample_upstream: SampleUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The sample upstream holds the old secret (no key id); the new one is not set here yet.
    offering = offering_on(
        sample_upstream,
        secret_env="NEW_UPSTREAM_SECRET",
        key_id="2",
        previous_secret_env=SECRET_ENV,
    )
    with pytest.raises(CommandError):
        run(offering.slug)
    monkeypatch.setenv("NEW_UPSTREAM_SECRET", "new-secret")
    out = run(offering.slug)
    assert "secret: NEW_UPSTREAM_SECRET (key id 2) is set" in out
    assert f"previous (rotation under way) secret: {SECRET_ENV} is set" in out
    # Signed with both, the upstream still holding the old one accepts the dry run.
    assert re.search(r"auth: GET /health answered 200 in \d+ ms", out)
    assert sample_upstream.stats()["effects"] == 0
