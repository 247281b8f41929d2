"""A relayer address is retired only after every authorization naming it has passed its
deadline (issue 35, part 3): `relayer_retire_check` refuses while an attempt it signed is
pending, or not settled with its authorization still valid, and while it is the relayer
configured now."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.core.management import CommandError, call_command
from eth_account import Account
from rest_framework.test import APIClient

from payments.models import PaymentAttempt
from payments.selectors import relayer_retirement
from tests.x402.e2e import NETWORK, X402World, ask, sign_payment

pytestmark = pytest.mark.django_db


def paid_then_rotated(world: X402World, settings) -> PaymentAttempt:  # type: ignore[no-untyped-def]
    client = APIClient()
    payment = sign_payment(ask(client, world)["PAYMENT-REQUIRED"], world.payers[0], None)
    assert ask(client, world, payment=payment).status_code in (200, 202)
    settings.X402_NETWORKS[NETWORK]["relayer_private_key"] = Account.create().key.hex()
    attempt = PaymentAttempt.objects.get()
    assert attempt.valid_before_at is not None
    return attempt


def test_an_address_whose_authorization_is_pending_is_not_retired(x402_world, settings):
    attempt = paid_then_rotated(x402_world, settings)
    old = x402_world.relayer.address
    assert attempt.relayer_address == old
    PaymentAttempt.objects.update(state="settlement_pending")  # as if not confirmed yet

    with pytest.raises(CommandError, match="1 authorization"):
        call_command("relayer_retire_check", NETWORK, old)

    assert attempt.valid_before_at is not None
    late = relayer_retirement(
        network=NETWORK, address=old, now=attempt.valid_before_at + timedelta(days=1)
    )
    assert [a.pk for a in late.blocking] == [attempt.pk]  # pending: unknown, whatever the time


def test_a_failed_payment_blocks_until_its_deadline_has_passed(x402_world, settings):
    attempt = paid_then_rotated(x402_world, settings)
    old = x402_world.relayer.address
    PaymentAttempt.objects.update(state="failed")
    deadline = attempt.valid_before_at
    assert deadline is not None

    before = relayer_retirement(network=NETWORK, address=old, now=deadline - timedelta(seconds=1))
    after = relayer_retirement(network=NETWORK, address=old, now=deadline)

    assert (before.may_retire, before.deadline) == (False, deadline)
    assert after.may_retire


def test_settled_payments_do_not_block_and_the_check_says_ok(x402_world, settings, capsys):
    paid_then_rotated(x402_world, settings)
    assert PaymentAttempt.objects.get().state == "succeeded"

    call_command("relayer_retire_check", NETWORK, x402_world.relayer.address.lower())

    assert "may be retired" in capsys.readouterr().out


def test_the_relayer_configured_now_is_never_retired(x402_world):
    with pytest.raises(CommandError, match="configured now"):
        call_command("relayer_retire_check", NETWORK, x402_world.relayer.address)
