"""The rail registry: every rail a purchase can be on is implemented once, behind the one
interface the checkout and settlement orchestration use."""

from __future__ import annotations

import inspect

import pytest

from payments.models import Rail
from payments.rails import PaymentRail, rail_for
from payments.rails.base import RAILS

INTERFACE = sorted(
    name
    for name, member in inspect.getmembers(PaymentRail)
    if not name.startswith("_")
    and (inspect.isfunction(member) or name in PaymentRail.__annotations__)
)


def test_every_rail_is_registered_once_under_its_own_name():
    assert sorted(RAILS) == sorted(Rail.values)
    for name in Rail.values:
        assert rail_for(name).name == name


@pytest.mark.parametrize("name", Rail.values)
def test_each_rail_implements_the_whole_interface_with_its_signatures(name):
    rail = rail_for(name)
    for member in INTERFACE:
        assert hasattr(rail, member), f"{name} lacks {member}"
        expected = getattr(PaymentRail, member)
        if inspect.isfunction(expected):
            wanted = list(inspect.signature(expected).parameters)
            assert list(inspect.signature(getattr(type(rail), member)).parameters) == wanted


def test_an_unknown_rail_is_refused_not_guessed():
    with pytest.raises(KeyError):
        rail_for("card")


def test_only_the_prepaid_rail_settles_when_recorded():
    assert {name for name in Rail.values if rail_for(name).settles_when_recorded} == {"prepaid"}
