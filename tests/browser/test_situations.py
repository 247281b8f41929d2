"""Support opens each of the twelve situations in the admin, in a real browser.

`EXPECTED` is what support must read from the purchase page, by the domain
(/work/shared/domain.md), not by what the page happens to show: the case file's Now box
(`purchases/case_file.py`: whose move it is, where its deadline comes from, whether the
state can still change, the actions safe for support now, words that must be said) and the
timeline's events by their human labels, in order (other events may sit between them).
Where the two disagreed the case file was fixed (tests/purchases/test_case_file.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import pytest

from devtools.situations import SITUATIONS
from tests.browser.conftest import ROOT, BrowserWorld, screenshot

# Timeline events as support reads them: (human label, reason code; "x*" = prefix).
QUOTE = ("Quote accepted", "")
SUCCEEDED = [
    ("Execution claimed by a worker", ""),
    ("Execution succeeded", ""),
    ("Work succeeded, result stored", ""),
]
PREPAID_PAID = [
    QUOTE,
    ("Payment settled", ""),
    ("Payment recorded as paid", ""),
    ("Work queued", ""),
]
X402_PENDING = [
    QUOTE,
    ("Payment recorded", ""),
    ("Payment started", ""),
    ("Broadcast, awaiting confirmation", "confirmation_timeout"),
    ("Settlement pending", "confirmation_timeout"),
]
X402_REFUSED = [
    QUOTE,
    ("Payment recorded", ""),
    ("Payment attempt failed", "facilitator_rejected:*"),
    ("Payment failed", "facilitator_rejected:*"),
]
X402_MINED = [("Payment settled", ""), ("Payment recorded as paid", ""), *SUCCEEDED]

# What support may do on a settled, finished purchase whose result is still kept: send it
# again, propose a goodwill refund (finance decides, nothing moves), or escalate.
DONE = ("redeliver_result", "propose_refund", "assign")
# The same while its x402 payment is not final yet, and the finality watch's look, now.
UNFINAL_DONE = ("recheck_settlement", *DONE)


@dataclass(frozen=True)
class Expected:
    timeline: list[tuple[str, str]]
    owner: str  # whose move: buyer, reconciliation, support, finance, none
    deadline: str  # where the deadline comes from (purchases.case_file.Deadline), "none"
    finality: str  # final, final_at_deadline, open
    actions: tuple[str, ...]  # exactly what support is offered
    says: str  # words the Now box must say (sentence and notes)
    page: str = "purchase"
    refund_open: bool = False  # a refund owed and not yet paid back, said beside the state


EXPECTED: dict[str, Expected] = {
    # Prepaid, result stored but never fetched: the buyer's move, until retention ends.
    "dropped-connection": Expected(PREPAID_PAID + SUCCEEDED, "buyer", "result_retention",
                                   "final", DONE, "Paid and done"),
    # x402 answers with the result once paid: delivered. The transfer is one block deep, not
    # final (the local chain's finality depth is 3): the finality watch's move, not final.
    "settlement-pending": Expected(X402_PENDING + X402_MINED, "reconciliation", "finality",
                                   "open", UNFINAL_DONE, "awaiting finality"),
    "dropped-broadcast": Expected(
        [*X402_PENDING, ("Same signed authorization submitted again", "confirmation_timeout"),
         *X402_MINED], "reconciliation", "finality", "open", UNFINAL_DONE, "awaiting finality"),
    # The window closed with the nonce unused: the buyer pays again with a new
    # authorization; the failure becomes final at its deadline; nothing is owed.
    "authorization-expired": Expected(
        [*X402_PENDING, ("Payment attempt failed", "authorization_expired_unused"),
         ("Payment failed", "authorization_expired_unused")],
        "buyer", "failed_final", "final_at_deadline", ("assign",), "nonce unused"),
    # A duplicate transfer is owed back: finance's move, no deadline (open until marked paid);
    # support may still redeliver, but not propose a second refund. The purchase is settled,
    # not final yet (a block or two deep), and the page says the refund is still open.
    "two-authorizations": Expected(
        [*X402_REFUSED, ("Payment recorded", ""), ("Payment started", ""),
         ("Payment recorded as paid", ""), *SUCCEEDED,
         ("Duplicate transfer for a paid purchase", "duplicate_settlement"),
         ("Refund owed", "duplicate_settlement")],
        "finance", "none", "open", ("recheck_settlement", "redeliver_result", "assign"),
        "landed after it was paid: that money is owed back", refund_open=True),
    # Refused, then the same authorization landed: the failure stands, the money is owed back.
    # That authorization is spent; read within the quote's two minutes, a new payment for the
    # quote could still change the purchase (final once the quote expires).
    "late-transfer": Expected(
        [*X402_REFUSED, ("Late transfer landed after the purchase failed", "late_settlement"),
         ("Refund owed", "late_settlement")],
        "finance", "none", "final_at_deadline", ("assign",), "landed anyway", refund_open=True),
    # Failed by policy and credited back at once: nothing is left for anyone to do.
    "execution-failed": Expected(
        [*PREPAID_PAID, ("Execution failed", "invalid_report_input"),
         ("Work failed", "invalid_report_input"), ("Refund owed", "execution_failed"),
         ("Refund paid back", "")],
        "none", "none", "final", ("assign",), "The payment was refunded in full."),
    # Taken over from the job ref, never rerun; the result waits for the buyer.
    "worker-killed": Expected(
        [*PREPAID_PAID, ("Execution claimed by a worker", ""),
         ("Worker died; execution taken over", "lease_expired_taken_over"),
         ("Execution succeeded", ""), ("Work succeeded, result stored", "")],
        "buyer", "result_retention", "final", DONE, "Paid and done"),
    "job-service-down": Expected(
        [*PREPAID_PAID, ("Executor error, retrying", "executor_retry"), *SUCCEEDED[1:]],
        "buyer", "result_retention", "final", DONE, "Paid and done"),
    # The original purchase, untouched by the conflicting request.
    "payment-id-conflict": Expected(PREPAID_PAID + SUCCEEDED, "buyer", "result_retention",
                                    "final", DONE, "Paid and done"),
    # No purchase is kept: the payment id's record shows the refusal and the balance.
    "balance-too-small": Expected([], "buyer", "none", "final", (), "insufficient_funds",
                                  page="idempotency record"),
    # Fetched, then kept past retention: only the receipt remains, nothing to redeliver.
    "result-expired": Expected(PREPAID_PAID + SUCCEEDED, "none", "none", "final",
                               ("propose_refund", "assign"), "only the receipt remains"),
}  # fmt: skip
UTC_SECONDS = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC$")


def test_the_table_covers_every_situation() -> None:
    assert set(EXPECTED) == set(SITUATIONS)


def test_the_runbook_names_the_owner_this_table_asserts() -> None:
    """docs/runbook.md's summary says whose move each situation ends as: the owner asserted
    on the page here (the last owner named in its row)."""
    runbook = (ROOT / "docs/runbook.md").read_text()
    owners = ("buyer", "reconciliation", "support", "finance", "none")
    for name, expected in EXPECTED.items():
        row = next(line for line in runbook.splitlines() if f"](#{name})" in line)
        move = row.split("|")[2]
        named = [(move.rindex(o), o) for o in owners if o in move]
        assert max(named)[1] == expected.owner, (name, move)


def timeline(page: Any) -> list[tuple[str, str]]:
    """The case file's timeline as support reads it: (label, reason code) per event, in
    order; every event is timed to the second in UTC."""
    rows = page.locator('[data-testid="case-timeline"] [data-testid="case-event"]')
    found = []
    for index in range(rows.count()):
        cells = rows.nth(index).locator("td").all_inner_texts()
        when, label, reason = cells[0].strip(), cells[1].strip(), cells[4].strip()
        assert UTC_SECONDS.match(when), f"event time {when!r} is not UTC to the second"
        found.append((label, reason))
    return found


def _matches(event: tuple[str, str], wanted: tuple[str, str]) -> bool:
    return all(
        got.startswith(want[:-1]) if want.endswith("*") else got == want
        for got, want in zip(event, wanted, strict=True)
    )


def assert_in_order(events: list[tuple[str, str]], wanted: list[tuple[str, str]]) -> None:
    remaining = iter(events)
    for item in wanted:
        assert any(_matches(event, item) for event in remaining), (
            f"{item} missing (in order) from the timeline:\n" + "\n".join(map(str, events))
        )


def now_box(page: Any) -> dict[str, Any]:
    """What the case file's Now box says, read off the page."""
    box = page.locator('[data-testid="case-now"]')
    assert box.count() == 1, "every purchase page opens with the case file's Now box"
    offered = box.locator('[data-testid^="case-action-"]')
    deadline = box.locator('[data-testid="case-deadline"]')
    return {
        "owner": box.locator('[data-testid="case-owner"]').get_attribute("data-owner"),
        "deadline": deadline.get_attribute("data-deadline-source"),
        "deadline_text": deadline.inner_text().strip(),
        "finality": box.locator('[data-testid="case-finality"]').get_attribute("data-finality"),
        "state_text": box.locator('[data-testid="case-finality"]').inner_text().strip(),
        "actions": {
            (offered.nth(i).get_attribute("data-testid") or "").removeprefix("case-action-")
            for i in range(offered.count())
        },
        "no_actions": box.locator('[data-testid="case-no-actions"]').count() == 1,
        "next_check": box.locator('[data-testid="case-next-check"]').inner_text().strip(),
        "text": box.inner_text(),
    }


def assert_now_box(page: Any, expected: Expected) -> None:
    seen = now_box(page)
    assert (seen["owner"], seen["deadline"], seen["finality"]) == (
        expected.owner,
        expected.deadline,
        expected.finality,
    ), seen
    assert seen["actions"] == set(expected.actions), seen
    assert seen["no_actions"] == (not expected.actions)
    # A deadline is shown in UTC to the second with how far away it is, or as none.
    if expected.deadline == "none":
        assert seen["deadline_text"] == "none"
    else:
        assert re.match(
            r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC \((in|overdue by) ", seen["deadline_text"]
        )
    assert expected.says in seen["text"], seen["text"]
    # Not final: the next automatic check, timed to the second in UTC, and what it is.
    if expected.finality != "final":
        assert re.match(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC \((in|overdue by) .+\): \w",
                        seen["next_check"]), seen["next_check"]  # fmt: skip
    # "final, refund open": the state and its open remedy, said together.
    assert seen["state_text"].endswith(", refund open") == expected.refund_open, seen


@pytest.mark.parametrize("name", list(SITUATIONS))
def test_support_reads_the_situation_from_the_admin(
    name: str, browser_world: BrowserWorld, staff_page: Any
) -> None:
    played = SITUATIONS[name](browser_world.stage)
    expected = EXPECTED[name]
    page = staff_page("support")
    answer = page.goto(played.admin_url)
    assert answer is not None and answer.status == 200
    if expected.page == "purchase":
        assert played.purchase_ref is not None
        assert played.purchase_ref in page.title()
        assert_now_box(page, expected)
        assert_in_order(timeline(page), expected.timeline)
    else:
        # No purchase is kept for a refused prepaid try: the payment id's record is the case.
        assert f"View {expected.page}" in page.title()
        content = page.locator("#content").inner_text()
        assert expected.says in content
        assert "0.100000" in content  # the buyer's balance explains the refusal
    screenshot(page, name)
