"""Responses kept for ``previous_response_id`` and ``GET /v1/responses/{id}``: in memory, within a byte budget.

Each stored response holds the response object as the client got it, its own input items (a string input as one
user message), the id of the response it continued and, for a streamed background response, its stream's events.
The conversation a ``previous_response_id`` stands for is the chain's input and output items, oldest first;
instructions are not part of it (OpenAI's API does not carry them over either). When the texts' size passes the
budget the least recently used responses go first; reading a conversation marks every response of its chain as
used, so a chain in use stays whole. A response whose ancestor is gone cannot be continued (400
``previous_response_not_found``), as after a server restart.
"""

from __future__ import annotations

import collections
import json
from dataclasses import dataclass

from .errors import APIError


@dataclass
class StoredResponse:
    response: dict  # the response object as returned
    input_items: list[dict]  # this request's own input items, each with an id
    previous_id: str | None
    events: list[dict] | None = (
        None  # a streamed background response's numbered stream events, to stream again
    )

    @property
    def id(self) -> str:
        return self.response["id"]

    def size(self) -> int:
        """Bytes of its JSON text: what the budget counts."""
        return len(json.dumps([self.response, self.input_items, self.events], ensure_ascii=False).encode())


class ResponseStore:
    """Stored responses by id, least recently used first out once their size passes ``budget_bytes``."""

    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self.used = 0
        self._items: collections.OrderedDict[str, tuple[StoredResponse, int]] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, stored: StoredResponse) -> bool:
        """Keep ``stored``, evicting the least recently used as needed; False when it alone passes the budget."""
        size = stored.size()
        if size > self.budget:
            return False
        self.delete(stored.id)
        self._items[stored.id] = (stored, size)
        self.used += size
        while self.used > self.budget:
            _, (_, evicted) = self._items.popitem(last=False)
            self.used -= evicted
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._items.get(response_id)
        if entry is None:
            return None
        self._items.move_to_end(response_id)
        return entry[0]

    def delete(self, response_id: str) -> bool:
        entry = self._items.pop(response_id, None)
        if entry is None:
            return False
        self.used -= entry[1]
        return True

    def item(self, item_id: str) -> dict | None:
        """The input or output item of a stored response with id ``item_id`` (what an ``item_reference`` names)."""
        for stored, _ in list(self._items.values()):  # a copy: another thread may reorder them meanwhile
            for item in stored.input_items + stored.response["output"]:
                if item.get("id") == item_id:
                    return item
        return None

    def conversation(self, response_id: str) -> list[dict]:
        """The input and output items of ``response_id``'s chain, oldest first (400 when any is not stored)."""
        chain: list[StoredResponse] = []
        next_id: str | None = response_id
        while next_id is not None:
            stored = self.get(next_id)
            if stored is None:
                detail = "" if next_id == response_id else f" (it continues '{next_id}', which is not stored)"
                raise APIError(
                    400,
                    f"Previous response with id '{response_id}' not found{detail}.",
                    "previous_response_not_found",
                    "previous_response_id",
                )
            chain.append(stored)
            next_id = stored.previous_id
        return [item for stored in reversed(chain) for item in stored.input_items + stored.response["output"]]
