"""The back-office world and staff clients, shared by every admin test module."""

from tests.admin.test_admin import finance, superuser, support, world
from tests.admin.test_case_file_admin import cases

__all__ = ["cases", "finance", "superuser", "support", "world"]
