"""An upstream's configuration is validated before it is saved, and an offering without
one keeps its built-in executor."""

from __future__ import annotations

import pytest
from django.core.exceptions import ValidationError

from fulfillment.executors.http import HttpExecutor
from fulfillment.executors.http_job import HttpJobExecutor
from fulfillment.models import Upstream, upstream_validate
from fulfillment.upstreams import upstream_spec
from purchases.services.fulfil.upstreams import offering_executor
from tests.factories import OfferingFactory


def errors_of(**fields: object) -> set[str]:
    base: dict[str, object] = {
        "kind": "http",
        "url": "https://seller.example/work",
        "secret_env": "SELLER_SECRET",
        "definitive_statuses": [400, 422],
    }
    try:
        upstream_validate(Upstream(**{**base, **fields}))
    except ValidationError as error:
        return set(error.message_dict)
    return set()


def test_a_good_configuration_passes() -> None:
    assert errors_of() == set()
    assert errors_of(key_id="2026-12") == set()
    # Mid-rotation, from a secret with a key id or from an old one without.
    assert errors_of(key_id="2", previous_secret_env="OLD", previous_key_id="1") == set()
    assert errors_of(key_id="2", previous_secret_env="OLD") == set()


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"url": "ftp://seller.example/x"}, "url"),
        ({"url": ""}, "url"),
        ({"secret_env": "sk_live_abc123"}, "secret_env"),  # a secret pasted in, not a name
        ({"secret_env": ""}, "secret_env"),
        ({"definitive_statuses": [500]}, "definitive_statuses"),
        ({"definitive_statuses": [429]}, "definitive_statuses"),
        ({"definitive_statuses": "422"}, "definitive_statuses"),
        ({"timeout_seconds": 0}, "timeout_seconds"),
        ({"max_result_bytes": 0}, "max_result_bytes"),
        ({"method": "TRACE"}, "method"),
        ({"kind": "python", "entry_point": ""}, "entry_point"),
        ({"dry_run": {"path": "health"}}, "dry_run"),
        # A rotation: two signatures the upstream must tell apart by key id.
        ({"previous_secret_env": "OLD_SECRET"}, "key_id"),
        ({"key_id": "2", "previous_secret_env": "SELLER_SECRET"}, "previous_secret_env"),
        ({"key_id": "2", "previous_secret_env": "old-secret-value"}, "previous_secret_env"),
        ({"key_id": "1", "previous_secret_env": "OLD", "previous_key_id": "1"}, "key_id"),
        ({"key_id": "k=1"}, "key_id"),
        ({"previous_key_id": "1"}, "previous_key_id"),
    ],
)
def test_a_bad_field_is_named(fields: dict[str, object], field: str) -> None:
    assert field in errors_of(**fields)


@pytest.mark.django_db
def test_the_executor_follows_the_upstream_and_offerings_without_one_keep_theirs() -> None:
    plain = OfferingFactory.create(executor="http_job")
    assert offering_executor(plain) == ("http_job", None)
    job = OfferingFactory.create(executor="http_job")
    Upstream.objects.create(offering=job, kind="http_job", url="http://127.0.0.1:9/base")
    name, spec = offering_executor(type(job).objects.select_related("upstream").get(pk=job.pk))
    assert name == "http_job" and spec is not None
    from fulfillment.executors import get_executor

    executor = get_executor(name, spec)
    assert isinstance(executor, HttpJobExecutor) and executor.base_url == "http://127.0.0.1:9/base"
    http = Upstream(kind="http", url="https://s.example/w", secret_env="S", definitive_statuses=[])
    assert isinstance(get_executor("http", upstream_spec(http)), HttpExecutor)
