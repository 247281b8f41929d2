"""What a lower service changed, for the orchestration to put on the timeline.

Payments and fulfilment never write the purchase timeline themselves (it belongs to the
purchases aggregate above them): they return a Change, and the caller, which holds the
transaction and the purchase lock, records it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Change:
    subject: str
    from_state: str = ""
    to_state: str = ""
    reason_code: str = ""
    evidence: dict[str, Any] = field(default_factory=dict)
