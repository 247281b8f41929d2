"""Offerings as code for an existing API sold as it is: `input_mode: request` on an http
upstream is applied, exported and applied again unchanged, and refused with its line on any
other kind of upstream."""

from __future__ import annotations

from io import StringIO
from pathlib import Path

import pytest
import yaml
from django.core.management import CommandError, call_command

from fulfillment.models import Upstream
from purchases.models import Offering
from tests.factories import SELLER, USDC_LOCAL

pytestmark = [pytest.mark.django_db]

CATALOG = f"""\
tollbooth_catalog: 1
defaults:
  network: eip155:31337
  asset: "{USDC_LOCAL}"
  pay_to: {SELLER}
offerings:
  seller-api:
    title: The seller's API, one paid call at a time
    price: "0.01 USDC"
    upstream:
      kind: http
      url: https://api.seller.example/v1
      input_mode: request
      secret_env: SELLER_API_SECRET
"""


def _apply(path: Path) -> str:
    out = StringIO()
    call_command("offerings", "apply", str(path), "--by", "alice", stdout=out)
    return out.getvalue()


def _export() -> str:
    out = StringIO()
    call_command("offerings", "export", stdout=out, stderr=StringIO())
    return out.getvalue()


def test_input_mode_request_round_trips_through_export_and_apply(tmp_path: Path) -> None:
    source = tmp_path / "offerings.yaml"
    source.write_text(CATALOG)
    _apply(source)
    upstream = Upstream.objects.get(offering__slug="seller-api")
    assert (upstream.kind, upstream.url, upstream.input_mode) == (
        "http",
        "https://api.seller.example/v1",
        "request",
    )

    exported = tmp_path / "exported.yaml"
    exported.write_text(_export())
    document = yaml.safe_load(exported.read_text())
    assert document["offerings"]["seller-api"]["upstream"]["input_mode"] == "request"
    assert _apply(exported).count("nothing to change") == 1

    Upstream.objects.all().delete()
    Offering.objects.all().delete()  # another deployment's empty catalog
    _apply(exported)
    assert Upstream.objects.get(offering__slug="seller-api").input_mode == "request"


def test_only_an_http_upstream_passes_the_request_through(tmp_path: Path) -> None:
    text = CATALOG.replace("kind: http", "kind: mcp\n      tool: search")
    source = tmp_path / "offerings.yaml"
    source.write_text(text)
    with pytest.raises(CommandError) as refused:
        _apply(source)
    assert "offerings.seller-api.upstream.input_mode: Only an http upstream passes" in str(
        refused.value
    )
    assert not Offering.objects.exists()
