"""What an attempt needs on this node before its trainer starts, fetched into its directory (or the node's caches):
its datasets, the checkpoint it goes on from, the adapter it starts from; and what its trainer is told (TrainerSpec).
Each fetch is said in a `preparing` report."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

from nats.aio.client import Client

from schemas.events import DataFile, TrainerSpec
from schemas.jobs import DatasetRef
from schemas.nodes import CPU_DEVICE, Assignment
from services.agent.config import AgentConfig
from services.agent.datasets import DatasetCache, LocalDataset
from services.agent.engines import rollout_engine
from services.agent.session_run import SessionLost
from services.agent.shipping import fetch_adapter, fetch_checkpoint, fetch_session_start

log = logging.getLogger(__name__)


class JobInputs:
    """One attempt's inputs: `say` reports a step of preparing them; `held` gets the datasets taken from the cache
    (held until the attempt ends)."""

    def __init__(
        self,
        nc: Client,
        cfg: AgentConfig,
        datasets: DatasetCache,
        a: Assignment,
        job_dir: Path,
        say: Callable[[str], Awaitable[None]],
        held: list[LocalDataset],
    ) -> None:
        self.nc, self.cfg, self.datasets, self.a = nc, cfg, datasets, a
        self.job_dir, self.say, self.held = job_dir, say, held

    async def spec(self) -> TrainerSpec:
        """What the trainer is told: the job, and where what it starts from (a checkpoint, datasets, an adapter) is
        on this node, fetched here first."""
        a = self.a
        engine, no_engine = rollout_engine(self.cfg.engines, a.request, self.cfg.rollout_priority)
        return TrainerSpec(
            job=a.job,
            attempt=a.attempt,
            request=a.request,
            out_dir=str(self.job_dir / "out"),
            device="cuda" if a.device != CPU_DEVICE else "cpu",
            resume_from=await self._checkpoint(),
            dataset=await self._dataset(a.request.dataset),
            validation=await self._dataset(a.request.validation_dataset),
            token_cache=str(self.datasets.tokens),
            init_adapter=await self._init_adapter(),
            rollout_engine=engine,
            no_rollout_engine=no_engine,
        )

    async def _dataset(self, ref: DatasetRef | None) -> DataFile | None:
        """The job's dataset on local disk, from this node's cache or fetched into it."""
        if ref is None:
            return None
        await self.say(f"fetching dataset {ref.name}")
        local = await self.datasets.acquire(ref)
        self.held.append(local)
        return DataFile(
            path=str(local.path), sha256=local.info.sha256, format=local.info.stats.format, rows=local.info.stats.rows
        )

    async def _checkpoint(self) -> str | None:
        """A re-queued or resumed job goes on from the checkpoint its last node stored; None: from step 0."""
        a = self.a
        if not a.resume_from:
            return None
        try:
            where = await fetch_checkpoint(self.nc, a, self.job_dir)
        except Exception as e:
            if a.request.session is not None:  # a session's client was told its saves are kept: never step 0
                raise SessionLost(
                    f"the session's checkpoint {a.resume_from} could not be fetched ({e}): it fails rather than go on from step 0; its saves stay stored (create_training_client_from_state starts from one)"
                ) from e
            log.warning(
                "job %s: checkpoint %s could not be fetched (%s); starting from step 0", a.job, a.resume_from, e
            )
            await self.say(f"checkpoint {a.resume_from} could not be fetched ({e}); starting from step 0")
            return None
        await self.say(f"resuming from checkpoint {a.resume_from}")
        return str(where)

    async def _init_adapter(self) -> str | None:
        """The registered adapter the job starts from (a session: the saved state it starts from), unpacked into its
        directory."""
        if (start := await fetch_session_start(self.nc, self.a, self.job_dir)) is not None:
            return str(start)
        ref = self.a.request.init_adapter
        if ref is None or ref.peft is None:
            return None
        await self.say(f"starting from adapter {ref.name}@{ref.version}")
        return str(await fetch_adapter(self.nc, ref.peft, self.job_dir))
