"""The back office: support's and finance's admin, at the top floor.

Every change goes through a purchases service (which writes the timeline), so the admin of
payment records lives here too, not in payments (which never imports purchases).
"""

from purchases.admin import catalog, evidence, finance, payments, purchases

__all__ = ["catalog", "evidence", "finance", "payments", "purchases"]
