from django.apps import AppConfig


class PurchasesConfig(AppConfig):
    name = "purchases"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Registers the OpenAPI description of the API-key authentication.
        import purchases.api.schema  # noqa: F401
