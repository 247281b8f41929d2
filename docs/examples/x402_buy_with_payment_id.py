"""Buy with the official x402 Python client and the SDK's payment-identifier hook.

    PAYMENT_ID=order-0001-0001-0001 python docs/examples/x402_buy_with_payment_id.py URL '{...}'

As docs/examples/x402_buy.py, plus one hook: before each payment is created, the SDK's
`append_payment_identifier_to_extensions` puts PAYMENT_ID into the payload. Called again
after a timeout with the same PAYMENT_ID, the client signs a new authorization (a new
nonce) under the same id: Tollbooth answers that call with the first one's purchase and
never charges it again. The tests run this file as it is
(tests/x402/test_sdk_payment_id_client.py).
"""

import json
import os
import sys

import requests
from eth_account import Account
from x402 import x402ClientSync
from x402.extensions.payment_identifier import append_payment_identifier_to_extensions
from x402.http.clients.requests import PaymentError, wrapRequestsWithPayment
from x402.mechanisms.evm.exact import ExactEvmClientScheme

url, body = sys.argv[1], json.loads(sys.argv[2])
network, token = os.environ["NETWORK"], os.environ["TOKEN"]
payment_id = os.environ["PAYMENT_ID"]  # store it with the order: one id per purchase


def add_payment_id(context):
    """The SDK's hook: the same id on every payment this process makes for the order."""
    extensions = context.payment_required.extensions
    if extensions is not None:
        append_payment_identifier_to_extensions(extensions, payment_id)


client = x402ClientSync()
client.register(network, ExactEvmClientScheme(signer=Account.from_key(os.environ["BUYER_KEY"])))
client.set_spend_controls({"allowed_assets": [{"network": network, "asset": token}]})
client.on_before_payment_creation(add_payment_id)
session = wrapRequestsWithPayment(requests.Session(), client)

try:
    response = session.post(url, json=body, timeout=float(os.environ.get("TIMEOUT", "30")))
except (requests.Timeout, PaymentError) as error:
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
