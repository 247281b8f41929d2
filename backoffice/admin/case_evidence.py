"""The purchase page's "Download evidence pack" (issue 33, part 3; docs/evidence.md): a POST
for the roles the table grants `export_evidence` (support, finance; superusers), answered
with the signed pack as a download, its export on the timeline first (who, when, SHA-256)."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseNotAllowed

from backoffice.evidence_pack import evidence_pack_export
from backoffice.roles import EXPORT_EVIDENCE
from core.actors import Actor
from core.errors import DomainError


def evidence_download_view(model_admin: Any, request: HttpRequest, object_id: str) -> HttpResponse:
    if request.method != "POST":
        return HttpResponseNotAllowed(["POST"])
    purchase = model_admin.get_object(request, object_id)
    if purchase is None:
        raise Http404
    if not model_admin.role_allows_action(request, EXPORT_EVIDENCE):
        raise PermissionDenied
    try:
        pack = evidence_pack_export(
            purchase_ref=purchase.ref,
            actor=Actor.staff(request.user.get_username()),
            channel="admin",
        )
    except DomainError as exc:
        raise Http404 from exc
    response = HttpResponse(pack.text.encode(), content_type="application/json; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="{pack.filename}"'
    response["X-Content-SHA256"] = pack.sha256
    response["Cache-Control"] = "no-store"
    return response
