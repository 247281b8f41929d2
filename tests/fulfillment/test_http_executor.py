"""The `http` executor against a real seller upstream (devtools.sample_upstream, its own
process): signed calls, one effect per purchase through every fault, answers classified as
docs/upstreams.md says. The upstream's own count is the proof, never a mock."""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from pathlib import Path
from typing import Any

import pytest
import requests

from fulfillment.executors import ExecutorError, JobSpec, UpstreamSpec, get_executor
from fulfillment.executors.http import HttpExecutor, signature, signed_headers
from tests.fixtures.sample_upstream import SECRET, SampleUpstream, wait_for


def job(key: str = "tollbooth-pur_1", **input_: object) -> JobSpec:
    return JobSpec(
        purchase_ref="pur_1", operation="work", input={"q": "x", **input_}, idempotency_key=key
    )


def call(upstream: SampleUpstream, spec: JobSpec, **overrides: object) -> bytes:
    output = HttpExecutor(upstream.spec(**overrides)).start(spec).output
    assert output is not None
    return output.content


def test_a_signed_call_stores_the_answer_and_a_repeat_has_no_second_effect(
    sample_upstream: SampleUpstream,
) -> None:
    executor = get_executor("http", sample_upstream.spec())
    first = executor.start(job())
    again = executor.start(job())  # a retry, a recheck, a restarted worker: the same key
    assert first.output is not None and again.output is not None
    assert json.loads(first.output.content)["key"] == "tollbooth-pur_1"
    assert first.output.content_type == "application/json"
    assert again.output.content == first.output.content
    assert sample_upstream.stats() == {"effects": 1, "calls": 2, "replayed": 1, "refused": 0}


def test_query_mode_signs_the_query(sample_upstream: SampleUpstream) -> None:
    content = call(sample_upstream, job(), method="GET", input_mode="query")
    assert json.loads(content)["input"] == {"q": "x"}
    assert sample_upstream.stats()["refused"] == 0


def test_5xx_then_2xx_is_unknown_then_the_one_result(sample_upstream: SampleUpstream) -> None:
    spec = job(fail_times=2)
    for _ in range(2):
        with pytest.raises(ExecutorError) as caught:
            call(sample_upstream, spec)
        assert (caught.value.definitive, caught.value.retryable) == (False, True)
    assert json.loads(call(sample_upstream, spec))["effect"] == 1
    assert sample_upstream.stats()["effects"] == 1


def test_slow_past_the_timeout_is_unknown_and_the_retry_gets_the_first_effect(
    sample_upstream: SampleUpstream,
) -> None:
    started = time.monotonic()
    with pytest.raises(ExecutorError) as caught:
        call(sample_upstream, job(sleep=1.5), timeout=0.5)
    assert caught.value.reason_code == "upstream_unreachable" and not caught.value.definitive
    assert time.monotonic() - started < 1.4
    assert json.loads(call(sample_upstream, job(sleep=1.5)))["effect"] == 1
    assert sample_upstream.stats()["effects"] == 1


def test_killed_mid_call_is_unknown_and_the_restarted_upstream_answers_the_key(
    sample_upstream: SampleUpstream, tmp_path: Path
) -> None:
    import threading

    errors: list[ExecutorError] = []

    def first_call() -> None:
        try:
            call(sample_upstream, job(sleep=30), timeout=20)
        except ExecutorError as error:
            errors.append(error)

    thread = threading.Thread(target=first_call)
    thread.start()
    wait_for(lambda: sample_upstream.stats()["effects"] == 1)  # the effect is committed
    sample_upstream.kill()  # ...and the upstream dies before it answers
    thread.join(10)
    assert errors and not errors[0].definitive
    restarted = SampleUpstream(sample_upstream.db_path).start()
    try:
        assert json.loads(call(restarted, job(sleep=30)))["effect"] == 1
        assert restarted.stats()["effects"] == 1
    finally:
        restarted.kill()


def test_a_declared_4xx_is_definitive_and_an_undeclared_one_is_unknown(
    sample_upstream: SampleUpstream,
) -> None:
    with pytest.raises(ExecutorError) as declared:
        call(sample_upstream, job(reject=422))
    assert (declared.value.reason_code, declared.value.definitive) == ("upstream_rejected", True)
    with pytest.raises(ExecutorError) as other:
        call(sample_upstream, job(key="k2", reject=409))
    assert other.value.definitive is False
    with pytest.raises(ExecutorError) as too_many:
        call(sample_upstream, job(key="k3", reject=429), definitive_statuses=frozenset({429}))
    assert too_many.value.definitive is True  # declared, so honoured; clean() refuses 429
    assert sample_upstream.stats()["effects"] == 0


def test_an_answer_over_the_cap_escalates_and_is_never_a_failure(
    sample_upstream: SampleUpstream,
) -> None:
    with pytest.raises(ExecutorError) as caught:
        call(sample_upstream, job(size=10_000), max_result_bytes=4096)
    error = caught.value
    assert (error.reason_code, error.definitive, error.retryable) == (
        "upstream_result_too_large",
        False,
        False,
    )
    assert len(call(sample_upstream, job(size=10_000), max_result_bytes=20_000)) == 10_000
    assert sample_upstream.stats()["effects"] == 1


def test_a_forged_or_replayed_signature_is_refused_without_an_effect(
    sample_upstream: SampleUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTHER_SECRET", "not-the-secret")
    with pytest.raises(ExecutorError) as forged:
        call(sample_upstream, job(), secret_env="OTHER_SECRET")
    assert forged.value.definitive is False  # 401 is not declared: unknown, escalated
    body = json.dumps({"q": "x"}, sort_keys=True, separators=(",", ":")).encode()
    stale = str(int(time.time()) - 600)
    replay = requests.post(
        sample_upstream.url + "/work",
        data=body,
        headers={
            "Idempotency-Key": "tollbooth-pur_9",
            "Tollbooth-Timestamp": stale,
            "Tollbooth-Signature": signature(SECRET.encode(), stale, "POST", "/work", body),
        },
        timeout=5,
    )
    assert replay.status_code == 401
    assert sample_upstream.stats() == {"effects": 0, "calls": 2, "replayed": 0, "refused": 2}


def test_no_call_without_a_secret(
    sample_upstream: SampleUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TOLLBOOTH_TEST_UPSTREAM_SECRET")
    with pytest.raises(ExecutorError) as caught:
        call(sample_upstream, job())
    assert caught.value.reason_code == "upstream_secret_missing" and not caught.value.definitive
    monkeypatch.setenv("TOLLBOOTH_TEST_UPSTREAM_SECRET", SECRET)
    with pytest.raises(ExecutorError):
        call(sample_upstream, job(key=" "))  # and never a call without the key
    assert sample_upstream.stats()["calls"] == 0


def test_the_documented_string_to_sign() -> None:
    body = b'{"q":"x"}'
    expected = hmac.new(
        b"k",
        b"1700000000\nPOST\n/work?a=1\n" + hashlib.sha256(body).hexdigest().encode(),
        hashlib.sha256,
    ).hexdigest()
    assert signature(b"k", "1700000000", "POST", "/work?a=1", body) == "v1=" + expected


def test_a_secret_without_a_key_id_signs_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    # Old single-secret upstreams keep their check: the header is `v1=<hex>` alone.
    monkeypatch.setenv("TOLLBOOTH_TEST_UPSTREAM_SECRET", SECRET)
    spec = UpstreamSpec(kind="http", secret_env="TOLLBOOTH_TEST_UPSTREAM_SECRET")
    headers = signed_headers(spec, "POST", "/work", b"{}", now=1700000000)
    assert headers["Tollbooth-Signature"] == signature(
        SECRET.encode(), "1700000000", "POST", "/work", b"{}"
    )


def test_during_a_rotation_each_signature_names_its_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEW_SECRET", "new")
    monkeypatch.setenv("OLD_SECRET", "old")
    spec = UpstreamSpec(
        kind="http",
        secret_env="NEW_SECRET",
        key_id="2026-12",
        previous_secret_env="OLD_SECRET",
        previous_key_id="2026-06",
    )
    header = signed_headers(spec, "POST", "/work", b"{}", now=1700000000)["Tollbooth-Signature"]
    new, old = (signature(k, "1700000000", "POST", "/work", b"{}") for k in (b"new", b"old"))
    assert header == f"kid=2026-12;{new}, kid=2026-06;{old}"


def test_a_rotation_whose_previous_secret_is_unset_makes_no_call(
    sample_upstream: SampleUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ExecutorError) as caught:
        call(sample_upstream, job(), key_id="2", previous_secret_env="UNSET_OLD_SECRET")
    assert caught.value.reason_code == "upstream_secret_missing" and not caught.value.definitive
    assert "UNSET_OLD_SECRET" in str(caught.value)
    assert sample_upstream.stats()["calls"] == 0


@pytest.mark.parametrize("held", [("1",), ("1", "2"), ("2",)])
def test_an_upstream_holding_either_secret_accepts_a_call_signed_during_a_rotation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, held: tuple[str, ...]
) -> None:
    monkeypatch.setenv("UP_OLD", "old-secret")
    monkeypatch.setenv("UP_NEW", "new-secret")
    upstream = SampleUpstream(tmp_path / "up.sqlite3").start(
        {"1=UP_OLD": "old-secret", "2=UP_NEW": "new-secret"}
    )
    try:
        assert upstream.accept(*held) == list(held)
        rotating = {"secret_env": "UP_NEW", "key_id": "2"}
        call(upstream, job(), **rotating, previous_secret_env="UP_OLD", previous_key_id="1")
        # Signed with one key alone, the call passes only where the upstream holds that key.
        for kid, env in (("1", "UP_OLD"), ("2", "UP_NEW")):
            try:
                call(upstream, job(key=f"k-{kid}"), secret_env=env, key_id=kid)
            except ExecutorError:
                assert kid not in held
            else:
                assert kid in held
        stats = upstream.stats()
        assert (stats["effects"], stats["refused"]) == (1 + len(held), 2 - len(held))
    finally:
        upstream.kill()


def documented_verifier() -> Any:
    """The check docs/upstreams.md gives sellers, run as they would paste it."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "upstreams.md").read_text()
    block = next(b for b in text.split("```python")[1:] if "def tollbooth_verify" in b)
    namespace: dict[str, Any] = {}
    exec(block.split("```")[0], namespace)  # noqa: S102  (our own documentation)
    return namespace["tollbooth_verify"]


@pytest.mark.parametrize(
    ("held", "accepted"),
    [
        ({"": b"old"}, {"legacy"}),  # an upstream from before key ids, as configured then
        ({"1": b"old"}, {"old", "rotating"}),
        ({"1": b"old", "2": b"new"}, {"old", "rotating", "new"}),
        ({"2": b"new"}, {"rotating", "new"}),
    ],
)
def test_the_documented_verifier_accepts_any_secret_it_holds(
    monkeypatch: pytest.MonkeyPatch, held: dict[str, bytes], accepted: set[str]
) -> None:
    verify = documented_verifier()
    monkeypatch.setenv("OLD_SECRET", "old")
    monkeypatch.setenv("NEW_SECRET", "new")
    specs = {
        "legacy": UpstreamSpec(kind="http", secret_env="OLD_SECRET"),
        "old": UpstreamSpec(kind="http", secret_env="OLD_SECRET", key_id="1"),
        "rotating": UpstreamSpec(
            kind="http",
            secret_env="NEW_SECRET",
            key_id="2",
            previous_secret_env="OLD_SECRET",
            previous_key_id="1",
        ),
        "new": UpstreamSpec(kind="http", secret_env="NEW_SECRET", key_id="2"),
    }
    body = b'{"q":"x"}'
    passed = set()
    for name, spec in specs.items():
        headers = {k.lower(): v for k, v in signed_headers(spec, "POST", "/w", body).items()}
        if verify(held, headers, "POST", "/w", body):
            passed.add(name)
        assert not verify(held, headers, "POST", "/w", body + b" ")  # a changed body
    assert passed == accepted
