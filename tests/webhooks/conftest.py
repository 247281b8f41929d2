from tests.webhooks.receiver import receiver

__all__ = ["receiver"]
