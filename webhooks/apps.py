from django.apps import AppConfig


class WebhooksConfig(AppConfig):
    name = "webhooks"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # The timeline writer (purchases.events) calls our listener for every event it
        # records; purchases never imports this app (it sits above purchases).
        from django.db.models.signals import post_delete, post_save

        from purchases.events import event_listener_add
        from webhooks.events import endpoint_changed, webhook_event_listen
        from webhooks.models import WebhookEndpoint

        event_listener_add(webhook_event_listen)
        post_save.connect(endpoint_changed, sender=WebhookEndpoint)
        post_delete.connect(endpoint_changed, sender=WebhookEndpoint)
