"""The walk of one request through the project's code: where a reader has to look (issue 20).

`Walk` is a context manager that records, with `sys.setprofile`, every call into a project
function (doors/, backoffice/, purchases/, payments/, fulfillment/, core/, config/) made from
another file: a *stop*, where a reader following the request opens a file. It counts

- **stops**: calls into project code from another file (Django, a library, another of ours);
- **files**: the project files visited;
- **returns**: stops into a file already visited (a reader going back to a file).

Calls inside one file (a helper beside its caller, a comprehension) are not stops. The
drivers are run by hand through pytest, for the suite's fixtures (not collected: their
names do not start with `test_`):

    DATABASE_URL=postgres://... REDIS_URL=redis://... .venv/bin/python -m pytest \\
        bench/by_hand/walk_paid_request.py bench/by_hand/walk_prepaid_pay.py -q -s \\
        -p no:cacheprovider

Each prints its figures and the files in order of first visit with their stop counts;
WALK_STOPS=1 prints every stop too.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tuple(
    f"{ROOT}/{app}/"
    for app in ("doors", "backoffice", "purchases", "payments", "fulfillment", "core", "config")
)


def _ours(filename: str) -> bool:
    return filename.startswith(PROJECT) and "/migrations/" not in filename


@dataclass
class Walk:
    """Record the stops of everything run inside the block (this thread only)."""

    stops: list[tuple[str, str]] = field(default_factory=list)  # (file, function)
    _previous: Any = None

    def __enter__(self) -> Walk:
        self._previous = sys.getprofile()
        sys.setprofile(self._profile)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        sys.setprofile(self._previous)

    def _profile(self, frame: FrameType, event: str, _arg: Any) -> None:
        if event != "call":
            return
        filename = frame.f_code.co_filename
        if not _ours(filename):
            return
        caller = frame.f_back
        if caller is not None and caller.f_code.co_filename == filename:
            return
        self.stops.append((os.path.relpath(filename, ROOT), frame.f_code.co_qualname))

    @property
    def files(self) -> list[str]:
        return list(dict.fromkeys(name for name, _function in self.stops))

    @property
    def returns(self) -> int:
        seen: set[str] = set()
        count = 0
        for name, _function in self.stops:
            count += name in seen
            seen.add(name)
        return count

    def figures(self) -> dict[str, int]:
        return {"stops": len(self.stops), "files": len(self.files), "returns": self.returns}

    def report(self, title: str) -> str:
        figures = self.figures()
        lines = [
            f"walk of {title}: {figures['stops']} stops, {figures['files']} files, "
            f"{figures['returns']} returns to a file already visited"
        ]
        per_file = Counter(name for name, _function in self.stops)
        lines += [f"  {per_file[name]:4d}  {name}" for name in self.files]
        if os.environ.get("WALK_STOPS"):
            lines += [f"    {name}::{function}" for name, function in self.stops]
        return "\n".join(lines)
