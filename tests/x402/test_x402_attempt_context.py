"""One paid x402 request derives its attempt's context once (issue 20 §1): the network's
configuration, the settler of its mode and the parsed authorization, built by the rail's
`verify` and handed on to every later step (payments/rails/x402/context.py). Counted with the
committed call tracer (bench/walk.py) on a real paid request, direct mode, real anvil."""

from __future__ import annotations

from collections import Counter

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from bench.walk import Walk
from payments.models import PaymentAttempt
from payments.rails.x402.rail import X402Rail
from tests.x402.e2e import X402World, ask, sign_payment

pytestmark = [pytest.mark.postgres, pytest.mark.django_db]

NETWORK = "payments/rails/x402/networks.py::network_config"
SETTLER = "payments/rails/x402/settlers.py::settler_for"
PARSE = "payments/rails/x402/attempts.py::x402_attempt_authorization"


def _calls(walk: Walk) -> Counter[str]:
    return Counter(f"{name}::{function}" for name, function in walk.stops)


def test_a_paid_request_derives_network_settler_and_authorization_once(
    x402_world: X402World,
) -> None:
    world, client = x402_world, APIClient()
    payment = sign_payment(ask(client, world).headers["PAYMENT-REQUIRED"], world.payers[0], None)

    with Walk() as walk:
        paid = ask(client, world, payment=payment)

    assert paid.status_code in (200, 202), paid.content
    assert PaymentAttempt.objects.get().state == "succeeded"
    calls = _calls(walk)
    # verify, verify_funds, record, settle (prepare, broadcast), never_reached, describe.
    assert (calls[NETWORK], calls[SETTLER], calls[PARSE]) == (1, 1, 0)


def test_an_attempt_read_back_derives_its_context_once_for_all_its_steps(
    x402_world: X402World,
) -> None:
    world, client = x402_world, APIClient()
    payment = sign_payment(ask(client, world).headers["PAYMENT-REQUIRED"], world.payers[0], None)
    ask(client, world, payment=payment)
    attempt = PaymentAttempt.objects.get()  # as a job reads it: no context on it yet
    rail, now = X402Rail(), timezone.now()

    with Walk() as walk:
        outcome = rail.look_up(attempt=attempt, now=now)
        rail.never_reached(attempt=attempt, outcome=outcome, now=now)
        rail.describe(attempt=attempt)

    assert outcome.status == "confirmed"
    calls = _calls(walk)
    assert (calls[NETWORK], calls[PARSE]) == (1, 1)
