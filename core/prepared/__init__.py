"""Statements of a fixed shape written once per process instead of compiled on every call.

The paid request's and the prepaid pay's statements never change shape, only their
parameters do; the ORM compiles them anew on every call, which was most of their Python CPU
(docs/benchmarks.md, issue 11). One module per kind:

- `reads`: `PreparedQuery`, a queryset compiled once with sentinel parameters, its rows made
  into instances as the ORM makes them;
- `raw`: `PreparedRaw`, a raw statement of ours whose columns are resolved once;
- `writes`: `PreparedUpdate` (a queryset's update()), compiled once per shape;
- `inserts`: new rows written by hand (`insert_rows`), their text written once per shape.

A model's save() is Django's own: no private `_do_update` / `_do_insert` is overridden here.

Kept after a re-measure (house step 3, issue 32, 2026-12-07): the same tree with these
statements back to querysets, update() and raw() spent 1.53x the CPU per paid x402 request
(median of 7 paired rounds, 1.41 to 1.57; 28.6 against 40.4 ms, `bench/cpu_pairs.py`), far
past the 5% a fast path must save to stay. Compiling a queryset with subqueries and
annotations costs more than running it.
"""

from core.prepared.raw import PreparedRaw
from core.prepared.reads import PreparedQuery
from core.prepared.writes import PreparedUpdate

__all__ = ["PreparedQuery", "PreparedRaw", "PreparedUpdate"]
