"""Pages as OpenAI's list endpoints give them (`limit`, `after` the id of the last object of the page before,
`has_more`), and the walk that reads a page newest first from a store read forward only: windows that double back
from where the page starts, so a page costs a few requests however long the history behind it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from aiohttp import web

from schemas.gateway import Page
from services.gateway.errors import bad_request

T = TypeVar("T")
# read(lo, cap, hi): the items whose place is above lo and below hi, oldest first, at most about cap of them, and
# whether that was all of that span (False: the span holds more than one answer carries)
Read = Callable[[int, int, int], Awaitable[tuple[list[tuple[int, T]], bool]]]


def limit_of(request: web.Request, default: int, most: int = 100) -> int:
    raw = request.query.get("limit", str(default))
    try:
        limit = int(raw)
    except ValueError:
        raise bad_request(f"limit must be a whole number from 1 to {most}, not {raw!r}", "limit") from None
    if not 1 <= limit <= most:
        raise bad_request(f"limit must be from 1 to {most}, not {limit}", "limit")
    return limit


def unknown_after(after: str, what: str) -> Exception:
    """The answer to an `after` that names nothing of the list: a 400 naming `after` (OpenAI's SDKs pass the
    `last_id` of the page before; any other value is a mistake worth saying, not an empty page)."""
    return bad_request(
        f"after: no {what} has the id '{after}'; pass the id of the last object of the page before (its last_id)",
        "after",
        "invalid_cursor",
    )


def page(items: Sequence[Any], after: str | None, limit: int, what: str, ident=lambda x: x.id) -> Page:
    """Items in the list's order: those after the one whose id is `after`, `limit` of them."""
    start = 0
    if after:
        ids = [ident(x) for x in items]
        if after not in ids:
            raise unknown_after(after, what)
        start = ids.index(after) + 1
    shown = list(items[start : start + limit])
    return paged(shown, len(items) - start > limit, ident)


def paged(shown: list, has_more: bool, ident=lambda x: x.id) -> Page:
    return Page(
        data=shown,
        has_more=has_more,
        first_id=ident(shown[0]) if shown else None,
        last_id=ident(shown[-1]) if shown else None,
    )


async def newest_before(read: Read[T], hi: int, want: int, window: int = 0) -> list[T]:
    """Up to `want` items placed below `hi`, newest first. Each window (first `window` places wide; 0: a few
    times `want`) is read forward; one that holds more than an answer carries is narrowed (the newest are wanted,
    an answer holds the oldest), and each one after it is twice as wide, so sparse items far back cost a few more
    requests, not one per place."""
    found: list[T] = []
    window, cap = window or max(4 * want, 64), 2 * want + 64
    while len(found) < want and hi > 1:
        lo = max(0, hi - 1 - window)
        items, complete = await read(lo, cap, hi)
        if not complete and hi - lo > 2:
            window = max(1, window // 4)
            continue
        found += [item for _, item in reversed(items)]
        hi, window = lo + 1, window * 2
    return found[:want]
