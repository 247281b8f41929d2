from tests.admin.test_admin import finance, superuser, support
from tests.webhooks.receiver import receiver

__all__ = ["finance", "receiver", "superuser", "support"]
