"""The staff roles, as code: one table says, per role and per model, which fields the role
sees and which actions it may run. The admin applies it field by field (core.admin
RoleScopedAdmin); the groups' model permissions are derived from it (roles_ensure).

- support explains purchases from evidence: states, ids, tx hashes, times, reason codes,
  amounts, the buyer's input and the result's digest; never the raw signed authorization
  nor the relayer's transaction.
- finance works the money: amounts, wallets, transactions, refunds, balances and export
  batches; never the buyer's input nor the result.
- nobody, superusers included, sees key material (NEVER_SHOWN).
Names are model fields, admin display names (amount_human), search paths (buyer__ref), list
filters' parameters (refund_owed) and the purchase case file's evidence (case_execution).
Actions are admin actions (mark_paid_back) and the case file's staff actions
(purchases.case_file.Action: recheck_settlement, ...); the case action views check both the
table (role_allows_action) and whether the case makes the action safe now.
"""

from __future__ import annotations

from django.apps import apps
from django.contrib.auth.models import Group, Permission
from django.db import transaction
from django.db.models import Q

from core.admin import RoleScope

SUPPORT = "support"
FINANCE = "finance"
# The purchase page's "Download evidence pack" (backoffice.admin.case_evidence).
EXPORT_EVIDENCE = "export_evidence"


def _scope(fields: str, actions: str = "") -> RoleScope:
    return RoleScope(fields=frozenset(fields.split()), actions=frozenset(actions.split()))


# Key material and secrets: absent from every page, list, search and export, for everyone.
NEVER_SHOWN: dict[str, frozenset[str]] = {
    "purchases.apikey": frozenset({"key_hash"}),
    # Lease tokens let a worker act as the lease holder: plumbing, and a credential.
    "purchases.idempotencyrecord": frozenset({"lease_token"}),
    "fulfillment.executionattempt": frozenset({"lease_token"}),
    # The paid output itself; its SHA-256 is the evidence.
    "fulfillment.result": frozenset({"body"}),
}

_PURCHASE_IDS = "pk ref quote offering buyer buyer__ref payer rail channel created_at updated_at"
_PURCHASE_MONEY = (
    "amount amount_human asset network paid_at payment_attempts__tx_hash "
    "payment_attempts__payer refunds__transaction refunds__paid_reference refunds__payer"
)
_PURCHASE_STATE = "payment_state fulfillment_state reason_code"
# The purchase list's queues (list filters, by their URL parameter).
_PURCHASE_QUEUES = "open_escalation refund_owed stuck buyer_ref payer_wallet"
# The case file's evidence that is not a purchase field (backoffice.admin.case_file): the
# quote, the authorization (attempts, payer, validity window), the execution attempts, the
# reconciliation schedule, refunds (remedy), escalations, the buyer's prepaid balance. The
# result's digest, the receipt and the money are the purchase fields of the same names.
_CASE_EVIDENCE = (
    "case_quote case_authorization case_execution case_reconciliation case_remedy "
    "case_escalations case_balance"
)
# The six staff actions of the case file (purchases.case_file.Action); finance's is
# approve_refund (approve or decline what support proposed). Both download a purchase's
# signed evidence pack (export_evidence: the same document for both, written for outsiders,
# docs/evidence.md).
_CASE_ACTIONS = (
    "recheck_settlement reconcile_execution redeliver_result assign propose_refund resolve"
)
_RESULT_DIGEST = "result_sha256 result_size result_expires_at result_first_delivered_at"
_TIMELINE = "created_at subject from_state to_state actor_type actor reason_code evidence"
_ATTEMPT_MONEY = (
    "pk purchase purchase__ref rail payer network asset amount tx_hash block_number "
    "settlement_reference state reason_code created_at updated_at transfer_note "
    "block_at gas_used effective_gas_price sent_by"
)
# What support needs to explain a payment beyond the money: ids, nonces, schedule, times.
_ATTEMPT_EVIDENCE = (
    "idempotency_record fingerprint authorization_nonce valid_before_at broadcast_started_at "
    "search_from_block next_check_at unanswered_checks resubmissions resubmitted_at"
)
_REFUND = (
    "pk purchase purchase__ref payment_attempt method amount amount_human asset_symbol asset "
    "network payer transaction reason_code state created_at paid_reference paid_by paid_at "
    "ledger_reference note proposed_by decided_by decided_at paid_back payback payback_tx_hash "
    "payback_log_index payback_block_number payback_code payback_evidence payback_checked_at "
    "payback_next_check_at match_tx_hash match_log_index match_block_number match_found_at "
    "payout"
)
# A payout's signed bytes are the wallet's own transaction, as the relayer's: superusers only.
_PAYOUT = (
    "pk refund refund__purchase__ref network asset destination amount amount_human state "
    "status from_address nonce tx_hash approved_by approved_at second_approved_by "
    "second_approved_at cap_day broadcast_started_at broadcast_at broadcasts awaiting "
    "checked_at next_check_at evidence block_number confirmed_at reason_code created_at"
)
# A buyer's refund request and the case facts beside it: support decides, finance reads.
_REFUND_REQUEST = (
    "pk public_id purchase purchase__ref case_facts amount asset reason channel requested_by "
    "signed_message signature state buyer_status assignee deadline_utc is_overdue created_at "
    "decided_by decided_at denial_code decision_note refund"
)
_LEDGER = (
    "pk reference buyer buyer__ref kind amount amount_human asset purchase purchase__ref memo "
    "created_at"
)
_BALANCE = "pk buyer buyer__ref asset amount amount_human updated_at"

ROLE_TABLE: dict[str, dict[str, RoleScope]] = {
    SUPPORT: {
        "purchases.purchase": _scope(
            f"{_PURCHASE_IDS} {_PURCHASE_MONEY} {_PURCHASE_STATE} {_RESULT_DIGEST} receipt_id "
            f"{_PURCHASE_QUEUES} {_CASE_EVIDENCE}",
            actions=f"{_CASE_ACTIONS} export_evidence",
        ),
        "purchases.purchaseevent": _scope(_TIMELINE),
        "purchases.escalation": _scope(
            "pk purchase purchase__ref owner reason_code details deadline_at deadline_utc "
            "is_overdue note assignee assigned_by assigned_at state created_at resolved_at "
            "resolved_by resolution_code resolution",
            actions="resolve_selected assign_to_me",
        ),
        "purchases.quote": _scope(
            "pk public_id offering buyer buyer__ref purchase__ref quote_key canonical_input "
            "input_hash price asset network pay_to offering_version holds_stock expires_at "
            "created_at state"
        ),
        "purchases.idempotencyrecord": _scope(
            "pk scope key principal answer_told buyer_prepaid_balance request_fingerprint purchase "
            "purchase__ref state "
            "recovery_point response_status response_headers response_body created_at "
            "completed_at locked_until compacted_at"
        ),
        "purchases.jobrun": _scope("pk job started_at finished_at stats error"),
        "purchases.offering": _scope(
            "pk slug title description executor is_active price asset asset_symbol "
            "asset_decimals network pay_to input_schema volatile_fields max_input_bytes stock "
            "result_retention expected_run_time duplicate_window delivery_condition "
            "refund_policy irreversible version created_at"
        ),
        "purchases.buyer": _scope("pk ref name spend_cap is_active created_at wallets__address"),
        "purchases.buyerwallet": _scope("address"),
        # The configuration only: the secret lives in the environment, named by secret_env.
        "fulfillment.upstream": _scope(
            "kind url method timeout_seconds input_mode secret_env key_id previous_secret_env "
            "previous_key_id definitive_statuses max_result_bytes idempotent entry_point tool "
            "dry_run"
        ),
        "purchases.apikey": _scope("prefix label created_at revoked_at"),
        "payments.paymentattempt": _scope(f"{_ATTEMPT_MONEY} {_ATTEMPT_EVIDENCE}"),
        "payments.refund": _scope(_REFUND),
        "purchases.refundrequest": _scope(
            _REFUND_REQUEST, actions="decide_refund_request assign_to_me"
        ),
        "payments.payout": _scope(_PAYOUT),
        "payments.ledgerentry": _scope(_LEDGER),
        "payments.ledgerbalance": _scope(_BALANCE),
        "fulfillment.executionattempt": _scope(
            "pk purchase purchase__ref executor worker state job_ref job_idempotency_key tries "
            "takeovers lease_expires_at reason_code started_at finished_at"
        ),
        "fulfillment.result": _scope(
            "pk purchase purchase__ref execution content_type size sha256 created_at "
            "expires_at first_delivered_at"
        ),
        "fulfillment.receipt": _scope(
            "pk public_id purchase purchase__ref payer amount asset network transaction "
            "body_sha256 delivered_at"
        ),
    },
    FINANCE: {
        # Money and its evidence; not the result's digest, the execution, the authorization.
        "purchases.purchase": _scope(
            f"{_PURCHASE_IDS} {_PURCHASE_MONEY} {_PURCHASE_STATE} receipt_id "
            "refund_owed buyer_ref payer_wallet case_quote case_remedy case_balance",
            actions="approve_refund export_evidence",
        ),
        "purchases.purchaseevent": _scope(_TIMELINE),
        "payments.paymentattempt": _scope(_ATTEMPT_MONEY),
        "payments.refund": _scope(
            _REFUND,
            actions="approve_payouts mark_paid_back confirm_payback_match export_safe_batch "
            "export_csv",
        ),
        "payments.payout": _scope(_PAYOUT, actions="approve_second_payout cancel_payout"),
        "purchases.refundrequest": _scope(_REFUND_REQUEST),
        "payments.ledgerentry": _scope(_LEDGER, actions="top_up"),
        "payments.ledgerbalance": _scope(_BALANCE),
        "payments.exportbatch": _scope(
            "pk kind created_by started_at created_at filters row_count first_created_at "
            "last_created_at sha256",
            actions="export_books",
        ),
    },
}


# The timeline's evidence is scoped like the pages: an evidence key that copies a field of a
# record (a nonce, a job ref, a digest) shows on the timeline only to a role that sees that
# field on that record's page (backoffice.admin.case_file.timeline_rows). A key nested in an
# answer ("answers.payload.authorization.nonce") is scoped by each part of its path. Keys not
# named here (states, amounts, tx hashes, wallets, times, notes) show with the timeline.
EVIDENCE_SOURCES: dict[str, tuple[str, str]] = {
    # The relayer's own account nonce and raw transaction: superusers only.
    "relayer_nonce": ("payments.paymentattempt", "relayer_nonce"),
    "raw_transaction": ("payments.paymentattempt", "raw_transaction"),
    # The signed authorization: its nonce and window are support's, its signature nobody's.
    "nonce": ("payments.paymentattempt", "authorization_nonce"),
    "signature": ("payments.paymentattempt", "authorization"),
    "valid_before": ("payments.paymentattempt", "valid_before_at"),
    "valid_after": ("payments.paymentattempt", "valid_before_at"),
    "validBefore": ("payments.paymentattempt", "valid_before_at"),
    "validAfter": ("payments.paymentattempt", "valid_before_at"),
    "fingerprint": ("payments.paymentattempt", "fingerprint"),
    "payment_id": ("payments.paymentattempt", "idempotency_record"),
    "resubmission": ("payments.paymentattempt", "resubmissions"),
    # The work: job refs, workers and the executor's words are support's.
    "job_ref": ("fulfillment.executionattempt", "job_ref"),
    "job_status": ("fulfillment.executionattempt", "state"),
    "job_idempotency_key": ("fulfillment.executionattempt", "job_idempotency_key"),
    "worker": ("fulfillment.executionattempt", "worker"),
    "lease_expires_at": ("fulfillment.executionattempt", "lease_expires_at"),
    "try": ("fulfillment.executionattempt", "tries"),
    # The result's digest and where it is fetched: not finance's.
    "sha256": ("purchases.purchase", "result_sha256"),
    "result_sha256": ("purchases.purchase", "result_sha256"),
    "body_sha256": ("purchases.purchase", "result_sha256"),
    "size": ("purchases.purchase", "result_size"),
    "kept_until": ("purchases.purchase", "result_expires_at"),
    "url": ("purchases.purchase", "result_sha256"),
    # The buyer's input and the request's fingerprint: support's.
    "input": ("purchases.quote", "canonical_input"),
    "input_hash": ("purchases.quote", "input_hash"),
    "request_fingerprint": ("purchases.idempotencyrecord", "request_fingerprint"),
}


def _view_permissions(labels: list[str]) -> list[Permission]:
    query = Q()
    for label in labels:
        model = apps.get_model(label)
        query |= Q(
            content_type__app_label=model._meta.app_label,
            codename=f"view_{model._meta.model_name}",
        )
    found = list(Permission.objects.filter(query))
    if len(found) != len(labels):
        # Permissions are created by migrate; running before it would build a silent half-role.
        raise LookupError(f"view permissions not found (run migrate first) for {sorted(labels)}")
    return found


@transaction.atomic
def roles_ensure() -> dict[str, Group]:
    """Create or reset the "support" and "finance" groups. Idempotent.

    Each group ends with exactly the view permissions of the models ROLE_TABLE gives it (the
    model-level gate); fields and actions are decided by the table itself. A permission
    granted by hand in the admin is removed on the next run, so the roles stay what this
    file says. Raises LookupError when run before migrate created the permissions.
    """
    groups = {}
    for name, models in ROLE_TABLE.items():
        group, _ = Group.objects.get_or_create(name=name)
        group.permissions.set(_view_permissions(sorted(models)))
        groups[name] = group
    return groups
