"""Offerings as code (issue 35, part 2): `manage.py offerings export` writes the whole
catalog as a file, `manage.py offerings apply` makes the catalog equal to one through the
admin's services, all or nothing. Real database, the real command, asserting rows and events."""

from __future__ import annotations

import hashlib
from datetime import timedelta
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
import yaml
from django.core.management import CommandError, call_command

from fulfillment.models import Upstream
from purchases.models import Offering, PurchaseEvent
from purchases.services.quote.offerings import offering_stock_take
from tests.factories import SELLER, USDC_LOCAL, OfferingFactory

pytestmark = [pytest.mark.django_db]
SECRET_VALUE = "s3cr3t-value-never-in-a-file"

CATALOG = f"""\
tollbooth_catalog: 1
defaults:
  network: eip155:31337
  asset: "{USDC_LOCAL}"
  pay_to: {SELLER}
offerings:
  lookup:
    title: Company lookup
    price: "0.01 USDC"
    executor: report
    stock: 3
    result_retention: 1d
    duplicate_window: 5m
  echo:
    title: Echo (the seller's own endpoint)
    price: 50_000
    input_schema:
      type: object
      properties:
        on: {{type: string}}
    upstream:
      kind: http
      url: https://api.seller.example/echo
      secret_env: SELLER_ECHO_SECRET
      timeout_seconds: 5
      max_tries: 3
"""


def _file(tmp_path: Path, text: str, name: str = "offerings.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _apply(path: Path, *args: str) -> str:
    out = StringIO()
    call_command("offerings", "apply", str(path), "--by", "alice", *args, stdout=out)
    return out.getvalue()


def _snapshot() -> list[dict[str, Any]]:
    rows = Offering.objects.order_by("slug").values()
    return [{k: v for k, v in row.items() if k != "created_at"} for row in rows]


def _without(rows: list[dict[str, Any]], names: tuple[str, ...]) -> list[dict[str, Any]]:
    return [{k: v for k, v in row.items() if k not in names} for row in rows]


def _events() -> list[tuple[str, str, str]]:
    return list(
        PurchaseEvent.objects.filter(subject__startswith="offering.")
        .order_by("pk")
        .values_list("subject", "evidence__offering", "actor")
    )


def test_apply_creates_the_catalog_through_the_services_naming_the_file_and_the_actor(
    tmp_path: Path,
) -> None:
    path = _file(tmp_path, CATALOG)
    out = _apply(path)

    lookup = Offering.objects.get(slug="lookup")
    assert (lookup.price, lookup.stock, lookup.version) == (10_000, 3, 1)
    assert (lookup.result_retention, lookup.duplicate_window) == (
        timedelta(days=1),
        timedelta(minutes=5),
    )
    assert (lookup.network, lookup.asset, lookup.pay_to) == ("eip155:31337", USDC_LOCAL, SELLER)
    echo = Offering.objects.get(slug="echo")
    assert (echo.price, echo.executor, echo.version) == (50_000, "http", 2)  # upstream: a term
    assert echo.input_schema["properties"] == {"on": {"type": "string"}}  # `on` stays a word
    upstream = Upstream.objects.get(offering=echo)
    assert (upstream.url, upstream.secret_env, upstream.max_tries) == (
        "https://api.seller.example/echo",
        "SELLER_ECHO_SECRET",
        3,
    )
    sha = hashlib.sha256(CATALOG.encode()).hexdigest()
    assert (echo.catalog_file, echo.catalog_sha256) == ("offerings.yaml", sha)
    events = PurchaseEvent.objects.filter(subject__startswith="offering.").order_by("pk")
    assert [(e.subject, e.evidence["offering"]) for e in events] == [
        ("offering.created", "echo"),
        ("offering.upstream_changed", "echo"),
        ("offering.created", "lookup"),
    ]
    for event in events:
        assert (event.actor_type, event.actor) == ("staff", "alice")
        assert (event.evidence["file"], event.evidence["file_sha256"]) == ("offerings.yaml", sha)
    assert f"offerings.yaml sha256 {sha}, applied by alice" in out
    assert "+ lookup: created, 0.01 USDC on eip155:31337, executor report" in out
    assert "2 created, 0 changed, 0 deactivated, 0 unchanged" in out


def test_a_second_apply_changes_nothing(tmp_path: Path) -> None:
    path = _file(tmp_path, CATALOG)
    _apply(path)
    before, events = _snapshot(), _events()

    out = _apply(path)

    assert _snapshot() == before
    assert _events() == events
    assert "nothing to change: 0 created, 0 changed, 0 deactivated, 2 unchanged" in out


def test_a_price_change_is_a_new_terms_version_on_record_with_before_and_after(
    tmp_path: Path,
) -> None:
    _apply(_file(tmp_path, CATALOG))
    changed = CATALOG.replace('price: "0.01 USDC"', 'price: "0.02 USDC"')
    out = _apply(_file(tmp_path, changed))

    lookup = Offering.objects.get(slug="lookup")
    assert (lookup.price, lookup.version) == (20_000, 2)
    event = PurchaseEvent.objects.filter(subject="offering.changed").get()
    assert event.evidence["changed"] == {"price": [10_000, 20_000]}
    assert event.evidence["file_sha256"] == hashlib.sha256(changed.encode()).hexdigest()
    assert (event.from_state, event.to_state, event.reason_code) == ("1", "2", "terms_changed")
    assert "~ lookup: terms version 1 -> 2\n    price: 0.01 USDC -> 0.02 USDC" in out
    assert "0 created, 1 changed, 0 deactivated, 1 unchanged" in out


BAD_ENTRY = """\
  broken:
    title: Broken
    price: 0.25
    executor: nope
    prise: 3
"""


def test_one_bad_entry_refuses_the_whole_file_and_names_each_problem_with_its_line(
    tmp_path: Path,
) -> None:
    _apply(_file(tmp_path, CATALOG))
    before, events = _snapshot(), _events()
    # A valid price change, a valid new offering, and one broken entry.
    text = CATALOG.replace('price: "0.01 USDC"', 'price: "0.02 USDC"') + (
        "  fresh:\n    title: Fresh\n    price: 1000\n    executor: report\n" + BAD_ENTRY
    )

    with pytest.raises(CommandError) as refused:
        _apply(_file(tmp_path, text))

    assert _snapshot() == before
    assert _events() == events
    message = str(refused.value)
    assert "catalog_invalid: 3 problem(s); nothing was applied" in message
    assert "line 33: offerings.broken.price: a float is never money" in message
    assert "line 34: offerings.broken.executor: one of " in message
    assert "line 35: offerings.broken.prise: unknown key" in message


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ('price: "0.01 USDC"', "price: 0.01", "line 9: offerings.lookup.price: a float is never"),
        ('price: "0.01 USDC"', 'price: "0.0000001 USDC"', "USDC has 6 decimals: 0.0000001"),
        ('price: "0.01 USDC"', 'price: "1 EURC"', "the amount is in EURC but the offering's"),
        ('price: "0.01 USDC"', 'price: "0.01"', 'name the unit: "0.01" is neither atomic'),
        ("stock: 3", "stock: three", "line 11: offerings.lookup.stock: a whole number"),
        ("retention: 1d", "retention: 1 day", "line 12: offerings.lookup.result_retention: not a"),
        ("secret_env: SELLER_ECHO_SECRET", f"secret_env: {SECRET_VALUE}", "An environment var"),
        (
            "url: https://api.",
            "url: https://u:pw@api.",
            "line 23: offerings.echo.upstream.url: carries",
        ),
        ("kind: http", "kind: ftp", "line 22: offerings.echo.upstream.kind: Value 'ftp' is not"),
        ("tollbooth_catalog: 1", "tollbooth_catalog: 2", "line 1: tollbooth_catalog: must be 1"),
        ("  lookup:\n", "  lookup: yes\n  old:\n", "line 7: offerings.lookup: a mapping of the"),
        ("    executor: report\n", "", "line 7: offerings.lookup.executor: one of http, http_job"),
        ("defaults:\n", "defaults:\n  currency: USD\n", "line 3: defaults.currency: unknown key"),
        ("    title: Company lookup\n", "", "line 7: offerings.lookup.title: is required"),
        ("  lookup:", "  Look Up:", "line 7: offerings.Look Up: Enter a valid “slug”"),
        ("price: 50_000", "price: -1", "line 16: offerings.echo.price: must not be negative"),
    ],
)
def test_bad_input_is_refused_with_a_clear_error(
    tmp_path: Path, old: str, new: str, expected: str
) -> None:
    assert old in CATALOG
    with pytest.raises(CommandError, match="catalog_invalid") as refused:
        _apply(_file(tmp_path, CATALOG.replace(old, new, 1)))

    assert expected in str(refused.value)
    assert "catalog_invalid: 1 problem(s)" in str(refused.value)  # named once, not twice
    assert not Offering.objects.exists()


def test_a_file_that_is_not_yaml_or_not_there_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(CommandError, match=r"line 4: not YAML"):
        _apply(_file(tmp_path, "tollbooth_catalog: 1\nofferings:\n  a: [x\n"))
    with pytest.raises(CommandError, match="line 5: price: appears twice"):
        _apply(
            _file(tmp_path, "tollbooth_catalog: 1\nofferings:\n  a:\n    price: 1\n    price: 2\n")
        )
    with pytest.raises(CommandError, match="cannot read"):
        _apply(tmp_path / "missing.yaml")


def test_dry_run_prints_the_diff_and_writes_nothing(tmp_path: Path) -> None:
    out = _apply(_file(tmp_path, CATALOG), "--dry-run")

    assert "+ echo: created, 0.05 USDC on eip155:31337, executor http" in out
    assert "(dry run: nothing was written)" in out
    assert not Offering.objects.exists()
    assert not PurchaseEvent.objects.exists()


def test_check_fails_while_the_catalog_differs_from_the_file_and_passes_once_applied(
    tmp_path: Path,
) -> None:
    path = _file(tmp_path, CATALOG)
    with pytest.raises(CommandError, match=r"the catalog differs from offerings\.yaml: apply it"):
        _apply(path, "--check")
    assert not Offering.objects.exists()  # a check writes nothing

    _apply(path)

    assert "nothing to change" in _apply(path, "--check")


def test_prune_deactivates_what_the_file_omits_and_without_it_they_are_only_named(
    tmp_path: Path,
) -> None:
    stray = OfferingFactory.create(slug="stray")
    kept = _apply(_file(tmp_path, CATALOG))
    assert "not in the file, left active (--prune deactivates them): stray" in kept
    assert Offering.objects.get(pk=stray.pk).is_active

    pruned = _apply(_file(tmp_path, CATALOG), "--prune")

    stray.refresh_from_db()
    assert not stray.is_active  # deactivated, never deleted
    assert "- stray: deactivated (its quotes and purchases stay)" in pruned
    assert "0 created, 0 changed, 1 deactivated, 2 unchanged" in pruned
    event = PurchaseEvent.objects.get(subject="offering.changed", evidence__offering="stray")
    assert event.evidence["changed"] == {"is_active": [True, False]}


def test_sales_own_the_stock_until_the_file_changes_its_number(tmp_path: Path) -> None:
    _apply(_file(tmp_path, CATALOG))
    lookup = Offering.objects.get(slug="lookup")
    assert offering_stock_take(offering_id=lookup.pk)  # a quote took one: 2 left

    again = _apply(_file(tmp_path, CATALOG))
    lookup.refresh_from_db()
    assert lookup.stock == 2  # never put back to 3 (that would oversell)
    assert "nothing to change" in again

    _apply(_file(tmp_path, CATALOG.replace("stock: 3", "stock: 10")))  # a restock
    lookup.refresh_from_db()
    assert (lookup.stock, lookup.version) == (10, 1)  # stock is not a term


def test_an_upstream_change_is_on_record_naming_the_file(tmp_path: Path) -> None:
    _apply(_file(tmp_path, CATALOG))
    moved = CATALOG.replace("api.seller.example/echo", "api2.seller.example/echo")
    out = _apply(_file(tmp_path, moved))

    assert Upstream.objects.get(offering__slug="echo").url == "https://api2.seller.example/echo"
    event = PurchaseEvent.objects.filter(subject="offering.upstream_changed").last()
    assert event is not None
    assert event.evidence["changed"] == {
        "url": ["https://api.seller.example/echo", "https://api2.seller.example/echo"]
    }
    assert event.evidence["file_sha256"] == hashlib.sha256(moved.encode()).hexdigest()
    assert "~ echo: terms version 2 -> 3" in out
    assert (
        "upstream.url: https://api.seller.example/echo -> https://api2.seller.example/echo" in out
    )


def _export(*args: str) -> str:
    out = StringIO()
    call_command("offerings", "export", *args, stdout=out, stderr=StringIO())
    return out.getvalue()


def test_export_writes_the_whole_catalog_secrets_only_by_name(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SELLER_ECHO_SECRET", SECRET_VALUE)
    _apply(_file(tmp_path, CATALOG))
    target = tmp_path / "exported.yaml"

    call_command("offerings", "export", str(target), stdout=StringIO(), stderr=StringIO())

    text = target.read_text()
    assert SECRET_VALUE not in text
    document = yaml.safe_load(text)
    assert document["defaults"] == {
        "network": "eip155:31337",
        "asset": USDC_LOCAL,
        "asset_symbol": "USDC",
        "asset_decimals": 6,
        "pay_to": SELLER,
    }
    lookup = document["offerings"]["lookup"]
    assert (lookup["price"], lookup["stock"], lookup["result_retention"]) == ("0.01 USDC", 3, "1d")
    assert (lookup["duplicate_window"], lookup["expected_run_time"]) == ("5m", "10s")
    assert lookup["upstream"] is None
    upstream = document["offerings"]["echo"]["upstream"]
    assert (upstream["secret_env"], upstream["timeout_seconds"], upstream["max_tries"]) == (
        "SELLER_ECHO_SECRET",
        "5",
        3,
    )


def test_an_export_applied_elsewhere_makes_the_same_catalog_and_here_changes_nothing(
    tmp_path: Path,
) -> None:
    _apply(_file(tmp_path, CATALOG))
    OfferingFactory.create(slug="by-hand", price=123_456, stock=None)  # made in the admin
    exported = _file(tmp_path, _export(), "exported.yaml")
    before = _snapshot()

    here = _apply(exported)
    assert "~ by-hand: now owned by exported.yaml (nothing else changed)" in here
    assert "price" not in here and "version" not in here
    owner = ("catalog_file", "catalog_sha256", "catalog_stock")
    assert _without(_snapshot(), owner) == _without(before, owner)  # only the owner moved

    Upstream.objects.all().delete()
    Offering.objects.all().delete()  # another deployment's empty catalog
    _apply(exported)
    # The same catalog: new ids, and a new offering with an upstream starts at version 2.
    fresh = ("id", "version", *owner)
    assert _without(_snapshot(), fresh) == _without(before, fresh)
    assert _apply(exported).count("nothing to change") == 1


def test_export_refuses_an_upstream_url_that_carries_credentials() -> None:
    offering = OfferingFactory.create(slug="leaky")
    Upstream.objects.create(
        offering=offering, kind="http", url="https://u:pw@x.example/", secret_env="X"
    )
    with pytest.raises(CommandError, match=r"offerings\.leaky\.upstream\.url: carries credentials"):
        _export()


# --- import-openapi: a draft from the seller's OpenAPI 3 document, never applied ---------
HTTP_JOB_OPENAPI = Path(__file__).resolve().parents[2] / "docs/upstreams-http-job.openapi.yaml"


def _draft(spec: Path, tmp_path: Path, *args: str) -> Path:
    target = tmp_path / "draft.yaml"
    call_command(
        "offerings", "import-openapi", str(spec), "--base-url", "https://api.seller.example/v1",
        "-o", str(target), *args, stdout=StringIO(), stderr=StringIO(),
    )  # fmt: skip
    return target


def test_import_openapi_drafts_one_offering_per_operation_for_review(tmp_path: Path) -> None:
    draft = _draft(HTTP_JOB_OPENAPI, tmp_path)

    assert not Offering.objects.exists()  # drafted, never applied
    text = draft.read_text()
    document = yaml.safe_load(text)
    offerings = document["offerings"]
    assert list(offerings) == ["find-job-by-key", "create-job", "get-job", "get-job-result"]
    create = offerings["create-job"]
    assert create["input_schema"]["required"] == ["operation", "input"]  # from the JSON body
    assert create["upstream"] == {
        "kind": "http",
        "url": "https://api.seller.example/v1/jobs",
        "method": "POST",
        "input_mode": "json",
        "secret_env": "TOLLBOOTH_UPSTREAM_SECRET",
        "timeout_seconds": 10,
    }
    find = offerings["find-job-by-key"]
    assert find["input_schema"] == {
        "type": "object",
        "properties": {"idempotency_key": {"type": "string"}},
        "required": ["idempotency_key"],
    }
    assert (find["upstream"]["method"], find["upstream"]["input_mode"]) == ("GET", "query")
    assert offerings["get-job"]["is_active"] is False  # a path parameter: not one fixed URL
    assert "# REVIEW: header parameter 'Idempotency-Key' left out" in text
    assert {o["price"] for o in offerings.values()} == {"0.01 USDC"}

    with pytest.raises(CommandError, match=r"line 9: defaults\.pay_to: not an EVM address"):
        _apply(draft)  # not until a person writes the wallet in
    draft.write_text(text.replace("REVIEW: your wallet address (0x...)", SELLER))
    out = _apply(draft)
    assert "4 created" in out
    upstream = Upstream.objects.get(offering__slug="create-job")
    assert (upstream.url, upstream.method) == ("https://api.seller.example/v1/jobs", "POST")


OPENAPI_30 = """\
openapi: 3.0.3
info: {title: Seller API, version: "1"}
paths:
  /reports:
    post:
      summary: Build a report
      requestBody:
        required: true
        content:
          application/json:
            schema: {$ref: "#/components/schemas/ReportRequest"}
  /upload:
    put:
      operationId: uploadFile
      requestBody:
        content:
          application/octet-stream: {schema: {type: string, format: binary}}
components:
  schemas:
    ReportRequest:
      type: object
      required: [topic]
      properties:
        topic: {type: string}
        note: {type: string, nullable: true}
        options: {$ref: "#/components/schemas/Options"}
    Options:
      type: object
      properties:
        depth: {type: integer}
"""


def test_import_openapi_inlines_references_and_makes_3_0_schemas_json_schema(
    tmp_path: Path,
) -> None:
    spec = _file(tmp_path, OPENAPI_30, "seller.yaml")
    text = _draft(
        spec, tmp_path, "--price", "0.5 USDC", "--secret-env", "SELLER_SECRET"
    ).read_text()

    offerings = yaml.safe_load(text)["offerings"]
    report = offerings["post-reports"]
    assert report["title"] == "Build a report"
    assert report["price"] == "0.5 USDC"
    assert report["input_schema"] == {
        "type": "object",
        "properties": {
            "topic": {"type": "string"},
            "note": {"type": ["string", "null"]},
            "options": {"type": "object", "properties": {"depth": {"type": "integer"}}},
        },
        "required": ["topic"],
    }
    assert report["upstream"]["secret_env"] == "SELLER_SECRET"
    assert offerings["upload-file"]["input_schema"] == {"type": "object", "properties": {}}
    assert "# REVIEW: request body ['application/octet-stream'] is not JSON: left out" in text


@pytest.mark.parametrize(
    ("spec", "base_url", "expected"),
    [
        ("swagger: '2.0'\npaths: {}\n", "https://a.example", "not an OpenAPI 3 document"),
        (OPENAPI_30.replace("#/components/schemas/Options", "#/components/schemas/Nope"),
         "https://a.example", "#/components/schemas/Nope points at nothing"),
        ("openapi: 3.1.0\npaths: {}\n", "https://a.example", "no operations under `paths`"),
        (OPENAPI_30, "ftp://a.example", "--base-url must be an http(s) URL"),
        ("openapi: [3\n", "https://a.example", "not YAML"),
    ],
)  # fmt: skip
def test_import_openapi_refuses_what_it_cannot_draft(
    tmp_path: Path, spec: str, base_url: str, expected: str
) -> None:
    with pytest.raises(CommandError, match="catalog_invalid") as refused:
        call_command(
            "offerings", "import-openapi", str(_file(tmp_path, spec, "spec.yaml")),
            "--base-url", base_url, stdout=StringIO(),
        )  # fmt: skip
    assert expected in str(refused.value)


def test_apply_holds_the_admins_rule_that_x402_pays_in_the_networks_token(
    tmp_path: Path, settings: Any
) -> None:
    token = "0x" + "7c" * 20
    network = dict(settings.X402_NETWORKS["eip155:31337"], token_address=token)
    settings.X402_NETWORKS = {**settings.X402_NETWORKS, "eip155:31337": network}

    with pytest.raises(CommandError) as refused:
        _apply(_file(tmp_path, CATALOG))

    assert (
        f"line 4: defaults.asset: On eip155:31337 x402 payments are in the network's token {token}"
        in str(refused.value)
    )
    assert "1 problem(s)" in str(refused.value)  # once, where it is written
    assert not Offering.objects.exists()
    _apply(_file(tmp_path, CATALOG.replace(USDC_LOCAL, token)))
    assert Offering.objects.filter(asset=token).count() == 2


def test_an_offering_may_run_first_and_settle_after(tmp_path: Path) -> None:
    """The authorization flow is chosen per offering in the file; the others stay settled."""
    text = CATALOG.replace(
        "      max_tries: 3\n", "      max_tries: 3\n    delivery_condition: authorization\n"
    )
    _apply(_file(tmp_path, text))
    conditions = dict(Offering.objects.values_list("slug", "delivery_condition"))
    assert conditions == {"echo": "authorization", "lookup": "settled"}
    with pytest.raises(CommandError, match="catalog_invalid"):
        _apply(_file(tmp_path, text.replace("condition: authorization", "condition: escrow")))
