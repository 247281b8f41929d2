import json

from django.core.management.base import BaseCommand

from devtools.demo_seed import demo_seed


class Command(BaseCommand):
    help = "Create or refresh the demo offerings, agents and staff logins (prints them as JSON)."

    def add_arguments(self, parser) -> None:  # type: ignore[no-untyped-def]
        parser.add_argument("--asset", help="Token address the offerings are priced in.")
        parser.add_argument("--pay-to", help="Seller wallet.")
        parser.add_argument("--network", help="CAIP-2 network id.")
        parser.add_argument(
            "--upstream-url",
            help="Where the sample upstream's /work listens: seeds the offering it sells.",
        )
        parser.add_argument(
            "--wallets", help='JSON {"agent name": "0x wallet"} for the demo agents.'
        )

    def handle(self, *args, **options) -> None:  # type: ignore[no-untyped-def]
        overrides: dict = {
            k: options[k] for k in ("asset", "pay_to", "network", "upstream_url") if options.get(k)
        }
        if options.get("wallets"):
            overrides["wallets"] = json.loads(options["wallets"])
        self.stdout.write(json.dumps(demo_seed(**overrides), indent=2))
