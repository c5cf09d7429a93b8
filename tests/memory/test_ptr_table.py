"""``PtrTable``, the C hash table of a context's blocks: it behaves as a dict of int addresses
under any sequence of puts and conditional removes (checked against a dict by hypothesis, with
addresses crowded onto the same home slots so that probe chains wrap and deletes shift them
back), holds exactly one reference per entry, and refuses what is not an address."""

from __future__ import annotations

import gc
import sys
import weakref

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xlog_actors._core.ptr_table import PtrTable

# Addresses that differ only in their low 4 bits share a home slot; a few high-bit patterns
# spread the rest. Up to 500 keys: the table grows from 64 slots several times.
_ADDRESSES = st.builds(lambda hi, lo: (hi << 8) | lo, st.integers(0, 40), st.integers(0, 15)) | st.integers(
    0, (1 << 64) - 1
)
_OPS = st.lists(st.tuples(st.sampled_from(["put", "pop", "pop-other"]), _ADDRESSES), max_size=600)


def _home(key: int, slots: int = 64) -> int:
    """The slot the table probes first for ``key`` (its hash, written again here)."""
    return (((key >> 4) * 0x9E3779B97F4A7C15) % (1 << 64)) >> (64 - slots.bit_length() + 1)


# Addresses whose home is one of the last two or the first two of the first 64 slots: their
# probe chains wrap around the table's end, where a delete's shifting back is easiest to get
# wrong. 24 of them keep the table at 64 slots.
_CROWDED = [k << 4 for k in range(1, 20000) if _home(k << 4) in (62, 63, 0, 1)][:24]


class Box:
    """A value with identity (``pop_if`` removes only the very object it is given)."""


@settings(max_examples=60, deadline=None)
@given(_OPS)
def test_it_behaves_as_a_dict_of_addresses(ops: list[tuple[str, int]]) -> None:
    table, model = PtrTable(), {}
    for op, key in ops:
        if op == "put":
            value = Box()
            table.put(key, value)
            model[key] = value
        elif op == "pop":
            expected = model.pop(key, None)
            assert table.pop_if(key, expected if expected is not None else Box()) is (expected is not None)
        else:  # another object at the same address is never removed
            assert table.pop_if(key, Box()) is False
        assert len(table) == len(model)
    for key, value in model.items():
        assert table.get(key) is value
    assert sorted(key for key, _ in table.items()) == sorted(model)  # each address read as itself
    assert sorted(map(id, table.values())) == sorted(map(id, model.values()))
    table.clear()
    assert len(table) == 0 and table.values() == [] and all(table.get(k) is None for k in model)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.sampled_from(_CROWDED)), max_size=200))
def test_chains_that_wrap_around_the_end_survive_any_deletes(ops: list[tuple[bool, int]]) -> None:
    table, model = PtrTable(), {}
    for put, key in ops:
        if put:
            model[key] = Box()
            table.put(key, model[key])
        elif key in model:
            assert table.pop_if(key, model.pop(key))
        assert all(table.get(k) is v for k, v in model.items()), "an entry was lost to a shift"
        assert all(table.get(k) is None for k in _CROWDED if k not in model)


def test_each_entry_holds_one_reference_and_lets_it_go() -> None:
    table, value = PtrTable(), Box()
    before = sys.getrefcount(value)
    table.put(0x1000, value)
    table.put(0x1000, value)  # replaced by itself: still one reference
    assert sys.getrefcount(value) == before + 1
    assert table.pop_if(0x1000, value) and sys.getrefcount(value) == before
    gone = [Box() for _ in range(3)]
    refs = [weakref.ref(b) for b in gone]
    for i, b in enumerate(gone):
        table.put(i << 8, b)
    table.put(0, Box())  # the replaced value is released
    del gone, b
    gc.collect()
    assert refs[0]() is None and refs[1]() is not None
    table.clear()
    assert all(r() is None for r in refs)
    kept = [Box() for _ in range(3)]
    refs = [weakref.ref(b) for b in kept]
    table = PtrTable()
    for i, b in enumerate(kept):
        table.put(i, b)
    del kept, b, table  # the table's own release lets its values go
    gc.collect()
    assert all(r() is None for r in refs)


@pytest.mark.parametrize("key", [0, 1, (1 << 30) - 1, 1 << 30, (1 << 60) - 1, 1 << 60, (1 << 64) - 1])
def test_addresses_at_each_digit_boundary_are_read_as_themselves(key: int) -> None:
    """The digits of an int are read in place where the interpreter's layout allows (one or two
    30-bit digits), else converted by a call: either way the key is the address."""
    table, box = PtrTable(), Box()
    table.put(key, box)
    assert table.items() == [(key, box)] and table.get(key) is box
    assert table.get(key + 1) is None and (key == 0 or table.get(key - 1) is None)


@pytest.mark.parametrize("bad", [-1, -(1 << 40), -(1 << 70), 1 << 64, 1 << 90, 1.0, "0x10", True, None])
def test_what_is_not_an_address_is_never_a_key(bad: object) -> None:
    table = PtrTable()
    table.put(0x10, Box())
    assert table.get(bad, "missing") == "missing"
    assert table.pop_if(bad, None) is False
    with pytest.raises(TypeError, match="int address"):
        table.put(bad, Box())  # type: ignore[arg-type]
    assert len(table) == 1 and table.get(0x10) is not None
