"""server/response_store.py: the byte budget, least-recently-used eviction and conversation chains."""

from __future__ import annotations

import pytest

from ds4serve.server.errors import APIError
from ds4serve.server.response_store import ResponseStore, StoredResponse


def _stored(rid: str, previous: str | None = None, text: str = "x") -> StoredResponse:
    return StoredResponse(
        {"id": rid, "output": [{"type": "message", "id": f"out_{rid}", "text": text}]},
        [{"type": "message", "id": f"in_{rid}", "text": text}],
        previous,
    )


def test_a_chain_s_conversation_is_its_items_oldest_first():
    store = ResponseStore(1 << 20)
    store.put(_stored("a"))
    store.put(_stored("b", previous="a"))
    store.put(_stored("c", previous="b"))
    assert [i["id"] for i in store.conversation("c")] == ["in_a", "out_a", "in_b", "out_b", "in_c", "out_c"]
    assert [i["id"] for i in store.conversation("a")] == ["in_a", "out_a"]


def test_the_least_recently_used_go_first_once_past_the_budget():
    size = _stored("a").size()
    store = ResponseStore(3 * size)
    for rid in "abc":
        store.put(_stored(rid))
    store.get("a")  # used: "b" is now the oldest
    store.put(_stored("d"))
    assert store.get("b") is None and all(store.get(r) for r in "acd")
    assert len(store) == 3 and store.used == 3 * size
    assert store.delete("a") and not store.delete("a") and store.used == 2 * size


def test_reading_a_conversation_keeps_its_chain_and_a_broken_chain_is_named():
    size = _stored("a").size()
    store = ResponseStore(3 * size)
    store.put(_stored("a"))
    store.put(_stored("b", previous="a"))
    store.put(_stored("x"))
    store.conversation("b")  # marks a and b used: x goes first
    store.put(_stored("y"))
    assert store.get("x") is None and store.get("a") is not None
    store.delete("a")
    with pytest.raises(APIError) as err:
        store.conversation("b")
    assert err.value.status == 400 and err.value.code == "previous_response_not_found"
    assert (
        err.value.param == "previous_response_id"
        and "'b'" in err.value.message
        and "'a'" in err.value.message
    )


def test_a_response_larger_than_the_budget_is_not_kept():
    store = ResponseStore(_stored("a").size() - 1)
    assert not store.put(_stored("a")) and len(store) == 0 and store.used == 0
    with pytest.raises(APIError):
        store.conversation("a")
