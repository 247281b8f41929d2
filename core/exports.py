"""Streamed CSV files that know what they sent: row count and SHA-256 of the exact bytes.

The rows are pulled one at a time (a server-side cursor behind them), encoded, hashed and
handed to the WSGI server, so memory stays flat however many rows there are. When the last
row has been handed over, `on_complete` gets the summary (the export batch is recorded
there). A WSGI server asks for the next chunk only after writing the previous one, so the
end of this generator means every byte went to the socket. If the client disconnects, the
server stops pulling and closes the generator: `on_complete` never runs and nothing is
recorded, because no one holds that file.
"""

from __future__ import annotations

import csv
import hashlib
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime

# Rows per chunk sent to the client: one write per row would cost a syscall each.
ROWS_PER_CHUNK = 500


@dataclass(frozen=True)
class StreamSummary:
    row_count: int  # data rows; the header is not counted
    sha256: str
    first_created_at: datetime | None
    last_created_at: datetime | None


class _Line:
    """csv.writer needs a file; this one hands each formatted row straight back."""

    def write(self, value: str) -> str:
        return value


def csv_stream(
    header: Sequence[str],
    rows: Iterable[tuple[Sequence[str], datetime | None]],
    on_complete: Callable[[StreamSummary], None],
) -> Generator[bytes, None, None]:
    """Yield the CSV as UTF-8 chunks; each row comes with its creation time (for the range)."""
    writer = csv.writer(_Line())
    digest = hashlib.sha256()
    count = 0
    first: datetime | None = None
    last: datetime | None = None
    chunk = [writer.writerow(header)]
    for values, created_at in rows:
        chunk.append(writer.writerow(values))
        count += 1
        first = first or created_at
        last = created_at or last
        if len(chunk) >= ROWS_PER_CHUNK:
            data = "".join(chunk).encode()
            digest.update(data)
            chunk = []
            yield data
    data = "".join(chunk).encode()
    digest.update(data)
    if data:
        yield data
    on_complete(StreamSummary(count, digest.hexdigest(), first, last))
