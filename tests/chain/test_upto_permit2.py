"""`upto` on the local chain (issue 34, part 2): Permit2 from its npm package and our proxy,
placed at the SDK's canonical addresses, exercised with the SDK's own client and facilitator.

The buyer is the stock Python client with `UptoEvmClientScheme` registered; the seller side is
the SDK's `UptoEvmFacilitatorScheme` over its `FacilitatorWeb3Signer`, with a fresh relayer key
named in the 402 as `facilitatorAddress`. Balances and Permit2's nonce bitmap are read back
from the chain.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import dataclass
from typing import Any, cast

import pytest
from eth_account.signers.local import LocalAccount
from eth_typing import ABIFunction, HexStr
from eth_utils import function_abi_to_4byte_selector
from web3 import Web3
from x402 import x402ClientSync, x402FacilitatorSync
from x402.mechanisms.evm import FacilitatorWeb3Signer
from x402.mechanisms.evm.constants import (
    ERR_UPTO_SETTLEMENT_EXCEEDS_AMOUNT,
    X402_UPTO_PERMIT2_PROXY_ABI,
)
from x402.mechanisms.evm.upto import UptoEvmClientScheme, UptoEvmFacilitatorScheme
from x402.schemas import PaymentPayload, PaymentRequired, PaymentRequirements, ResourceInfo

from devtools.anvil import REPO_ROOT, AnvilNode
from devtools.permit2 import (
    PERMIT2,
    PERMIT2_ARTIFACT,
    PERMIT2_PACKAGE,
    PERMIT2_RUNTIME,
    PROXY_ARTIFACT,
    approve_permit2,
    cached_domain,
    permit2_allowance,
    permit2_domain_separator,
    permit2_runtime,
    proxy_runtime,
    read_domain_separator,
    send_upto_settle,
    sign_upto_permit,
)
from payments.chain.token import balance_of
from payments.rails.x402.chain import ChainUnavailable
from payments.rails.x402.permit2 import (
    UPTO_SETTLE_SELECTOR,
    decode_upto_settle,
    nonce_bitmap_position,
    permit2_nonce_used,
)
from tests.chain.conftest import USDC, Usdc, deploy_funded
from tests.fixtures.anvil import closed_port_url, new_account, prepare_upto

CEILING = 1 * USDC
USAGE = USDC // 4  # 0.25
REVERT_GAS = 300_000  # fixed: a settlement that must revert is still mined, and seen to


@dataclass
class Upto:
    usdc: Usdc
    network: str
    facilitator: x402FacilitatorSync

    @property
    def w3(self) -> Web3:
        return self.usdc.w3

    def requirements(self, amount: int) -> PaymentRequirements:
        """What the seller asks: a 1.00 ceiling to sign, or the metered amount to settle."""
        return PaymentRequirements(
            scheme="upto",
            network=self.network,
            asset=self.usdc.address,
            amount=str(amount),
            pay_to=self.usdc.payee.address,
            max_timeout_seconds=300,
            extra={
                "facilitatorAddress": self.usdc.relayer.address,
                "name": "USDC",
                "version": "2",
            },
        )

    def buyer_signs(self, buyer: LocalAccount | None = None) -> PaymentPayload:
        """The stock client, as an agent sets it up for upto: the scheme registered and, as in
        docs/examples, the test token allowed by its spend controls."""
        client = x402ClientSync()
        client.register(self.network, UptoEvmClientScheme(buyer or self.usdc.payer))  # type: ignore[arg-type]
        client.set_spend_controls(
            {"allowed_assets": [{"network": self.network, "asset": self.usdc.address}]}
        )
        required = PaymentRequired(
            accepts=[self.requirements(CEILING)],
            resource=ResourceInfo(url="http://127.0.0.1/metered-echo"),
        )
        payload = client.create_payment_payload(required)
        assert isinstance(payload, PaymentPayload)
        return payload

    def balances(self) -> tuple[int, int]:
        return (
            balance_of(self.w3, self.usdc.address, self.usdc.payer.address),
            balance_of(self.w3, self.usdc.address, self.usdc.payee.address),
        )

    def nonce_used(self, payload: PaymentPayload) -> bool:
        auth = payload.payload["permit2Authorization"]
        return permit2_nonce_used(self.w3, auth["from"], auth["nonce"])


def upto_world(node: AnvilNode) -> Upto:
    usdc = deploy_funded(node)
    prepare_upto(node, usdc.address, [usdc.payer])  # other_payer stays unapproved
    signer = FacilitatorWeb3Signer(private_key="0x" + usdc.relayer.key.hex(), rpc_url=node.rpc_url)
    network = f"eip155:{usdc.chain_id}"
    facilitator = x402FacilitatorSync()
    facilitator.register([network], UptoEvmFacilitatorScheme(signer))
    return Upto(usdc, network, facilitator)


@pytest.fixture
def upto(anvil_node: AnvilNode) -> Upto:
    return upto_world(anvil_node)


# --- what is placed ---------------------------------------------------------------------------


def test_permit2_runtime_is_what_the_package_etches() -> None:
    # The offsets: DeployPermit2's deployed code carries Permit2's runtime as the hex literal
    # its source hands to vm.etch; bytes 484..9636 are exactly that literal.
    source = (PERMIT2_PACKAGE / "lib/permit2/test/utils/DeployPermit2.sol").read_text()
    (literal,) = re.findall(r'hex"([0-9a-f]+)"', source)
    assert (PERMIT2_RUNTIME.start, PERMIT2_RUNTIME.stop) == (484, 9636)
    assert permit2_runtime() == bytes.fromhex(literal)
    assert len(permit2_runtime()) == 9152
    package = json.loads((PERMIT2_PACKAGE / "package.json").read_text())
    assert (package["name"], package["version"], package["license"]) == (
        "@uniswap/v4-periphery", "1.0.3", "MIT",
    )  # fmt: skip
    assert PERMIT2_ARTIFACT.is_file()


def test_cached_domain_is_chain_31337_at_another_address() -> None:
    cached = cached_domain(permit2_runtime())
    assert cached.chain_id == 31337
    # Where Permit2 was built (a forge test's deployment), not where it is placed.
    built_at = "0xF62849F9A0B5Bf2913b396098F7c7019b51A820a"
    assert cached.separator == permit2_domain_separator(31337, built_at)
    assert cached.separator != permit2_domain_separator(31337)


def test_proxy_artifact_matches_source_and_keeps_no_storage() -> None:
    source = (REPO_ROOT / "contracts" / "X402UptoPermit2Proxy.sol").read_bytes()
    artifact = json.loads(PROXY_ARTIFACT.read_text())
    assert artifact["compiler"]["sourceSha256"] == hashlib.sha256(source).hexdigest()
    # Placed with anvil_setCode, no constructor runs: no storage read or written, anywhere.
    code = proxy_runtime()
    code = code[: -2 - int.from_bytes(code[-2:], "big")]  # the CBOR metadata tail
    opcodes, pc = set(), 0
    while pc < len(code):
        opcodes.add(code[pc])
        pc += 1 + (code[pc] - 0x5F if 0x60 <= code[pc] <= 0x7F else 0)
    assert not opcodes & {0x54, 0x55, 0x5C, 0x5D}  # SLOAD, SSTORE, TLOAD, TSTORE


def test_placed_permit2_answers_the_canonical_domain(upto: Upto) -> None:
    assert upto.w3.eth.chain_id == 31337
    assert read_domain_separator(upto.w3) == permit2_domain_separator(31337)
    assert permit2_allowance(upto.w3, upto.usdc.address, upto.usdc.payer.address) == 2**256 - 1
    assert permit2_allowance(upto.w3, upto.usdc.address, upto.usdc.other_payer.address) == 0


def test_unpatched_permit2_fails_every_signature(paused_anvil: AnvilNode) -> None:
    # The patch is what makes 31337 work: with the runtime as shipped, Permit2 checks the
    # buyer's signature under the separator of the address it was built at.
    world = upto_world(paused_anvil)
    paused_anvil.rpc("anvil_setCode", [PERMIT2, "0x" + permit2_runtime().hex()])
    payload = world.buyer_signs()
    verified = world.facilitator.verify(payload, world.requirements(CEILING))
    # The SDK checks the signature off chain under the canonical domain (fine), then
    # simulates the settlement on chain, where Permit2 rejects it.
    assert not verified.is_valid
    assert verified.invalid_reason == "invalid_upto_evm_transaction_failed"
    tx = send_upto_settle(world.w3, world.usdc.relayer, payload.payload, USAGE, gas=REVERT_GAS)
    assert world.w3.eth.wait_for_transaction_receipt(tx, timeout=30)["status"] == 0
    assert world.balances() == (100 * USDC, 0)


def test_other_chain_ids_need_no_patch() -> None:
    with AnvilNode(chain_id=84532) as node:
        world = upto_world(node)
        assert read_domain_separator(world.w3) == permit2_domain_separator(84532)
        payload = world.buyer_signs()
        settled = world.facilitator.settle(payload, world.requirements(USAGE))
        assert settled.success, settled
        assert world.balances() == (100 * USDC - USAGE, USAGE)


# --- the SDK's client and facilitator ---------------------------------------------------------


def test_stock_client_signs_a_ceiling_and_the_sdk_settles_the_usage(upto: Upto) -> None:
    payload = upto.buyer_signs()
    auth = payload.payload["permit2Authorization"]
    assert payload.accepted.scheme == "upto"
    assert (auth["permitted"]["amount"], auth["witness"]["facilitator"]) == (
        str(CEILING), upto.usdc.relayer.address,
    )  # fmt: skip

    verified = upto.facilitator.verify(payload, upto.requirements(CEILING))
    assert verified.is_valid, verified
    assert not upto.nonce_used(payload)

    settled = upto.facilitator.settle(payload, upto.requirements(USAGE))
    assert settled.success, settled
    assert settled.amount == str(USAGE)
    receipt = upto.w3.eth.get_transaction_receipt(HexStr(settled.transaction))
    assert receipt["status"] == 1
    assert receipt["to"] == Web3.to_checksum_address("0x4020A4f3b7b90ccA423B9fabCc0CE57C6C240002")
    assert upto.balances() == (100 * USDC - USAGE, USAGE)
    assert upto.nonce_used(payload)

    # Once used, the same signature settles nothing more.
    again = upto.facilitator.settle(payload, upto.requirements(USAGE))
    assert not again.success
    assert upto.balances() == (100 * USDC - USAGE, USAGE)


def test_zero_usage_sends_no_transaction_and_leaves_the_nonce_unused(upto: Upto) -> None:
    payload = upto.buyer_signs()
    relayer_nonce = upto.w3.eth.get_transaction_count(upto.usdc.relayer.address)
    settled = upto.facilitator.settle(payload, upto.requirements(0))
    assert settled.success, settled
    assert (settled.amount, settled.transaction) == ("0", "")
    assert upto.w3.eth.get_transaction_count(upto.usdc.relayer.address) == relayer_nonce
    assert not upto.nonce_used(payload)
    assert upto.balances() == (100 * USDC, 0)


def test_above_the_ceiling_is_refused_and_reverts(upto: Upto) -> None:
    payload = upto.buyer_signs()
    refused = upto.facilitator.settle(payload, upto.requirements(CEILING + 1))
    assert (refused.success, refused.error_reason) == (False, ERR_UPTO_SETTLEMENT_EXCEEDS_AMOUNT)
    # And on chain, past the SDK's guard: the proxy reverts, nothing moves, the nonce stays.
    tx = send_upto_settle(upto.w3, upto.usdc.relayer, payload.payload, CEILING + 1,
                          gas=REVERT_GAS)  # fmt: skip
    assert upto.w3.eth.wait_for_transaction_receipt(tx, timeout=30)["status"] == 0
    assert upto.balances() == (100 * USDC, 0)
    assert not upto.nonce_used(payload)
    # The ceiling itself is allowed.
    settled = upto.facilitator.settle(payload, upto.requirements(CEILING))
    assert settled.success, settled
    assert upto.balances() == (99 * USDC, CEILING)


def test_only_the_named_facilitator_can_settle(upto: Upto) -> None:
    payload = upto.buyer_signs()
    stranger = new_account(upto.usdc.node)
    tx = send_upto_settle(upto.w3, stranger, payload.payload, USAGE, gas=REVERT_GAS)
    assert upto.w3.eth.wait_for_transaction_receipt(tx, timeout=30)["status"] == 0
    # The SDK's facilitator on another key refuses it before sending anything.
    other = FacilitatorWeb3Signer(private_key="0x" + stranger.key.hex(),
                                  rpc_url=upto.usdc.node.rpc_url)  # fmt: skip
    facilitator = x402FacilitatorSync()
    facilitator.register([upto.network], UptoEvmFacilitatorScheme(other))
    refused = facilitator.verify(payload, upto.requirements(CEILING))
    assert (refused.is_valid, refused.invalid_reason) == (False, "upto_facilitator_mismatch")
    assert upto.balances() == (100 * USDC, 0)
    assert not upto.nonce_used(payload)
    # The named one still can.
    tx = send_upto_settle(upto.w3, upto.usdc.relayer, payload.payload, USAGE)
    assert upto.w3.eth.wait_for_transaction_receipt(tx, timeout=30)["status"] == 1
    assert upto.balances() == (100 * USDC - USAGE, USAGE)


def test_without_the_permit2_approval_verification_refuses(upto: Upto) -> None:
    payload = upto.buyer_signs(upto.usdc.other_payer)
    verified = upto.facilitator.verify(payload, upto.requirements(CEILING))
    assert (verified.is_valid, verified.invalid_reason) == (False, "permit2_allowance_required")
    approve_permit2(upto.w3, upto.usdc.address, upto.usdc.other_payer)
    assert upto.facilitator.verify(payload, upto.requirements(CEILING)).is_valid


def test_valid_after_is_enforced_by_the_proxy(upto: Upto) -> None:
    usdc = upto.usdc
    payload = sign_upto_permit(
        usdc.payer, chain_id=usdc.chain_id, token=usdc.address, ceiling=CEILING,
        pay_to=usdc.payee.address, facilitator=usdc.relayer.address,
        deadline=int(time.time()) + 600, valid_after=int(time.time()) + 300,
    )  # fmt: skip
    tx = send_upto_settle(upto.w3, usdc.relayer, payload, USAGE, gas=REVERT_GAS)
    assert upto.w3.eth.wait_for_transaction_receipt(tx, timeout=30)["status"] == 0
    assert upto.balances() == (100 * USDC, 0)


def test_past_the_deadline_permit2_refuses_and_the_nonce_stays_unused(
    paused_anvil: AnvilNode,
) -> None:
    # `deadline` is upto's validBefore: the end of the window in which a settlement may land.
    world = upto_world(paused_anvil)
    usdc = world.usdc
    now = paused_anvil.w3().eth.get_block("latest")["timestamp"]
    payload = sign_upto_permit(
        usdc.payer, chain_id=usdc.chain_id, token=usdc.address, ceiling=CEILING,
        pay_to=usdc.payee.address, facilitator=usdc.relayer.address, deadline=now + 60,
    )  # fmt: skip
    paused_anvil.increase_time(120)
    tx = send_upto_settle(world.w3, usdc.relayer, payload, USAGE, gas=REVERT_GAS)
    assert world.w3.eth.wait_for_transaction_receipt(tx, timeout=30)["status"] == 0
    assert world.balances() == (100 * USDC, 0)
    assert not permit2_nonce_used(
        world.w3, usdc.payer.address, payload["permit2Authorization"]["nonce"]
    )


# --- "used": Permit2's nonce bitmap -----------------------------------------------------------


def test_nonce_bitmap_position() -> None:
    assert nonce_bitmap_position(0) == (0, 0)
    assert nonce_bitmap_position(255) == (0, 255)
    assert nonce_bitmap_position("256") == (1, 0)
    assert nonce_bitmap_position(2**256 - 1) == (2**248 - 1, 255)
    for bad in (-1, 2**256, "0x10", "", "1.5", True, 1.0):
        with pytest.raises(ValueError):
            nonce_bitmap_position(bad)  # type: ignore[arg-type]


def test_nonce_used_reads_the_one_bit(upto: Upto) -> None:
    usdc = upto.usdc
    deadline = int(time.time()) + 600

    def signed_with(nonce: int) -> dict[str, Any]:
        return sign_upto_permit(
            usdc.payer, chain_id=usdc.chain_id, token=usdc.address, ceiling=CEILING,
            pay_to=usdc.payee.address, facilitator=usdc.relayer.address, deadline=deadline,
            nonce=nonce,
        )  # fmt: skip

    signed = {nonce: signed_with(nonce) for nonce in (7 * 256 + 255, 7 * 256 + 254, 8 * 256 + 255)}
    tx = send_upto_settle(upto.w3, usdc.relayer, signed[7 * 256 + 255], USAGE)
    assert upto.w3.eth.wait_for_transaction_receipt(tx, timeout=30)["status"] == 1
    used = {n: permit2_nonce_used(upto.w3, usdc.payer.address, n) for n in signed}
    assert used == {7 * 256 + 255: True, 7 * 256 + 254: False, 8 * 256 + 255: False}
    # Another owner's same nonce is another bit.
    assert not permit2_nonce_used(upto.w3, usdc.other_payer.address, 7 * 256 + 255)


def test_a_cancelled_nonce_reads_used_and_cannot_settle(upto: Upto) -> None:
    # The buyer's cancel (Permit2's invalidateUnorderedNonces) spends the nonce as a
    # settlement would: recovery must not rebroadcast it, and a broadcast would revert.
    payload = upto.buyer_signs()
    word, bit = nonce_bitmap_position(payload.payload["permit2Authorization"]["nonce"])
    permit2 = upto.w3.eth.contract(address=PERMIT2, abi=[{
        "type": "function", "name": "invalidateUnorderedNonces", "stateMutability": "nonpayable",
        "inputs": [{"name": "wordPos", "type": "uint256"}, {"name": "mask", "type": "uint256"}],
        "outputs": [],
    }])  # fmt: skip
    payer = upto.usdc.payer
    tx = permit2.functions.invalidateUnorderedNonces(word, 1 << bit).build_transaction(
        {"from": payer.address, "nonce": upto.w3.eth.get_transaction_count(payer.address)}
    )
    sent = upto.w3.eth.send_raw_transaction(
        payer.sign_transaction(cast(dict[str, Any], tx)).raw_transaction
    )
    assert upto.w3.eth.wait_for_transaction_receipt(sent, timeout=30)["status"] == 1
    assert upto.nonce_used(payload)
    tx_hash = send_upto_settle(upto.w3, upto.usdc.relayer, payload.payload, USAGE,
                               gas=REVERT_GAS)  # fmt: skip
    assert upto.w3.eth.wait_for_transaction_receipt(tx_hash, timeout=30)["status"] == 0
    assert upto.balances() == (100 * USDC, 0)


def test_nonce_used_is_unknown_when_the_chain_does_not_answer() -> None:
    w3 = Web3(Web3.HTTPProvider(closed_port_url(), exception_retry_configuration=None))
    with pytest.raises(ChainUnavailable):
        permit2_nonce_used(w3, "0x" + "11" * 20, 1)


def test_nonce_used_is_unknown_where_permit2_is_absent() -> None:
    # No code at the address answers empty bytes: that is "did not say", never "unused".
    with AnvilNode() as node, pytest.raises(ChainUnavailable):
        permit2_nonce_used(node.w3(), "0x" + "11" * 20, 1)


# --- which transaction used it ----------------------------------------------------------------


def test_the_settle_selector_is_the_sdks() -> None:
    (settle,) = X402_UPTO_PERMIT2_PROXY_ABI
    assert function_abi_to_4byte_selector(cast(ABIFunction, settle)) == UPTO_SETTLE_SELECTOR


def test_a_settlement_transaction_decodes_to_its_payload(upto: Upto) -> None:
    payload = upto.buyer_signs()
    settled = upto.facilitator.settle(payload, upto.requirements(USAGE))
    assert settled.success, settled
    calldata = upto.w3.eth.get_transaction(HexStr(settled.transaction))["input"]
    call = decode_upto_settle(calldata)
    auth = payload.payload["permit2Authorization"]
    assert call is not None
    assert (call.owner, call.nonce, call.amount, call.ceiling) == (
        upto.usdc.payer.address, int(auth["nonce"]), USAGE, CEILING,
    )  # fmt: skip
    assert (call.token, call.pay_to, call.facilitator) == (
        upto.usdc.address, upto.usdc.payee.address, upto.usdc.relayer.address,
    )  # fmt: skip
    assert call.signature.hex() == payload.payload["signature"].removeprefix("0x")
    # A data suffix after the arguments (ERC-8021) changes nothing; anything else is not one.
    assert decode_upto_settle(bytes(calldata) + bytes.fromhex("80218021")) == call
    assert decode_upto_settle(bytes(calldata)[:100]) is None
    assert decode_upto_settle(b"\xa9\x05\x9c\xbb" + bytes(64)) is None  # transfer(...)
    assert decode_upto_settle("0x") is None
