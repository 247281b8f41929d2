import pytest
from django.test import Client

pytestmark = pytest.mark.django_db


def test_openapi_schema_and_docs_page_are_served():
    client = Client()
    schema = client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert schema.status_code == 200
    paths = schema.json()["paths"]
    for path in (
        "/api/v1/quotes",
        "/api/v1/quotes/{public_id}/purchase",
        "/api/v1/purchases/{ref}",
        "/api/v1/purchases/{ref}/result",
        "/api/v1/receipts/{public_id}",
    ):
        assert path in paths
    docs = client.get("/api/docs/")
    assert docs.status_code == 200
    assert b"swagger-ui" in docs.content


def test_schema_declares_the_api_key_and_problem_json_errors():
    schema = Client().get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()
    assert schema["components"]["securitySchemes"]["ApiKey"] == {
        "type": "http",
        "scheme": "bearer",
        "description": "`Authorization: Bearer <api key>`; the key names the buyer.",
    }
    quotes = schema["paths"]["/api/v1/quotes"]["post"]
    assert quotes["security"] == [{"ApiKey": []}]
    assert {"ApiKey": []} in schema["paths"]["/x402/{offering}"]["post"]["security"]
    for path, methods in schema["paths"].items():
        for method, operation in methods.items():
            errors = {s: r for s, r in operation["responses"].items() if s[0] in "45"}
            assert {"400", "500"} <= set(errors), (path, method)
            for status, response in errors.items():
                assert list(response["content"]) == ["application/problem+json"], (path, status)
    assert {"401", "404", "409", "413", "415", "422", "429"} <= set(quotes["responses"])


def test_the_paid_url_declares_invalid_input_on_post_and_throttling_on_both_methods():
    schema = Client().get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()
    paid = schema["paths"]["/x402/{offering}"]
    assert "422" in paid["post"]["responses"] and "429" in paid["post"]["responses"]
    assert "429" in paid["get"]["responses"] and "422" not in paid["get"]["responses"]
    for method in ("post", "get"):
        for status in ("422", "429"):
            response = paid[method]["responses"].get(status)
            if response:
                assert list(response["content"]) == ["application/problem+json"]
                assert response["description"]


def test_unrouted_paths_answer_problem_json():
    response = Client().get("/x402/not a slug")
    assert response.status_code == 404
    assert response["Content-Type"] == "application/problem+json"
    assert response.json()["code"] == "not_found"


def test_outages_throttles_and_the_duplicate_answer_are_declared():
    """What a client generated from the schema must handle (issue 33): every operation may
    answer 503 when a dependency is down, and that and a 429 say when to come back; paying
    a quote may answer 200, a repeat of a purchase already paid."""
    schema = Client().get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()
    for path, methods in schema["paths"].items():
        for method, operation in methods.items():
            responses = operation["responses"]
            if path.startswith(("/api/v1/", "/x402/")):  # they read the database
                assert "503" in responses, (path, method)
            for status in ("429", "503"):
                if status in responses:
                    assert "Retry-After" in responses[status]["headers"], (path, method, status)
    pay = schema["paths"]["/api/v1/quotes/{public_id}/purchase"]["post"]["responses"]
    assert {"200", "201"} <= set(pay)
    assert "already paid" in pay["200"]["description"]
    assert "Idempotent-Replayed" in pay["201"]["description"]
