"""The demo and local development: embedded defaults, debug on."""

from .base import *  # noqa: F403
from .base import env

# Demo and test tooling (anvil, the test USDC, the demo seed); never in production.
INSTALLED_APPS = [*INSTALLED_APPS, "devtools"]  # noqa: F405

DEBUG = env.bool("DJANGO_DEBUG", default=True)

# No TOLLBOOTH_RECEIPT_KEY: the demo signs receipts with a key generated once under var/.
RECEIPTS = {**RECEIPTS, "KEY_FILE": VAR_DIR / "receipt-key.hex"}  # noqa: F405
