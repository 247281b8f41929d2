"""A seller's executor from a separate distribution: the test builds a wheel, installs it with
pip into a temp dir (not a module under tests/), puts that dir on sys.path, and a purchase
runs through it, found by its `tollbooth.executors` entry point."""

from __future__ import annotations

import base64
import hashlib
import importlib
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from doors.rest.prepaid_answers import PrepaidAnswers
from fulfillment.executors import registered_names
from fulfillment.models import Result, Upstream
from purchases.models import Purchase
from purchases.services.checkout.prepaid_checkout import purchase_pay_prepaid
from purchases.services.fulfil.execution import ExecutionOutcome, purchase_execute
from purchases.services.quote.quotes import quote_create
from tests.factories import OfferingFactory

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

NAME, VERSION = "tollbooth_shout", "1.0"
# The worked example of docs/upstreams.md ("python: a worked example"), as the seller writes it.
MODULE = """
import hashlib
from fulfillment.executors import JobOutput, JobStatus, Started, ExecutorError

class ShoutExecutor:
    name = "shout"
    finishes_in_start = True  # pure work: a retry simply runs it again

    def __init__(self, upstream=None):
        self.upstream = upstream

    def start(self, job):
        text = job.input.get("text")
        if not isinstance(text, str):
            raise ExecutorError("invalid_input", "text must be a string", definitive=True)
        ref = "shout_" + hashlib.sha256(job.idempotency_key.encode()).hexdigest()[:16]
        return Started(ref, JobOutput(text.upper().encode(), "text/plain"))

    def poll(self, job_ref):
        return JobStatus.SUCCEEDED if job_ref.startswith("shout_") else JobStatus.UNKNOWN

    def fetch(self, job_ref):
        raise ExecutorError("result_unavailable", "call start() again")
"""


def _record_line(path: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}"


def build_wheel(out: Path) -> Path:
    """A minimal, valid wheel (PEP 427) with one module and one entry point."""
    info = f"{NAME}-{VERSION}.dist-info"
    files = {
        f"{NAME}.py": MODULE.encode(),
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {VERSION}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        b"Tag: py3-none-any\n",
        f"{info}/entry_points.txt": (
            f"[tollbooth.executors]\nshout = {NAME}:ShoutExecutor\n".encode()
        ),
    }
    record = [_record_line(path, data) for path, data in files.items()] + [f"{info}/RECORD,,"]
    wheel = out / f"{NAME}-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, data in files.items():
            archive.writestr(path, data)
        archive.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
    return wheel


@pytest.fixture
def installed(tmp_path: Path) -> Iterator[Path]:
    wheel, target = build_wheel(tmp_path), tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index"]
    subprocess.run([*pip, "--target", str(target), str(wheel)], check=True)
    sys.path.insert(0, str(target))
    importlib.invalidate_caches()
    yield target
    sys.path.remove(str(target))
    sys.modules.pop(NAME, None)


def test_an_installed_distribution_runs_a_purchase(installed: Path, buyer) -> None:
    assert "shout" in registered_names()
    offering = OfferingFactory.create(
        executor="shout", input_schema={"type": "object"}, volatile_fields=[]
    )
    Upstream.objects.create(offering=offering, kind="python", entry_point="shout")
    quote = quote_create(buyer=buyer, offering_slug=offering.slug, raw_input={"text": "hi"}).quote
    answer, _ = purchase_pay_prepaid(
        answers=PrepaidAnswers(),
        buyer=buyer,
        quote_id=quote.public_id,
        payment_id="python-entry-point-0001",
    )
    purchase = Purchase.objects.get(ref=answer.purchase_ref)
    if purchase.fulfillment_state != "succeeded":
        assert purchase_execute(purchase_id=purchase.pk, worker="w1") == ExecutionOutcome.SUCCEEDED
    result = Result.objects.get(purchase=purchase)
    assert (bytes(result.body), result.content_type) == (b"HI", "text/plain")
    assert result.execution.executor == "shout"
