"""Which owed refunds went out in a Safe Transaction Builder batch, and from which Safe.

Each export of a Safe batch is recorded (ExportBatch, kind "safe_batch") with the refunds it
holds, its network and its Safe. A transfer from that Safe that the payback watch finds for
one of those refunds is the batch being executed: the watch closes the refund through the
same on-chain verification as a pasted hash (finality respected, one transfer log per
refund), with no click from finance. A transfer from any other seller wallet is only
offered as a match, as before.
"""

from __future__ import annotations

from collections import defaultdict

from payments.models import ExportBatch

SAFE_BATCH = "safe_batch"


def safe_exported_refunds(*, network: str, refund_ids: list[int]) -> dict[int, set[str]]:
    """For each of `refund_ids` exported in a Safe batch on `network`: the Safes (lower-case)
    whose batches hold it. One query; batches are few (one per payout run)."""
    wanted = set(refund_ids)
    found: dict[int, set[str]] = defaultdict(set)
    batches = ExportBatch.objects.filter(kind=SAFE_BATCH, filters__network=network)
    for filters in batches.values_list("filters", flat=True).iterator():
        safe = str(filters.get("safe") or "").lower()
        if not safe:
            continue  # exported before the Safe was recorded: matches are offered instead
        for refund_id in filters.get("refunds", []):
            if refund_id in wanted:
                found[refund_id].add(safe)
    return dict(found)
