"""Buy with the official x402 Python client and its sign-in-with-x hooks, unmodified: the
first call pays; a later call for the same input signs in with the wallet and gets the
result again without paying, while Tollbooth keeps it.

    python docs/examples/x402_sign_in.py URL '{"title": "Sales", "csv": "a,b\\n1,2\\n"}'

Its own environment: `pip install -r tests/agents/siwx-requirements.txt` (x402[evm,httpx,
extensions]==2.25.0; the hooks need signinwithethereum, which needs web3 < 8). Environment:
BUYER_KEY (0x private key), TOKEN and NETWORK (the asset and CAIP-2 network from the 402),
TIMEOUT (seconds); PAY=0 registers no payment scheme, so the call can only sign in (a
refused sign-in then ends in the SDK's PaymentError). Prints what the caller got as one JSON
line. The tests run this file as it is (tests/agents/test_wallet_sign_in.py).
"""

import asyncio
import json
import os
import sys

from eth_account import Account
from x402 import x402Client
from x402.extensions.sign_in_with_x import (
    CreateSIWxClientExtensionOptions,
    create_siwx_client_extension,
)
from x402.http.clients.httpx import PaymentError, wrapHttpxWithPayment
from x402.mechanisms.evm.exact import ExactEvmClientScheme

url, body = sys.argv[1], json.loads(sys.argv[2])
network, token = os.environ["NETWORK"], os.environ["TOKEN"]
wallet = Account.from_key(os.environ["BUYER_KEY"])

client = x402Client()
if os.environ.get("PAY", "1") == "1":
    client.register(network, ExactEvmClientScheme(signer=wallet))
    # The client pays well-known USDC addresses only; a local test token must be allowed.
    client.set_spend_controls({"allowed_assets": [{"network": network, "asset": token}]})
# On a 402 that declares sign-in-with-x, sign in with the wallet first; pay only if refused.
client.register_extension(
    create_siwx_client_extension(CreateSIWxClientExtensionOptions(signers=[wallet]))
)


async def main() -> dict:
    timeout = float(os.environ.get("TIMEOUT", "30"))
    async with wrapHttpxWithPayment(client, timeout=timeout) as http:
        try:
            response = await http.post(url, json=body)
        except PaymentError as error:
            return {"outcome": "payment_error", "error": str(error)}
    return {
        "outcome": "response",
        "status": response.status_code,
        "headers": {k.lower(): v for k, v in response.headers.items()},
        "body": response.text,
    }


print(json.dumps(asyncio.run(main())))
