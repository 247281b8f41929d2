"""Sign a 402's sign-in-with-x challenge with the official client hook, and print the
SIGN-IN-WITH-X header it would send (run in the sign-in environment, tests/agents/conftest.py).

    siwx_sign.py REQUEST_URL PAYMENT_REQUIRED_HEADER      (BUYER_KEY in the environment)

The x402 SDK's own `create_siwx_client_hook` decides and signs (it checks the challenge is
bound to REQUEST_URL's origin, picks the chain, formats the EIP-4361 message with
signinwithethereum); the tests then send, alter or replay what it made. Prints one JSON
line: {"header": ...} or {"header": null} when the hook declines.
"""

import asyncio
import json
import os
import sys

from eth_account import Account
from x402.extensions.sign_in_with_x import create_siwx_client_hook
from x402.http.utils import decode_payment_required_header
from x402.schemas import PaymentRequiredContext

request_url, required_header = sys.argv[1], sys.argv[2]
hook = create_siwx_client_hook(Account.from_key(os.environ["BUYER_KEY"]))
context = PaymentRequiredContext(
    payment_required=decode_payment_required_header(required_header), request_url=request_url
)
result = asyncio.run(hook(context))
print(json.dumps({"header": result.headers["sign-in-with-x"] if result else None}))
