"""The EIP-4361 text we verify against is the text the official client signs: the x402 SDK's
own formatter (signinwithethereum, in the client's environment) prepares every variant of a
proof exactly as payments.rails.x402.sign_in.siwe_message does."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from x402.extensions.sign_in_with_x import SIWxPayload

from payments.rails.x402.sign_in import STATEMENT, siwe_message

BASE: dict[str, Any] = {
    "domain": "127.0.0.1:8123",
    "address": "0x857b06519E91e3A54538791bDbb0E22373e36b66",
    "uri": "http://127.0.0.1:8123/x402/csv-report",
    "version": "1",
    "chainId": "eip155:31337",
    "type": "eip191",
    "nonce": "a1b2c3d4e5f67890a1b2c3d4e5f67890",
    "issuedAt": "2026-12-02T01:02:03.456Z",
    "signature": "0x00",
}
VARIANTS: list[dict[str, Any]] = [
    {
        **BASE,
        "statement": STATEMENT,
        "expirationTime": "2026-12-02T01:07:03.456Z",
        "resources": [BASE["uri"]],
    },
    BASE,
    {
        **BASE,
        "notBefore": "2026-12-02T01:02:00.000Z",
        "requestId": "req-1",
        "resources": ["https://a.example/1", "https://b.example/2"],
    },
]
# The SDK's formatter, as its client hook calls it (x402.extensions.sign_in_with_x.evm).
SDK = """
import json, sys
from x402.extensions.sign_in_with_x import SIWxPayload, format_siwe_message
for variant in json.loads(sys.stdin.read()):
    payload = SIWxPayload.model_validate(variant)
    print(json.dumps(format_siwe_message(payload, payload.address)))
"""


def test_our_message_is_the_one_the_sdk_signs(siwx_python: Path) -> None:
    done = subprocess.run(
        [str(siwx_python), "-c", SDK],
        input=json.dumps(VARIANTS),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    theirs = [json.loads(line) for line in done.stdout.strip().splitlines()]

    ours = [siwe_message(SIWxPayload.model_validate(variant)) for variant in VARIANTS]

    assert ours == theirs
    assert "Chain ID: 31337" in ours[0] and f"\n\n{STATEMENT}\n\n" in ours[0]
