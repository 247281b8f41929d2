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
