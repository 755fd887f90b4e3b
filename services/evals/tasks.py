"""The runs an evals service carries out itself, each in a task of its own by run id (sampled through an engine:
engine_path.py; samples graded here: samples.py): the request that placed a run is answered at once, a cancel or a
delete cancels its task, the service's stop awaits them all. A task that fails is logged; its run is ended by
engine_path.expire once its reply could no longer come."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

from services.aio import cancel_and_wait

log = logging.getLogger(__name__)


class RunTasks:
    """Tasks by run id; `doing` says what they do, in the log ("asking its engine")."""

    def __init__(self, doing: str) -> None:
        self.doing = doing
        self.tasks: dict[str, asyncio.Task] = {}

    def spawn(self, run: str, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self.tasks[run] = task
        task.add_done_callback(lambda t: self._ended(run, t))

    def _ended(self, run: str, task: asyncio.Task) -> None:
        if self.tasks.get(run) is task:
            del self.tasks[run]
        if not task.cancelled() and (e := task.exception()) is not None:  # the bucket away: expire() ends the run
            log.error("eval run %s: %s failed (%s: %s)", run, self.doing, type(e).__name__, e)

    def cancel(self, run: str) -> None:
        if (task := self.tasks.get(run)) is not None:
            task.cancel()

    async def close(self) -> None:
        await cancel_and_wait(list(self.tasks.values()))
