"""The anchors the API's figures are measured against: bare DRF endpoints with the API's own
authentication (an API key, one SELECT) and permission, and nothing else.

They take the project's default authentication and permission classes from REST_FRAMEWORK,
so a change to how agents authenticate moves both sides of the ratio. No throttles: the
throttle counters are part of what the real endpoints cost.
"""

from __future__ import annotations

import json

from django.db import connection
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from purchases.models import Buyer

ANCHOR_TABLE = "bench_anchor_row"
CREATE_ANCHOR_TABLE = f"""
CREATE TABLE IF NOT EXISTS {ANCHOR_TABLE} (
    id bigserial PRIMARY KEY,
    buyer_ref text NOT NULL,
    body jsonb NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
)
"""
CONSTANT_BODY = {"purchase": "pur_bench", "state": "paid", "replayed": True}


class BareApi(APIView):
    """Authenticate, answer a constant JSON body."""

    def post(self, request: Request) -> Response:
        return Response(CONSTANT_BODY)


class OneInsertApi(APIView):
    """Authenticate, parse the JSON body, INSERT it as one row (autocommit), answer 201."""

    def post(self, request: Request) -> Response:
        buyer = request.user
        assert isinstance(buyer, Buyer)  # IsAgent let it through
        with connection.cursor() as cursor:
            cursor.execute(
                f"INSERT INTO {ANCHOR_TABLE} (buyer_ref, body) VALUES (%s, %s) RETURNING id",  # noqa: S608
                [buyer.ref, json.dumps(request.data)],
            )
            (row_id,) = cursor.fetchone()
        return Response({"id": row_id}, status=201)
