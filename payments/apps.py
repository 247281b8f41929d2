import sys

from django.apps import AppConfig

from core.input_limits import SAFE_RECURSION_LIMIT


class PaymentsConfig(AppConfig):
    name = "payments"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # py_ecc (under web3 and eth-account) raises the recursion limit to 100,000 when it is
        # first imported. At that depth a deeply nested document overflows the C stack and
        # kills the process (SIGSEGV) instead of raising RecursionError. Import it here so its
        # side effect happens now, once, then put a limit back that the stack can hold.
        import py_ecc  # noqa: F401

        sys.setrecursionlimit(SAFE_RECURSION_LIMIT)

        from django.core import checks

        from payments.rails.x402.networks import facilitator_credentials_check

        checks.register(facilitator_credentials_check)
