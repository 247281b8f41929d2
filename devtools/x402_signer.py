"""A minimal x402 buyer: answer a PAYMENT-REQUIRED with a signed EIP-3009 authorization.

Used by the demo agent. It follows the client discipline: the caller stores the payment
id and the header this returns before sending, and resends the same header after a crash.
"""

from __future__ import annotations

import time

from eth_account.signers.local import LocalAccount
from x402.http.utils import decode_payment_required_header, encode_payment_signature_header
from x402.schemas import PaymentPayload, PaymentRequired

from devtools.test_token import sign_transfer_authorization


def payment_signature_for(
    required_header: str,
    account: LocalAccount,
    payment_id: str,
    *,
    chain_id: int,
    valid_before: int | None = None,
) -> str:
    """Sign the first `accepts` entry and echo the payment-identifier extension with our id.
    `valid_before` shortens the window (the demo's closed-window situation)."""
    required = decode_payment_required_header(required_header)
    if not isinstance(required, PaymentRequired):
        raise ValueError("only x402 v2 PAYMENT-REQUIRED is supported")
    requirement = required.accepts[0]
    extra = requirement.extra or {}
    signed = sign_transfer_authorization(
        account,
        token_address=requirement.asset,
        chain_id=chain_id,
        name=extra["name"],
        version=extra["version"],
        to=requirement.pay_to,
        value=int(requirement.amount),
        valid_after=0,
        # Valid exactly as long as the seller asked: long enough to settle, no longer.
        valid_before=valid_before or int(time.time()) + requirement.max_timeout_seconds,
    )
    payload = PaymentPayload(
        x402_version=2,
        payload=dict(signed),
        accepted=requirement,
        resource=required.resource,
        extensions={"payment-identifier": {"info": {"required": True, "id": payment_id}}},
    )
    return encode_payment_signature_header(payload)
