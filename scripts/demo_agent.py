"""A scripted agent that buys a report on the prepaid rail the disciplined way.

It writes its payment id and request to disk before sending, retries with the same id,
and looks the purchase up instead of paying again. Usage: demo_agent.py [BASE_URL]
"""

from __future__ import annotations

import json
import secrets
import sys
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]
BASE = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000"
CREDENTIALS = ROOT / "var" / "demo-credentials.json"
JOURNAL = ROOT / "var" / "demo-agent-journal.json"


def main() -> int:
    api_key = json.loads(CREDENTIALS.read_text())["demo-agent-alice"]
    headers = {"Authorization": f"Bearer {api_key}"}
    request = {
        "offering": "csv-report",
        "input": {"title": "Demo sales", "csv": "region,units\nnorth,3\nsouth,5\neast,8\n"},
    }
    quote = requests.post(f"{BASE}/api/v1/quotes", json=request, headers=headers, timeout=10).json()
    print("quote", quote["id"], "price", quote["price"], "expires", quote["expires_at"])

    # Store the payment id and request durably *before* sending: a crash after this point
    # retries with the same id instead of paying twice.
    payment_id = f"demo-{secrets.token_hex(12)}"
    JOURNAL.write_text(json.dumps({"payment_id": payment_id, "quote": quote["id"]}))
    purchase_url = f"{BASE}/api/v1/quotes/{quote['id']}/purchase"
    for _ in range(10):
        response = requests.post(
            purchase_url,
            json={"rail": "prepaid"},
            timeout=10,
            headers={**headers, "Idempotency-Key": payment_id},
        )
        if response.status_code != 409 or response.json()["code"] != "payment_in_flight":
            break
        time.sleep(int(response.headers.get("Retry-After", "1")))
    body = response.json()
    print("purchase", response.status_code, body.get("purchase"), body.get("code", ""))
    if response.status_code != 201:
        return 1
    result_url = f"{BASE}{body['links']['result']}"
    for _ in range(60):
        result = requests.get(result_url, headers=headers, timeout=10)
        if result.status_code != 202:
            break
        time.sleep(int(result.headers.get("Retry-After", "1")))
    print("result", result.status_code, result.headers.get("Content-Type"))
    print(json.dumps(result.json(), indent=2)[:800])
    status = requests.get(f"{BASE}{body['links']['self']}", headers=headers, timeout=10).json()
    receipt = requests.get(f"{BASE}{status['links']['receipt']}", timeout=10).json()
    print("receipt", json.dumps(receipt, indent=2))
    return 0 if result.status_code == 200 else 1


if __name__ == "__main__":
    sys.exit(main())
