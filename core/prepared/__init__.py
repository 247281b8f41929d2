"""Statements of a fixed shape written once per process instead of compiled on every call.

The paid request's and the prepaid pay's statements never change shape, only their
parameters do; the ORM compiles them anew on every call, which was most of their Python CPU
(docs/benchmarks.md, issue 11). Three kinds, one module each:

- `reads`: `PreparedQuery`, a queryset compiled once with sentinel parameters, its rows made
  into instances as the ORM makes them;
- `raw`: `PreparedRaw`, a raw statement of ours whose columns are resolved once;
- `writes`: `PreparedTransitionMixin` (FSM saves as a conditional UPDATE, new rows'
  INSERT), `PreparedUpdate` (a queryset's update()) and the INSERT text of new rows written
  by hand, each once per shape.
"""

from core.prepared.raw import PreparedRaw
from core.prepared.reads import PreparedQuery
from core.prepared.writes import PreparedTransitionMixin, PreparedUpdate

__all__ = ["PreparedQuery", "PreparedRaw", "PreparedTransitionMixin", "PreparedUpdate"]
