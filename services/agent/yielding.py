"""Training in the serving engines' idle time. Compute: while an engine serves requests, the trainers on its
devices are stopped where they stand (SIGSTOP to their process group: memory stays, going on costs nothing) and
go on once it has been idle for the hold-off, or once it has not answered for `silent` seconds (it is not stopped
for that engine again until it answers). Memory: when its KV cache fills past a threshold or it preempts,
the device's memory is asked back through the reclaim path (the scheduler pauses the job there with a checkpoint
and resumes it when the engine lets go)."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field

from schemas.events import ENGINE_WAIT
from services.agent.engine_load import LoadWatch, Reading
from services.aio import sleep_unless_stopped

log = logging.getLogger(__name__)
MODES = ("both", "compute", "memory", "off")


@dataclass(frozen=True)
class YieldPolicy:
    """`--engine-yield both,holdoff=2,kv=0.9,poll=0.2,timeout=1,metrics=1,devices=0+1,exempt=50,nice=5,silent=60`."""

    mode: str = "both"
    poll_s: float = 0.2
    timeout_s: float = 1.0
    holdoff_s: float = 2.0  # idle this long before training goes on
    kv_threshold: float = 0.9  # KV cache use at which the engine gets its memory back
    devices: tuple[int, ...] | None = None  # the engine's devices; None: every device of the node
    exempt_priority: int | None = None  # admins' jobs above this priority do not yield (a tenant's always does)
    metrics_s: float = 1.0  # between full /metrics reads where vLLM's /load says whether it is busy
    nice: int = 5  # the trainers beside the engine run at this CPU niceness (compute modes), so its threads
    # take the CPU the moment they are runnable, before a poll has even seen the request
    silent_s: float = 60.0  # a trainer stopped for an engine that has not answered this long goes on

    @classmethod
    def parse(cls, text: str) -> "YieldPolicy":
        mode, *settings = [p.strip() for p in text.split(",") if p.strip()] or ["both"]
        if mode not in MODES:
            raise ValueError(f"--engine-yield {text!r}: start with one of {', '.join(MODES)}")
        keys = {
            "poll": "poll_s",
            "timeout": "timeout_s",
            "holdoff": "holdoff_s",
            "kv": "kv_threshold",
            "devices": "devices",
            "exempt": "exempt_priority",
            "nice": "nice",
            "metrics": "metrics_s",
            "silent": "silent_s",
        }
        values: dict = {"mode": mode}
        for setting in settings:
            key, _, value = setting.partition("=")
            if key not in keys or not value:
                raise ValueError(
                    f"--engine-yield {text!r}: {setting!r} is not one of {', '.join(k + '=' for k in keys)}"
                )
            try:
                values[keys[key]] = (
                    tuple(int(d) for d in value.split("+"))
                    if key == "devices"
                    else int(value)
                    if key in ("exempt", "nice")
                    else float(value)
                )
            except ValueError:
                raise ValueError(
                    f"--engine-yield {text!r}: {key} takes a number" + (" list like 0+1" if key == "devices" else "")
                ) from None
        policy = cls(**values)
        if not 0 <= policy.nice <= 19:
            raise ValueError(f"--engine-yield {text!r}: nice is 0 (none) to 19")
        if policy.silent_s <= 0:
            raise ValueError(f"--engine-yield {text!r}: silent takes seconds above 0")
        return policy

    def yields(self, priority: int | None) -> bool:
        """Whether a job yields, given its priority against engines (Assignment.engine_priority, the
        scheduler's; None: always, as a tenant's job does)."""
        return priority is None or self.exempt_priority is None or priority <= self.exempt_priority


@dataclass
class Yielded:
    """How a job stands with the engines it shares devices with."""

    to: str = ""  # the engine it is stopped for now ("": it computes)
    since: float = 0.0  # monotonic
    total_s: float = 0.0
    released: bool = False  # asked to pause or stop: it must compute to get there, and never yields again

    def summary(self) -> str:
        return f"; yielded {self.total_s:.1f}s to serving" if self.total_s >= 0.05 else ""


@dataclass
class EngineYield:
    """One engine's watch, the policy it is held to, and whether it has its memory back."""

    watch: LoadWatch
    policy: YieldPolicy
    reclaiming: set[int] = field(default_factory=set)
    preemptions: float | None = None
    calm_since: float | None = None  # monotonic: since when its memory pressure has been gone


class Yielder:
    """Polls every engine and has the trainers on its devices yield to it. `agent` gives the running jobs, their
    devices and trainers, the node's devices, and the reclaim and report paths."""

    def __init__(self, agent, engines: list[EngineYield]) -> None:
        self.agent, self.engines = agent, engines

    def loads(self) -> list:
        return [e.watch.load() for e in self.engines]

    async def run(self, stop: asyncio.Event) -> None:
        """Poll every engine until `stop` (or cancelled); the watches' HTTP sessions are closed at the end."""
        if not self.engines:
            return
        tick = min(e.policy.poll_s for e in self.engines)
        try:
            while not await sleep_unless_stopped(stop, tick):
                for engine in self.engines:
                    try:
                        await self._poll(engine)
                    except Exception as e:  # a report that could not be sent: the next poll tries again
                        log.warning("yielding to %s: %s: %s", engine.watch.label, type(e).__name__, e)
        finally:
            for engine in self.engines:
                await engine.watch.close()

    def niceness(self, devices: list[int]) -> int:
        """The CPU niceness of a trainer on `devices`: the highest any engine there asks for (compute modes)."""
        return max(
            (
                e.policy.nice
                for e in self.engines
                if e.policy.mode in ("both", "compute") and self.devices_of(e) & set(devices)
            ),
            default=0,
        )

    def devices_of(self, engine: EngineYield) -> set[int]:
        return (
            set(engine.policy.devices) if engine.policy.devices is not None else {d.index for d in self.agent.devices}
        )

    async def _poll(self, engine: EngineYield) -> None:
        reading = await engine.watch.poll()
        if reading is None:  # not read: nothing changes on a guess (the heartbeat carries the error) ...
            if engine.policy.mode in ("both", "compute"):
                await self._silent(engine)  # ... but a trainer is not stopped for ever for an engine gone silent
            return
        devices = self.devices_of(engine)
        if self.agent.draining:
            return
        if engine.policy.mode in ("both", "compute"):
            await self._compute(engine, reading, devices)
        if engine.policy.mode in ("both", "memory"):
            await self._memory(engine, reading, devices)

    async def _compute(self, engine: EngineYield, reading: Reading, devices: set[int]) -> None:
        label = engine.watch.label
        for run in list(self.agent.jobs.values()):
            y, trainer = run.yielded, run.trainer
            if trainer is None or not devices & set(run.devices) or y.released:
                continue
            if not engine.policy.yields(run.assignment.engine_priority):
                continue
            if reading.busy and not y.to and not waits_on_engine(trainer):
                trainer.suspend()
                y.to, y.since = label, time.monotonic()
                await self.agent.report_yield(run, f"yielding to {label}: {describe(reading)}")
            elif y.to == label and engine.watch.idle_for() >= engine.policy.holdoff_s:
                await self.go_on(run, f"training again: {label} idle for {engine.policy.holdoff_s:g}s")

    async def _silent(self, engine: EngineYield) -> None:
        """The trainers stopped for an engine that has not answered for `silent` seconds go on; they are stopped for
        it again only once it answers (a poll that reads it) and serves."""
        silent = engine.watch.silent_for()
        if silent < engine.policy.silent_s:
            return
        label = engine.watch.label
        for run in list(self.agent.jobs.values()):
            if run.yielded.to != label or run.trainer is None:
                continue
            log.warning(
                "job %s: %s has not answered for %.0fs (%s); its trainer goes on until the engine answers again",
                run.assignment.job,
                label,
                silent,
                engine.watch.error,
            )
            await self.go_on(
                run,
                f"training again: {label} has not answered for {silent:.0f}s ({engine.watch.error}); "
                "yielding resumes when it answers",
            )

    async def go_on(self, run, why: str | None = None) -> None:
        """Let a stopped trainer compute again (and say so, when `why`)."""
        y = run.yielded
        if not y.to:
            return
        run.trainer.go_on()
        y.total_s += time.monotonic() - y.since
        y.to = ""
        if why:
            await self.agent.report_yield(run, f"{why} (yielded {y.total_s:.1f}s so far)")

    async def release(self, run) -> None:
        """The job is to pause or stop: it computes to its next step's end, and does not yield again."""
        run.yielded.released = True
        await self.go_on(run)

    async def _memory(self, engine: EngineYield, reading: Reading, devices: set[int]) -> None:
        preempted = (
            engine.preemptions is not None
            and reading.preemptions is not None
            and reading.preemptions > engine.preemptions
        )
        engine.preemptions = reading.preemptions
        full = reading.kv_usage is not None and reading.kv_usage >= engine.policy.kv_threshold
        calm = not preempted and (reading.kv_usage is None or reading.kv_usage < engine.policy.kv_threshold - 0.1)
        engine.calm_since = (engine.calm_since or time.monotonic()) if calm else None
        if (full or preempted) and not engine.reclaiming:
            why = "preempted requests" if preempted else f"KV cache {reading.kv_usage:.0%} full"
            log.info("%s: %s; asking devices %s back from training", engine.watch.label, why, sorted(devices))
            for device in sorted(devices):
                held = [r.assignment.request.gpu_mib or 1 for r in self.agent.jobs.values() if device in r.devices]
                await self.agent.reclaim_device(device, sum(held) or 1)
            engine.reclaiming = devices
        elif (
            engine.reclaiming and engine.calm_since and time.monotonic() - engine.calm_since >= engine.policy.holdoff_s
        ):
            for device in sorted(engine.reclaiming):
                await self.agent.reclaim_device(device, 0)
            engine.reclaiming = set()


def waits_on_engine(trainer) -> bool:
    """Whether a grpo trainer waits on its rollout engine now (schemas.events.ENGINE_WAIT): it computes nothing, and
    what the engine serves may be its own requests; it is stopped for live traffic once it computes again."""
    return os.path.exists(os.path.join(trainer.spec.out_dir, ENGINE_WAIT))


def describe(reading: Reading) -> str:
    if reading.in_flight is not None:
        return f"{int(reading.in_flight)} requests in flight"
    return f"{int(reading.running)} requests running, {int(reading.waiting)} waiting"


def engine_yields(config) -> list[EngineYield]:
    """A watch for every engine with an address, under its policy (the i-th --engine-yield, or the only one)."""
    policies = config.engine_yield or [YieldPolicy()]
    out = []
    for i, engine in enumerate(config.engines):
        policy = policies[i] if i < len(policies) else policies[-1]
        if engine.url:  # "off" still reads its load: heartbeats carry it, and placement prefers idle engines
            watch = LoadWatch(engine.label, engine.url, list(policy.devices or ()), policy.timeout_s, policy.metrics_s)
            out.append(EngineYield(watch, policy))
    return out
