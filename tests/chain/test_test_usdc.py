"""TestUSDC and the EIP-3009 helpers against a real anvil chain."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from pathlib import Path
from typing import Any

import pytest
from eth_account.messages import encode_typed_data
from eth_account.signers.local import LocalAccount
from hexbytes import HexBytes
from web3.exceptions import ContractLogicError, TransactionNotFound
from web3.logs import DISCARD

from devtools.anvil import AnvilNode, find_anvil_binary
from devtools.test_token import (
    SignedAuthorization,
    mint,
    send_transfer_with_authorization,
    sign_transfer_authorization,
)
from payments.chain.token import (
    authorization_state,
    balance_of,
    load_artifact,
    recover_authorization_signer,
    token_contract,
    transfer_authorization_typed_data,
)

from .conftest import FUNDED, USDC, TokenDomain, Usdc

REPO_ROOT = Path(__file__).resolve().parents[2]
PRICE = 10_000  # 0.01 USDC


def chain_now(usdc: Usdc) -> int:
    timestamp: int = usdc.w3.eth.get_block("latest")["timestamp"]
    return timestamp


def authorize(
    usdc: Usdc,
    signer: LocalAccount | None = None,
    *,
    value: int = PRICE,
    valid_after: int | None = None,
    valid_before: int | None = None,
) -> SignedAuthorization:
    now = chain_now(usdc)
    return sign_transfer_authorization(
        signer or usdc.payer,
        **usdc.domain(),
        to=usdc.payee.address,
        value=value,
        valid_after=now - 60 if valid_after is None else valid_after,
        valid_before=now + 600 if valid_before is None else valid_before,
    )


def settle(usdc: Usdc, signed: SignedAuthorization, **kwargs: Any) -> dict[str, Any]:
    tx_hash = send_transfer_with_authorization(
        usdc.w3, usdc.address, usdc.relayer, signed["authorization"], signed["signature"],
        **kwargs,
    )  # fmt: skip
    return dict(usdc.w3.eth.wait_for_transaction_receipt(tx_hash, timeout=30))


def balances(usdc: Usdc) -> tuple[int, int]:
    return (
        balance_of(usdc.w3, usdc.address, usdc.payer.address),
        balance_of(usdc.w3, usdc.address, usdc.payee.address),
    )


def test_artifact_matches_source() -> None:
    # A stale artifact means someone edited the .sol without `node scripts/compile_contracts.js`.
    source = (REPO_ROOT / "contracts" / "TestUSDC.sol").read_bytes()
    assert load_artifact()["compiler"]["sourceSha256"] == hashlib.sha256(source).hexdigest()


def test_metadata_and_domain(usdc: Usdc) -> None:
    token = token_contract(usdc.w3, usdc.address)
    assert token.functions.name().call() == "USDC"
    assert token.functions.version().call() == "2"
    assert token.functions.decimals().call() == 6
    assert token.functions.totalSupply().call() == 2 * FUNDED
    fields, name, version, chain_id, contract, _salt, _ext = token.functions.eip712Domain().call()
    assert (fields, name, version, chain_id, contract) == (
        b"\x0f",
        "USDC",
        "2",
        usdc.chain_id,
        usdc.address,
    )
    signed = authorize(usdc)
    signable = transfer_authorization_typed_data(
        **usdc.domain(),
        authorization=signed["authorization"],
    )
    # EIP-712 header is the domain separator: our off-chain hashing agrees with the contract.
    assert token.functions.DOMAIN_SEPARATOR().call() == signable.header


def test_transfer_with_authorization(usdc: Usdc) -> None:
    signed = authorize(usdc)
    auth = signed["authorization"]
    assert isinstance(auth["value"], str) and auth["nonce"].startswith("0x")
    assert not authorization_state(usdc.w3, usdc.address, usdc.payer.address, auth["nonce"])

    receipt = settle(usdc, signed)

    assert receipt["status"] == 1
    assert balances(usdc) == (FUNDED - PRICE, PRICE)
    assert authorization_state(usdc.w3, usdc.address, usdc.payer.address, auth["nonce"])
    token = token_contract(usdc.w3, usdc.address)
    (used,) = token.events.AuthorizationUsed().process_receipt(receipt, errors=DISCARD)
    assert used["args"]["authorizer"] == usdc.payer.address
    assert used["args"]["nonce"] == HexBytes(auth["nonce"])
    (transfer,) = token.events.Transfer().process_receipt(receipt, errors=DISCARD)
    assert dict(transfer["args"]) == {
        "from": usdc.payer.address, "to": usdc.payee.address, "value": PRICE,
    }  # fmt: skip


def test_bytes_signature_overload(usdc: Usdc) -> None:
    signed = authorize(usdc)
    assert settle(usdc, signed, signature_form="bytes")["status"] == 1
    assert balances(usdc) == (FUNDED - PRICE, PRICE)


def test_replay_reverts_and_moves_nothing(usdc: Usdc) -> None:
    signed = authorize(usdc)
    settle(usdc, signed)
    after_first = balances(usdc)

    # Gas estimation catches it before anything is spent...
    with pytest.raises(ContractLogicError, match="authorization is used"):
        settle(usdc, signed)
    # ...and forced on chain (fixed gas, either overload), it reverts.
    for form in ("vrs", "bytes"):
        assert settle(usdc, signed, gas=200_000, signature_form=form)["status"] == 0
    assert balances(usdc) == after_first


@pytest.mark.parametrize(
    ("window", "reason"),
    [
        (lambda now: {"valid_before": now - 1}, "authorization is expired"),
        (lambda now: {"valid_after": now + 3600}, "authorization is not yet valid"),
    ],
)
def test_validity_window(usdc: Usdc, window: Any, reason: str) -> None:
    signed = authorize(usdc, **window(chain_now(usdc)))
    with pytest.raises(ContractLogicError, match=reason):
        settle(usdc, signed)
    assert settle(usdc, signed, gas=200_000)["status"] == 0
    assert balances(usdc) == (FUNDED, 0)


def test_not_yet_valid_becomes_valid_when_time_passes(paused_usdc: Usdc) -> None:
    # The clock moves only on the paused node, which is put back after the test.
    usdc, node = paused_usdc, paused_usdc.node
    now = chain_now(usdc)
    signed = authorize(usdc, valid_after=now + 3600, valid_before=now + 7200)
    with pytest.raises(ContractLogicError, match="not yet valid"):
        settle(usdc, signed)
    node.increase_time(3601)
    node.mine()
    assert settle(usdc, signed)["status"] == 1


def test_wrong_signer_and_tampering_revert(usdc: Usdc) -> None:
    # Signed by other_payer but claiming to come from payer.
    forged = authorize(usdc, usdc.other_payer)
    forged["authorization"]["from"] = usdc.payer.address
    # Signed by payer, amount raised afterwards.
    tampered = authorize(usdc)
    tampered["authorization"]["value"] = str(50 * USDC)
    for signed in (forged, tampered):
        with pytest.raises(ContractLogicError, match="invalid signature"):
            settle(usdc, signed)
        assert settle(usdc, signed, gas=200_000)["status"] == 0
    assert balances(usdc) == (FUNDED, 0)


def test_insufficient_balance_reverts(usdc: Usdc) -> None:
    signed = authorize(usdc, value=FUNDED + 1)
    with pytest.raises(ContractLogicError, match="exceeds balance"):
        settle(usdc, signed)
    # The nonce survives a reverted attempt: the same authorization stays unused.
    nonce = signed["authorization"]["nonce"]
    assert not authorization_state(usdc.w3, usdc.address, usdc.payer.address, nonce)


def test_recover_signer_off_chain(usdc: Usdc) -> None:
    signed = authorize(usdc)
    auth, signature = signed["authorization"], signed["signature"]

    def recover(authorization: Any = auth, sig: str | bytes = signature, version: str = "2") -> str:
        domain: TokenDomain = {**usdc.domain(), "version": version}
        return recover_authorization_signer(**domain, authorization=authorization, signature=sig)

    assert recover() == usdc.payer.address
    # Signers that emit v as 0/1 instead of 27/28 recover the same.
    raw = bytearray(HexBytes(signature))
    raw[64] -= 27
    assert recover(sig=bytes(raw)) == usdc.payer.address
    # Any change to the message, or another domain, yields some other address.
    assert recover(authorization={**auth, "value": str(PRICE + 1)}) != usdc.payer.address
    assert recover(version="1") != usdc.payer.address


def test_amounts_must_be_ints(usdc: Usdc) -> None:
    with pytest.raises(TypeError):
        authorize(usdc, value=0.01)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        mint(usdc.w3, usdc.address, usdc.deployer, usdc.payee.address, 1.5)  # type: ignore[arg-type]


def test_only_owner_mints(usdc: Usdc) -> None:
    with pytest.raises(ContractLogicError, match="not the owner"):
        mint(usdc.w3, usdc.address, usdc.payer, usdc.payer.address, USDC)


def test_receive_with_authorization_only_by_payee(usdc: Usdc) -> None:
    now = chain_now(usdc)
    message = {
        "from": usdc.payer.address,
        "to": usdc.payee.address,
        "value": PRICE,
        "validAfter": now - 60,
        "validBefore": now + 600,
        "nonce": secrets.token_bytes(32),
    }
    uint = "uint256"
    types = [("from", "address"), ("to", "address"), ("value", uint),
             ("validAfter", uint), ("validBefore", uint), ("nonce", "bytes32")]  # fmt: skip
    signable = encode_typed_data(
        domain_data={
            "name": usdc.name,
            "version": usdc.version,
            "chainId": usdc.chain_id,
            "verifyingContract": usdc.address,
        },
        message_types={"ReceiveWithAuthorization": [{"name": n, "type": t} for n, t in types]},
        message_data=message,
    )
    sig = usdc.payer.sign_message(signable).signature
    fn = token_contract(usdc.w3, usdc.address).functions.receiveWithAuthorization(
        *message.values(), sig[64], sig[:32], sig[32:64]
    )
    # Only the payee may submit it, so nobody can front-run the payee's own call.
    with pytest.raises(ContractLogicError, match="caller must be the payee"):
        fn.call({"from": usdc.relayer.address})
    fn.call({"from": usdc.payee.address})  # the payee's call would succeed


# --- the anvil helper -------------------------------------------------------------------------


def test_anvil_accounts_and_stop() -> None:
    node = AnvilNode(chain_id=84532, accounts=3)
    pid = node._proc.pid
    w3 = node.w3()
    assert w3.eth.chain_id == 84532
    assert [a.address for a in node.accounts] == w3.eth.accounts
    node.stop()
    node.stop()  # idempotent
    assert not node.running
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)


def test_anvil_bin_override(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ANVIL_BIN", str(tmp_path / "missing"))
    with pytest.raises(RuntimeError, match="ANVIL_BIN"):
        find_anvil_binary()


def test_no_mining_drop_and_rebroadcast(paused_usdc: Usdc) -> None:
    usdc, node = paused_usdc, paused_usdc.node
    node.set_automine(False)  # after set-up; the test itself mines by hand
    w3 = usdc.w3

    # Held pending until evm_mine.
    first = authorize(usdc)
    tx_hash = send_transfer_with_authorization(
        w3, usdc.address, usdc.relayer, first["authorization"], first["signature"]
    )
    with pytest.raises(TransactionNotFound):
        w3.eth.get_transaction_receipt(tx_hash)
    assert balances(usdc) == (FUNDED, 0)
    node.rpc("evm_mine")
    assert w3.eth.get_transaction_receipt(tx_hash)["status"] == 1
    assert balances(usdc) == (FUNDED - PRICE, PRICE)

    # Dropped: as if the network lost it. The nonce stays unused...
    second = authorize(usdc)
    auth, signature = second["authorization"], second["signature"]
    dropped = send_transfer_with_authorization(w3, usdc.address, usdc.relayer, auth, signature)
    node.drop_transaction(dropped)
    node.mine()
    with pytest.raises(TransactionNotFound):
        w3.eth.get_transaction(dropped)
    assert not authorization_state(w3, usdc.address, usdc.payer.address, auth["nonce"])
    assert balances(usdc) == (FUNDED - PRICE, PRICE)

    # ...so the same signed authorization can be broadcast again, and settles once.
    again = send_transfer_with_authorization(w3, usdc.address, usdc.relayer, auth, signature)
    node.mine()
    assert w3.eth.get_transaction_receipt(again)["status"] == 1
    assert authorization_state(w3, usdc.address, usdc.payer.address, auth["nonce"])
    assert balances(usdc) == (FUNDED - 2 * PRICE, 2 * PRICE)


def test_artifact_is_deterministic_json() -> None:
    text = (REPO_ROOT / "payments" / "chain" / "artifacts" / "TestUSDC.json").read_text()
    artifact = json.loads(text)
    assert set(artifact) == {"contractName", "abi", "bytecode", "compiler"}
    assert artifact["bytecode"].startswith("0x")
    assert text == json.dumps(artifact, indent=2) + "\n"
