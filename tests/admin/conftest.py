"""The back-office world and staff clients, shared by every admin test module."""

from tests.admin.test_admin import finance, superuser, support, world

__all__ = ["finance", "superuser", "support", "world"]
