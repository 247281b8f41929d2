"""Who did something: an agent, a staff member or the system. Every timeline event names one."""

from __future__ import annotations

from dataclasses import dataclass

AGENT = "agent"
STAFF = "staff"
SYSTEM = "system"


@dataclass(frozen=True)
class Actor:
    type: str
    name: str = ""

    @classmethod
    def system(cls, name: str = "tollbooth") -> Actor:
        return cls(SYSTEM, name)

    @classmethod
    def agent(cls, name: str) -> Actor:
        return cls(AGENT, name)

    @classmethod
    def staff(cls, name: str) -> Actor:
        return cls(STAFF, name)
