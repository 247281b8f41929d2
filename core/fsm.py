"""The state field every model uses: django-fsm's, with its protection lifted per thread.

django-fsm's `refresh_from_db` sets `protected = False` on the field object for the length
of the reload and back to True after it. The field object is one per model class, shared by
every thread of the process, so under threads (gunicorn's gthread workers, the MCP door's
pool) one thread's reload re-armed the protection in the middle of another's, which then
failed with "Direct state modification is not allowed": a 500 to an agent retrying its
payment. Here the flag django-fsm toggles is the calling thread's own; every other thread
keeps the field's declared value. Nothing else about the field changes, so migrations keep
naming django-fsm's field (`deconstruct`).
"""

from __future__ import annotations

import threading
from typing import Any

import django_fsm


class FSMField(django_fsm.FSMField):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._declared_protected = bool(kwargs.get("protected", False))
        self._lifted_here = threading.local()
        super().__init__(*args, **kwargs)

    @property  # type: ignore[override]
    def protected(self) -> bool:
        return getattr(self._lifted_here, "protected", self._declared_protected)

    @protected.setter
    def protected(self, value: bool) -> None:
        self._lifted_here.protected = value

    def deconstruct(self) -> Any:
        name, _path, args, kwargs = super().deconstruct()
        return name, "django_fsm.FSMField", args, kwargs
