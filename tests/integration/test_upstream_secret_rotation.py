"""An upstream's signing secret is rotated while purchases run, and none fails (issue 35,
part 6): purchases in real threads against the sample upstream (its own process) while the
seller walks the documented rotation, Tollbooth's side and the upstream's side each in its
own step. Every call is accepted at its first try, one effect per purchase."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from django.db import connection

from core.actors import Actor
from doors.rest.prepaid_answers import PrepaidAnswers
from fulfillment.models import Result, Upstream
from purchases.models import Buyer, Offering, Purchase, PurchaseEvent
from purchases.services.checkout.prepaid_checkout import purchase_pay_prepaid
from purchases.services.fulfil.execution import ExecutionOutcome, purchase_execute
from purchases.services.fulfil.upstreams import offering_upstream_save
from purchases.services.quote.quotes import quote_create
from tests.factories import OfferingFactory
from tests.fixtures.sample_upstream import SampleUpstream, wait_for

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]
THREADS = 4
OLD, NEW = "old-upstream-secret", "new-upstream-secret"
SELLER = Actor.staff("seller")


class Buyers:
    """Threads buying one purchase after another, each noting the phase it started in."""

    def __init__(self, buyer: Buyer, offering: Offering) -> None:
        self.buyer, self.offering = buyer, offering
        self.phase = 0
        self.stop = threading.Event()
        self.done: list[tuple[int, int, str, object]] = []  # (thread, phase, ref, outcome)
        self.lock = threading.Lock()

    def buy(self, thread: int) -> None:
        try:
            number = 0
            while not self.stop.is_set():
                number += 1
                phase = self.phase
                ref, outcome = self._one(f"t{thread}-{number}")
                with self.lock:
                    self.done.append((thread, phase, ref, outcome))
        finally:
            connection.close()

    def _one(self, name: str) -> tuple[str, object]:
        try:
            raw = {"q": name}
            quote = quote_create(buyer=self.buyer, offering_slug=self.offering.slug, raw_input=raw)
            answer, _ = purchase_pay_prepaid(
                answers=PrepaidAnswers(),
                buyer=self.buyer,
                quote_id=quote.quote.public_id,
                payment_id=f"rotation-purchase-{name}",
            )
            if answer.status not in (201, 202):
                return name, answer.body
            purchase = Purchase.objects.get(ref=answer.purchase_ref)
            return purchase.ref, purchase_execute(purchase_id=purchase.pk, worker=name)
        except Exception as exc:  # a retryable answer included: each one is a failure here
            return name, exc

    def next_phase(self, change: Callable[[], object]) -> None:
        """Make the change, then wait until every thread has finished a purchase started
        after it (so none still holds a configuration claimed before it)."""
        change()
        self.phase += 1
        phase = self.phase
        wait_for(
            lambda: {t for t, p, _, _ in list(self.done) if p >= phase} == set(range(THREADS)),
            timeout=60,
        )


def rotate(offering: Offering, **fields: str) -> Callable[[], object]:
    def change() -> object:
        upstream = Upstream.objects.get(offering=offering)
        for name, value in fields.items():
            setattr(upstream, name, value)
        upstream.full_clean(exclude=["offering"])
        return offering_upstream_save(offering_id=offering.pk, upstream=upstream, actor=SELLER)

    return change


def test_a_secret_rotated_while_purchases_run_fails_none(
    buyer: Buyer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("UP_SECRET_1", OLD)  # Tollbooth's workers: both variables set
    monkeypatch.setenv("UP_SECRET_2", NEW)
    upstream = SampleUpstream(tmp_path / "up.sqlite3").start(
        {"1=UP_SECRET_1": OLD, "2=UP_SECRET_2": NEW}
    )
    try:
        assert upstream.accept("1") == ["1"]  # the seller's upstream holds the old secret
        offering = OfferingFactory.create(
            executor="http", input_schema={"type": "object"}, volatile_fields=[], price=1000
        )
        Upstream.objects.create(
            offering=offering,
            kind="http",
            url=upstream.url + "/work",
            secret_env="UP_SECRET_1",
            key_id="1",
            timeout_seconds=5,
        )
        buyers = Buyers(buyer, offering)
        threads = [threading.Thread(target=buyers.buy, args=(n,)) for n in range(THREADS)]
        for thread in threads:
            thread.start()
        try:
            wait_for(lambda: len(buyers.done) >= THREADS, timeout=60)
            # 1. Tollbooth signs with the new secret and, until retired, the old one too.
            buyers.next_phase(
                rotate(
                    offering,
                    secret_env="UP_SECRET_2",
                    key_id="2",
                    previous_secret_env="UP_SECRET_1",
                    previous_key_id="1",
                )
            )
            # 2. The seller deploys the new secret beside the old, then drops the old.
            buyers.next_phase(lambda: upstream.accept("1", "2"))
            buyers.next_phase(lambda: upstream.accept("2"))
            # 3. Tollbooth retires the old secret: one signature again, the new key's.
            buyers.next_phase(rotate(offering, previous_secret_env="", previous_key_id=""))
        finally:
            buyers.stop.set()
            for thread in threads:
                thread.join(60)

        outcomes = [outcome for _, _, _, outcome in buyers.done]
        assert outcomes == [ExecutionOutcome.SUCCEEDED] * len(outcomes)
        assert {phase for _, phase, _, _ in buyers.done} == {0, 1, 2, 3, 4}
        refs = [ref for _, _, ref, _ in buyers.done]
        assert Result.objects.filter(purchase__ref__in=refs).count() == len(refs)
        # Every call was accepted at its first try: no refusal, no retry, one effect each.
        stats = upstream.stats()
        assert stats == {"effects": len(refs), "calls": len(refs), "replayed": 0, "refused": 0}
        # Each Tollbooth step is on the offering's record, naming variables, never secrets.
        changes = [
            e.evidence["changed"]
            for e in PurchaseEvent.objects.filter(
                subject="offering.upstream_changed", evidence__offering=offering.slug
            ).order_by("pk")
        ]
        assert [sorted(c) for c in changes] == [
            ["key_id", "previous_key_id", "previous_secret_env", "secret_env"],
            ["previous_key_id", "previous_secret_env"],
        ]
        assert changes[0]["secret_env"] == ["UP_SECRET_1", "UP_SECRET_2"]
        assert OLD not in json.dumps(changes) and NEW not in json.dumps(changes)
        final = Upstream.objects.get(offering=offering)
        assert (final.secret_env, final.key_id, final.previous_secret_env) == (
            "UP_SECRET_2",
            "2",
            "",
        )
    finally:
        upstream.kill()


def test_a_swap_without_the_overlap_is_refused(
    buyer: Buyer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What the overlap prevents: a new secret the upstream does not hold yet gets a 401,
    # unknown, retried (never failed), until the upstream has it.
    monkeypatch.setenv("UP_SECRET_1", OLD)
    monkeypatch.setenv("UP_SECRET_2", NEW)
    upstream = SampleUpstream(tmp_path / "up.sqlite3").start(
        {"1=UP_SECRET_1": OLD, "2=UP_SECRET_2": NEW}
    )
    try:
        upstream.accept("1")
        offering = OfferingFactory.create(
            executor="http", input_schema={"type": "object"}, volatile_fields=[], price=1000
        )
        Upstream.objects.create(
            offering=offering,
            kind="http",
            url=upstream.url + "/work",
            secret_env="UP_SECRET_2",
            key_id="2",
        )
        buyers = Buyers(buyer, offering)
        _, outcome = buyers._one("swap")
        assert type(outcome).__name__ == "ExecutionRetryable"
        assert upstream.stats()["refused"] == 1 and upstream.stats()["effects"] == 0
    finally:
        upstream.kill()
