"""The one JSON parser of the API: bounded in size and depth before anything is decoded."""

from __future__ import annotations

from collections.abc import Mapping
from typing import IO, Any

from django.conf import settings
from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser

from core.errors import DomainError, ErrorCode
from core.input_limits import JsonTooDeep, RefusedText, json_loads_bounded


def json_body_decode(raw: bytes) -> Any:
    """Decode a request body. Raises DomainError: json_too_deep, invalid_text; ParseError."""
    try:
        return json_loads_bounded(raw)
    except JsonTooDeep as exc:
        raise DomainError(ErrorCode.JSON_TOO_DEEP, str(exc)) from exc
    except RefusedText as exc:
        raise DomainError(ErrorCode.INVALID_TEXT, str(exc)) from exc
    except ValueError as exc:
        raise ParseError(f"JSON parse error - {exc}") from exc


def body_size_check(meta: Mapping[str, Any]) -> None:
    """Refuse a declared Content-Length over the limit before reading a byte of it."""
    try:
        declared = int(meta.get("CONTENT_LENGTH") or 0)
    except ValueError:
        declared = 0
    if declared > settings.TOLLBOOTH["MAX_BODY_BYTES"]:
        raise DomainError(ErrorCode.REQUEST_TOO_LARGE)


class BoundedJSONParser(JSONParser):
    """DRF's JSON parser with the limits of core.input_limits and a body-size cap."""

    def parse(
        self,
        stream: IO[Any] | None,
        media_type: str | None = None,
        parser_context: Mapping[str, Any] | None = None,
    ) -> Any:
        request = (parser_context or {}).get("request")
        if request is not None:
            body_size_check(request.META)
        limit = settings.TOLLBOOTH["MAX_BODY_BYTES"]
        raw = stream.read(limit + 1) if stream is not None else b""
        if len(raw) > limit:
            raise DomainError(ErrorCode.REQUEST_TOO_LARGE)
        return json_body_decode(raw)
