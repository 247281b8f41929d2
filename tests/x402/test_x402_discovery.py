"""Discovery in the bazaar shape, checked with the x402 SDK's own bazaar types and validators
(x402.extensions.bazaar): `/.well-known/x402` items and the 402's `extensions.bazaar`.

An HTTP item gives an example input (`body`), not a JSON schema where the example goes,
plus `description` and `mimeType`; the schema that validates the description travels
beside it. A facilitator reading the payment a client echoes finds the same description.
"""

from __future__ import annotations

import pytest
from jsonschema import Draft202012Validator
from rest_framework.test import APIClient
from x402.extensions.bazaar import (
    BodyDiscoveryExtension,
    BodyDiscoveryInfo,
    extract_discovery_info,
    validate_discovery_extension,
)
from x402.extensions.bazaar.facilitator import validate_discovery_extension_spec
from x402.extensions.bazaar.types import parse_discovery_extension
from x402.http.utils import decode_payment_required_header
from x402.schemas import PaymentRequired

from purchases.models import Offering

pytestmark = [pytest.mark.django_db, pytest.mark.embedded]
INPUT = {"title": "Sales", "csv": "region,units\nnorth,3\n"}


@pytest.fixture
def client() -> APIClient:
    return APIClient()


def _valid_body_description(bazaar: dict, offering: Offering) -> BodyDiscoveryExtension:
    """What a facilitator checks: the SDK parses it as a body (POST) description, its info
    validates against its schema and the protocol rules, and the example is a valid input."""
    extension = parse_discovery_extension(bazaar)
    assert isinstance(extension, BodyDiscoveryExtension)
    checked = validate_discovery_extension(extension)
    assert checked.valid, checked.errors
    spec = validate_discovery_extension_spec(bazaar)
    assert spec.valid, spec.errors
    body = extension.info.input.body
    assert extension.info.input.method == "POST" and extension.info.input.body_type == "json"
    assert body and "$schema" not in body and "properties" not in body  # an example, no schema
    assert not list(Draft202012Validator(offering.input_schema).iter_errors(body))
    return extension


def test_discovery_items_have_the_bazaar_shape(client, x402_world):
    document = client.get("/.well-known/x402").json()
    url = f"http://testserver{x402_world.paid_url}"
    (item,) = [i for i in document["items"] if i["resource"] == url]
    assert item["type"] == "http" and item["x402Version"] == 2
    assert item["description"] and item["mimeType"] == "application/json"
    assert document["pagination"]["total"] == len(document["items"])
    extension = _valid_body_description(item["extensions"]["bazaar"], x402_world.offering)
    assert extension.info.input.body == {
        "title": "Sales",
        "csv": "region,units\nnorth,3\nsouth,5\n",
    }
    # Flat inputs are bought by GET as well: an example of query values, not a schema.
    assert item["metadata"]["get"]["queryParams"] == extension.info.input.body
    assert "bodyFields" not in item["metadata"] and "input" not in item["metadata"]


def test_an_input_without_examples_gets_one_made_from_its_schema(client, x402_world):
    Offering.objects.filter(pk=x402_world.offering.pk).update(
        input_schema={
            "type": "object",
            "required": ["text", "count", "mode"],
            "properties": {
                "text": {"type": "string", "minLength": 1},
                "count": {"type": "integer", "minimum": 2},
                "mode": {"enum": ["fast", "slow"]},
                "note": {"type": "string"},
            },
        }
    )
    document = client.get("/.well-known/x402").json()
    (item,) = [i for i in document["items"] if i["type"] == "http"]
    offering = Offering.objects.get(pk=x402_world.offering.pk)
    extension = _valid_body_description(item["extensions"]["bazaar"], offering)
    assert extension.info.input.body == {"text": "example", "count": 2, "mode": "fast"}


@pytest.mark.parametrize("method", ["post", "head"])
def test_the_402_declares_the_bazaar_extension_a_facilitator_can_read(client, x402_world, method):
    offered = getattr(client, method)(x402_world.paid_url, INPUT, format="json")
    assert offered.status_code == 402
    required = decode_payment_required_header(offered["PAYMENT-REQUIRED"])
    assert isinstance(required, PaymentRequired) and required.extensions
    _valid_body_description(required.extensions["bazaar"], x402_world.offering)
    # What the facilitator sees: the client echoes the extensions in its payment.
    assert required.resource is not None
    accepted = required.accepts[0].model_dump(by_alias=True, exclude_none=True)
    payload = {
        "x402Version": 2,
        "resource": required.resource.model_dump(by_alias=True, exclude_none=True),
        "accepted": accepted,
        "payload": {},
        "extensions": required.extensions,
    }
    found = extract_discovery_info(payload, accepted)
    assert found is not None and found.method == "POST"
    assert found.resource_url == f"http://testserver{x402_world.paid_url}"
    assert found.description and found.mime_type == "application/json"
    assert isinstance(found.discovery_info, BodyDiscoveryInfo)


def test_a_description_too_large_to_echo_stays_out_of_the_402(client, x402_world):
    """Clients echo the 402's extensions in PAYMENT-SIGNATURE, whose size is bounded: a huge
    input schema must not make every payment malformed. Discovery still lists it."""
    schema = {
        "type": "object",
        "required": ["text"],
        "properties": {"text": {"type": "string", "description": "x" * 20_000}},
    }
    Offering.objects.filter(pk=x402_world.offering.pk).update(input_schema=schema)
    offered = client.post(x402_world.paid_url, {"text": "hello"}, format="json")
    required = decode_payment_required_header(offered["PAYMENT-REQUIRED"])
    assert isinstance(required, PaymentRequired)
    assert "bazaar" not in (required.extensions or {})
    (item,) = [i for i in client.get("/.well-known/x402").json()["items"] if i["type"] == "http"]
    assert item["extensions"]["bazaar"]["info"]["input"]["body"] == {"text": "example"}
