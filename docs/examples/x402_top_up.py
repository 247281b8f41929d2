"""Top up a Tollbooth prepaid balance with the official x402 Python client, unmodified.

    python docs/examples/x402_top_up.py 'https://seller.example/x402/top-up?amount=2500000'

The amount (atomic units: USDC 2500000 = 2.50) is in the URL; the API key names the balance
credited. Environment: API_KEY, BUYER_KEY (0x private key of the paying wallet), NETWORK (the
CAIP-2 network from the 402), TOKEN (a local test token to allow; unset for a USDC the client
knows), TIMEOUT (seconds). Prints what the caller got as one JSON line. The tests run this file
as it is (tests/x402/test_top_up_stock_client.py).
"""

import json
import os
import sys
from decimal import Decimal

import requests
from eth_account import Account
from x402 import x402ClientSync
from x402.http.clients.requests import PaymentError, wrapRequestsWithPayment
from x402.mechanisms.evm.exact import ExactEvmClientScheme

url = sys.argv[1]
network, token = os.environ["NETWORK"], os.environ.get("TOKEN", "")

amount = url.rsplit("amount=", 1)[-1]  # atomic units, as the 402 will ask

client = x402ClientSync()
client.register(network, ExactEvmClientScheme(signer=Account.from_key(os.environ["BUYER_KEY"])))
# The client caps each payment (USDC it knows: $1 by default) and pays only tokens it knows:
# this top-up's amount is the cap, and a local test token is allowed for it.
if token:
    client.set_spend_controls(
        {"allowed_assets": [{"network": network, "asset": token, "max_amount_per_payment": amount}]}
    )
else:
    client.set_spend_controls({"max_amount_per_payment": f"${Decimal(amount).scaleb(-6)}"})
http = requests.Session()
http.headers["Authorization"] = f"Bearer {os.environ['API_KEY']}"  # whose balance is credited
session = wrapRequestsWithPayment(http, client)

try:
    response = session.get(url, timeout=float(os.environ.get("TIMEOUT", "30")))
except (requests.Timeout, PaymentError) as error:
    # A timeout on the paid retry reaches the caller wrapped in the SDK's PaymentError.
    if not isinstance(error, requests.Timeout) and not isinstance(
        error.__cause__, requests.Timeout
    ):
        raise
    print(json.dumps({"outcome": "timeout"}))
    sys.exit(0)
print(
    json.dumps(
        {
            "outcome": "response",
            "status": response.status_code,
            "headers": {k.lower(): v for k, v in response.headers.items()},
            "body": response.text,
        }
    )
)
