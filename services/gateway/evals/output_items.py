"""A page of a run's output items, read as a page: the evals service is asked for the items from where the page
starts (an item's index is its place in the run, 0 to n-1), a little more than the page, never the whole run; a
page of `status` pass or fail reads on only until the page is full. Newest first (`order=desc`) reads windows back
from the end (the run's item count) or from `after`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from schemas.evals import EvalRun, ItemResult
from services.gateway.evals import mapping as evals_map

ASK_MOST = 1000  # items one ask of the evals service carries (ItemsQuery.limit's most)
INDEX_MAX = 2**31  # no run has more items (a run takes up to 10,000)
# ask(after, limit): the run's items whose index is above `after`, in order, at most `limit`; and whether more follow
Ask = Callable[[int, int], Awaitable[tuple[list[ItemResult], bool]]]


def _fits(run: EvalRun, item: ItemResult, status: str | None) -> dict[str, Any] | None:
    shown = evals_map.output_item(run, item)
    return shown if status is None or shown["status"] == status else None


async def page(
    ask: Ask, run: EvalRun, start: int | None, limit: int, desc: bool, status: str | None
) -> tuple[list[dict[str, Any]], bool]:
    """The output items of the page after the item of index `start` (None: from the first, or the last when
    desc), at most `limit`, and whether more follow."""
    want = limit + 1  # one more than the page says whether there is more
    if start is not None:  # an id past the run's items (or past any index a query carries) starts at its end
        start = min(start, run.summary.items if run.summary else INDEX_MAX)
    found: list[dict[str, Any]] = []
    if not desc:
        after, more = -1 if start is None else start, True
        while more and len(found) < want:
            items, more = await ask(after, min(ASK_MOST, want if status is None else ASK_MOST))
            found += [shown for i in items if (shown := _fits(run, i, status)) is not None]
            if not items:
                break
            after = items[-1].index
    else:
        hi = start if start is not None else (run.summary.items if run.summary else 0)
        while hi > 0 and len(found) < want:
            width = min(ASK_MOST, want - len(found) if status is None else ASK_MOST, hi)
            items, _ = await ask(hi - 1 - width, width)
            window = [i for i in items if i.index < hi]
            found += [shown for i in reversed(window) if (shown := _fits(run, i, status)) is not None]
            hi -= width
    return found[:limit], len(found) > limit
