from django.apps import AppConfig


class PurchasesConfig(AppConfig):
    name = "purchases"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Registers the OpenAPI description of the API-key authentication.
        import purchases.api.schema  # noqa: F401
        from core.admin import role_table_install
        from purchases.roles import NEVER_SHOWN, ROLE_TABLE

        # Who sees which admin field is this app's table; the admin kernel applies it.
        role_table_install(ROLE_TABLE, NEVER_SHOWN)
