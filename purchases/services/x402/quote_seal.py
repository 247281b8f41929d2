"""The anonymous quote that is never written until it is paid: its terms signed by us and
carried in the 402 (docs/x402.md, "Stateless anonymous quotes").

An anonymous 402 for an offering without stock used to write a quote row holding its input
(up to the offering's max_input_bytes) for every unpaid ask. Now the 402 carries, in
`accepts[].extra.signedQuote`, what the row would have held apart from the input itself
(the offering's version, the input's hash, the expiry) and an HMAC-SHA256 over every term:
quote ref, offering, version, price, asset, network, pay_to, input hash and expiry. The
official clients echo the requirements they pay in the payment's `accepted`; the payment
comes with the input again (the request body, the query string or the MCP arguments), whose
hash must be the signed one. The quote is then written with the purchase.

The key: X402_QUOTE_SIGNING_KEY, or one derived from SECRET_KEY (django.core.signing, salted);
fallbacks for rotation (X402_QUOTE_SIGNING_KEY_FALLBACKS, or SECRET_KEY_FALLBACKS).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.core import signing

from core.canonical import canonical_json, sha256_hex, strip_volatile
from core.errors import DomainError, ErrorCode
from core.refs import new_ref
from payments.rails.x402.wire import SIGNED_QUOTE
from purchases.models import Offering, Quote
from purchases.services.quote.quotes import quote_input_canonicalize

_SALT = "tollbooth.x402.quote"
_VERSION = "v1"
# The accepted fields the signature covers, with the code for each when it is not the
# offering's (as the rail's own check names them).
_PAID_FIELDS = (
    ("amount", "price", ErrorCode.AMOUNT_MISMATCH),
    ("asset", "asset", ErrorCode.ASSET_MISMATCH),
    ("network", "network", ErrorCode.NETWORK_MISMATCH),
    ("payTo", "pay_to", ErrorCode.RECIPIENT_MISMATCH),
)
_HEX = frozenset("0123456789abcdef")
_MAX_EPOCH = 2**40  # far beyond any expiry we sign; bounds hostile integers
_MAX_SIGNATURE_CHARS = 128


@dataclass(frozen=True)
class SealedTerms:
    """The quote a payment's `accepted` carries, as sent (checked by quote_seal_check)."""

    quote_ref: str
    offering_version: int
    input_hash: str
    expires_at: datetime
    signature: str
    accepted: dict[str, Any]


def _signer() -> signing.Signer:
    fallbacks = settings.X402_QUOTE_SIGNING_KEY_FALLBACKS or settings.SECRET_KEY_FALLBACKS
    return signing.Signer(
        key=settings.X402_QUOTE_SIGNING_KEY or settings.SECRET_KEY,
        fallback_keys=list(fallbacks),
        salt=_SALT,
        algorithm="sha256",
    )


def _message(
    *,
    quote_ref: str,
    offering_slug: str,
    offering_version: int,
    price: object,
    asset: object,
    network: object,
    pay_to: object,
    input_hash: str,
    expires_epoch: int,
) -> str:
    # Addresses lowercased: a client may checksum-case them; the rail compares them so too.
    return "|".join(
        [
            _VERSION,
            quote_ref,
            offering_slug,
            str(offering_version),
            str(price),
            str(asset).lower(),
            str(network),
            str(pay_to).lower(),
            input_hash,
            str(expires_epoch),
        ]
    )


def quote_seal(*, quote: Quote, offering: Offering) -> tuple[tuple[str, int | str], ...]:
    """The `extra.signedQuote` entries of an unwritten quote's 402."""
    expires_epoch = int(quote.expires_at.timestamp())
    message = _message(
        quote_ref=quote.public_id,
        offering_slug=offering.slug,
        offering_version=quote.offering_version,
        price=quote.price,
        asset=quote.asset,
        network=quote.network,
        pay_to=quote.pay_to,
        input_hash=quote.input_hash,
        expires_epoch=expires_epoch,
    )
    return (
        ("offeringVersion", quote.offering_version),
        ("inputHash", quote.input_hash),
        ("expiresAt", expires_epoch),
        ("signature", _signer().signature(message)),
    )


def quote_unwritten(*, offering: Offering, canonical_input: dict[str, Any], now: datetime) -> Quote:
    """An anonymous quote that holds no stock, not written (its 402 carries it signed)."""
    public_id = new_ref("qt")
    return Quote(
        public_id=public_id,
        offering=offering,
        buyer=None,
        quote_key=sha256_hex(f"anonymous|{public_id}"),
        canonical_input=canonical_input,
        input_hash=sha256_hex(canonical_json(canonical_input)),
        price=offering.price,
        asset=offering.asset,
        network=offering.network,
        pay_to=offering.pay_to,
        offering_version=offering.version,
        holds_stock=False,
        # Whole seconds: the 402 carries the expiry as a Unix time.
        expires_at=(now + timedelta(seconds=settings.X402_ANONYMOUS_QUOTE_TTL_SECONDS)).replace(
            microsecond=0
        ),
    )


def quote_seal_read(*, accepted: dict[str, Any] | None) -> SealedTerms | None:
    """The signed terms a payment's `accepted` carries; None when it carries none (a written
    quote's payment). Raises DomainError: quote_terms_invalid (present but malformed)."""
    extra = (accepted or {}).get("extra")
    sealed = extra.get(SIGNED_QUOTE) if isinstance(extra, dict) else None
    if sealed is None:
        return None
    if not isinstance(sealed, dict):
        raise _invalid("accepted.extra.signedQuote must be an object.")
    version, input_hash = sealed.get("offeringVersion"), sealed.get("inputHash")
    expires, signature = sealed.get("expiresAt"), sealed.get("signature")
    quote_ref = extra.get("quote") if isinstance(extra, dict) else None
    if (
        not isinstance(quote_ref, str)
        or type(version) is not int
        or type(expires) is not int
        or not 0 <= version < _MAX_EPOCH
        or not 0 <= expires < _MAX_EPOCH
        or not isinstance(input_hash, str)
        or len(input_hash) != 64
        or not set(input_hash) <= _HEX
        or not isinstance(signature, str)
        or not 0 < len(signature) <= _MAX_SIGNATURE_CHARS
    ):
        raise _invalid("accepted.extra.signedQuote is not as the 402 gave it.")
    return SealedTerms(
        quote_ref=quote_ref,
        offering_version=version,
        input_hash=input_hash,
        expires_at=datetime.fromtimestamp(expires, tz=UTC),
        signature=signature,
        accepted=accepted or {},
    )


def quote_seal_check(*, sealed: SealedTerms, offering: Offering) -> DomainError | None:
    """None when we signed these terms for `offering` (under the current key or a fallback);
    else the refusal: a paid term that is not the offering's gets its own mismatch code (as
    for a written quote), anything else quote_terms_invalid."""
    accepted = sealed.accepted
    message = _message(
        quote_ref=sealed.quote_ref,
        offering_slug=offering.slug,
        offering_version=sealed.offering_version,
        price=accepted.get("amount", ""),
        asset=accepted.get("asset", ""),
        network=accepted.get("network", ""),
        pay_to=accepted.get("payTo", ""),
        input_hash=sealed.input_hash,
        expires_epoch=int(sealed.expires_at.timestamp()),
    )
    try:
        _signer().unsign(f"{message}{_signer().sep}{sealed.signature}")
    except signing.BadSignature:
        for wire_field, attribute, code in _PAID_FIELDS:
            offered = str(getattr(offering, attribute)).lower()
            if str(accepted.get(wire_field, "")).lower() != offered:
                return DomainError(code, f"accepted.{wire_field} differs from what was offered.")
        return _invalid("The quote's terms in accepted.extra are not the ones the 402 signed.")
    return None


def quote_from_seal(*, sealed: SealedTerms, offering: Offering, raw_input: Any) -> Quote:
    """The quote a checked seal stands for, with the input the payment came with, to be
    written with the purchase.

    Raises DomainError: input_mismatch (not the quoted input; none sent), invalid_input,
    input_too_large.
    """
    canonical = _quoted_input(sealed, offering, raw_input)
    accepted = sealed.accepted
    quote = Quote(
        public_id=sealed.quote_ref,
        offering=offering,
        buyer=None,
        quote_key=sha256_hex(f"anonymous|{sealed.quote_ref}"),
        canonical_input=canonical,
        input_hash=sealed.input_hash,
        price=int(accepted["amount"]),
        asset=str(accepted["asset"]),
        network=str(accepted["network"]),
        pay_to=str(accepted["payTo"]),
        offering_version=sealed.offering_version,
        holds_stock=False,
        expires_at=sealed.expires_at,
    )
    return quote


def _quoted_input(sealed: SealedTerms, offering: Offering, raw_input: Any) -> dict[str, Any]:
    if isinstance(raw_input, dict):
        canonical = strip_volatile(raw_input, list(offering.volatile_fields or []))
        if sha256_hex(canonical_json(canonical)) == sealed.input_hash:
            return canonical  # the quoted input, validated when it was quoted
        # Not the quoted one: say first what is wrong with the input itself, if anything.
        quote_input_canonicalize(offering=offering, raw_input=raw_input)
    raise DomainError(
        ErrorCode.INPUT_MISMATCH,
        "The payment's quote was offered for another input: send the input it was quoted for "
        "with the payment (the same body, query string or tool arguments), or ask for the "
        "offer of this one and pay that.",
    )


def _invalid(detail: str) -> DomainError:
    return DomainError(ErrorCode.QUOTE_TERMS_INVALID, detail)
