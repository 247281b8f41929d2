from django.apps import AppConfig


class PurchasesConfig(AppConfig):
    name = "purchases"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # A facilitator refusing our credentials becomes an alert (connecting does no I/O).
        from payments.rails.x402.facilitator import facilitator_refused
        from purchases.services.shared.alerts import on_facilitator_refused

        facilitator_refused.connect(on_facilitator_refused, dispatch_uid="facilitator_refused")

        # Registered here, run only where a database is named (it reads the catalog).
        from django.core import checks

        from purchases.checks import local_network_offerings_check

        checks.register(local_network_offerings_check, checks.Tags.database)
