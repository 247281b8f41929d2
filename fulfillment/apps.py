from django.apps import AppConfig


class FulfillmentConfig(AppConfig):
    name = "fulfillment"
    default_auto_field = "django.db.models.BigAutoField"
