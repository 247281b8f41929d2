from django.apps import AppConfig


class PurchasesConfig(AppConfig):
    name = "purchases"
    default_auto_field = "django.db.models.BigAutoField"
