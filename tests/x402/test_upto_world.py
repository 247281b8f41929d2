"""The x402 test world can be built ready for `upto` (issue 34, part 2): Permit2 and the upto
proxy placed, every payer's Permit2 approval sent at set-up, and no approval otherwise."""

from __future__ import annotations

from devtools.permit2 import MAX_UINT256, permit2_allowance
from tests.x402.e2e import MakeWorld


def test_an_upto_world_has_its_payers_approved(make_x402_world: MakeWorld, db: None) -> None:
    world = make_x402_world(upto=True)
    assert world.payers
    for payer in world.payers:
        assert permit2_allowance(world.w3, world.token, payer.address) == MAX_UINT256
    assert permit2_allowance(world.w3, world.token, world.seller.address) == 0


def test_other_worlds_leave_the_approval_to_the_test(make_x402_world: MakeWorld, db: None) -> None:
    world = make_x402_world()
    assert all(permit2_allowance(world.w3, world.token, p.address) == 0 for p in world.payers)
