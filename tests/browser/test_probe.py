import pytest

from devtools.situations import SITUATIONS
from purchases.models import Purchase


@pytest.mark.parametrize("name", list(SITUATIONS))
def test_probe(name, browser_world, staff_page):
    played = SITUATIONS[name](browser_world.stage)
    print("\nPLAYED", played)
    if played.purchase_ref:
        p = Purchase.objects.get(ref=played.purchase_ref)
        print("STATE", p.payment_state, p.fulfillment_state, p.reason_code)
        for e in p.events.order_by("created_at", "pk"):
            print("EV", e.subject, e.from_state, "->", e.to_state, e.reason_code, e.actor_type)
    page = staff_page("support")
    page.goto(played.admin_url)
    print("TITLE", page.title())
