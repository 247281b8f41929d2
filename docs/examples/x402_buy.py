"""Buy from a Tollbooth paid URL with the official x402 Python client, unmodified.

    python docs/examples/x402_buy.py URL '{"title": "Sales", "csv": "a,b\\n1,2\\n"}'

Environment: BUYER_KEY (0x private key), NETWORK (the CAIP-2 network from the 402), TOKEN (a
local test token to allow; unset for a USDC the client knows, e.g. Base's), TIMEOUT (seconds).
Prints what the caller got as one JSON line. The tests run this file as it is
(tests/x402/test_stock_clients.py, and the mainnet rehearsal: scripts/rehearsal.py).
"""

import json
import os
import sys

import requests
from eth_account import Account
from x402 import x402ClientSync
from x402.http.clients.requests import PaymentError, wrapRequestsWithPayment
from x402.mechanisms.evm.exact import ExactEvmClientScheme

url, body = sys.argv[1], json.loads(sys.argv[2])
network, token = os.environ["NETWORK"], os.environ.get("TOKEN", "")

client = x402ClientSync()
client.register(network, ExactEvmClientScheme(signer=Account.from_key(os.environ["BUYER_KEY"])))
# The client pays well-known USDC addresses only; a local test token must be allowed.
if token:
    client.set_spend_controls({"allowed_assets": [{"network": network, "asset": token}]})
session = wrapRequestsWithPayment(requests.Session(), client)

try:
    response = session.post(url, json=body, timeout=float(os.environ.get("TIMEOUT", "30")))
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
