"""A serving engine's load, read from its own metrics: vLLM's Prometheus `/metrics`, or llama-server's (started
with `--metrics`), and where vLLM offers it (`--enable-server-load-tracking`) its `/load`: the requests in flight
at its API server, counted from their arrival, at a twentieth of a `/metrics` scrape's CPU. Polled on the agent's
loop (aiohttp: engine_http.py) with a timeout; an engine that does not answer is reported as such, never guessed, and
how long it has not answered is kept (a trainer stopped for it goes on after a while: yielding.py)."""

from __future__ import annotations

import collections
import json
import logging
import re
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from schemas.nodes import EngineLoad
from services.agent.engine_http import BadStatus, EngineHttp, NoAnswer

# metric name -> what it counts; the first of each kind that an engine exposes is used
RUNNING = ("vllm:num_requests_running", "llamacpp:requests_processing")
WAITING = ("vllm:num_requests_waiting", "llamacpp:requests_deferred")
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "llamacpp:kv_cache_usage_ratio")
PREEMPTIONS = ("vllm:num_preemptions_total", "vllm:num_preemptions")
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfINFaN]+)")
BUSY_WINDOW = 600  # polls the busy fraction is taken over
DISTRUST_AFTER = 3  # /metrics reads showing requests while /load says none, before /load is taken as untracked
log = logging.getLogger(__name__)


@dataclass
class Reading:
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float | None = None
    preemptions: float | None = None
    in_flight: float | None = None  # vLLM's /load, where it is read: it sees a request before the engine does

    @property
    def busy(self) -> bool:
        return self.in_flight > 0 if self.in_flight is not None else self.running + self.waiting > 0


def parse_metrics(text: str) -> Reading:
    """Sum each metric over its label sets (an engine serving several models reports one per model)."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not (m := _SAMPLE.match(line)):
            continue
        try:
            sums[m.group(1)] = sums.get(m.group(1), 0.0) + float(m.group(3))
        except ValueError:
            continue

    def first(names: tuple[str, ...]) -> float | None:
        return next((sums[n] for n in names if n in sums), None)

    if first(RUNNING) is None and first(WAITING) is None:
        raise ValueError(
            "no request counts in its metrics (vllm:num_requests_running, llamacpp:requests_processing); "
            "for llama-server, start it with --metrics"
        )
    kv = first(KV_USAGE)
    return Reading(
        running=first(RUNNING) or 0.0,
        waiting=first(WAITING) or 0.0,
        kv_usage=None if kv is None else min(max(kv, 0.0), 1.0),
        preemptions=first(PREEMPTIONS),
    )


async def fetch_text(url: str, timeout: float, *, http: EngineHttp) -> str:
    """The page's text (its first 4 MiB); raises BadStatus for an error status, NoAnswer where none came (both
    OSErrors)."""
    status, data = await http.request("GET", url, timeout, limit=4 * 2**20)
    text = data.decode(errors="replace")
    if not 200 <= status < 300:
        raise BadStatus(url, status, text)
    return text


async def fetch_in_flight(url: str, timeout: float, *, http: EngineHttp) -> float | None:
    """vLLM's `/load` (`{"server_load": N}`); None where the engine has no such page."""
    try:
        body = json.loads(await fetch_text(f"{url}/load", timeout, http=http))
    except BadStatus as e:
        if e.status in (404, 405):
            return None
        raise
    except ValueError:
        return None
    load = body.get("server_load") if isinstance(body, dict) else None
    return float(load) if isinstance(load, (int, float)) else None


class LoadWatch:
    """One engine's latest reading, how busy it has been lately and how long it has not answered; it keeps its own
    HTTP session, which close() lets go."""

    def __init__(self, label: str, url: str, devices: list[int], timeout: float, metrics_every_s: float = 1.0) -> None:
        self.label, self.url, self.devices, self.timeout = label, url, devices, timeout
        self.metrics_every_s = metrics_every_s  # between /metrics reads while /load tells whether it is busy
        self.reading: Reading | None = None
        self.error = ""
        self.polls: collections.deque[bool] = collections.deque(maxlen=BUSY_WINDOW)
        self.idle_since: float | None = None  # monotonic: when it was last seen turning idle
        self.use_load: bool | None = None  # None: not tried yet
        self.load_seen_busy = False
        self.contradicted = 0
        self.metrics_due = 0.0
        self.read_at: float | None = None  # monotonic: the last poll that read it
        self.silent_since: float | None = None  # monotonic: since when no poll has read it (None: the last one did)
        self.http = EngineHttp()

    async def poll(self) -> Reading | None:
        """Read the engine once; None (and `error` says why) when it did not answer or made no sense."""
        try:
            self.reading, self.error = await self._read(), ""
        except (OSError, ValueError) as e:  # NoAnswer and BadStatus are OSErrors; ValueError: not its metrics
            self.reading, self.error = None, _why(e)
            if self.silent_since is None:
                self.silent_since = self.read_at or time.monotonic()
            return None
        self.read_at, self.silent_since = time.monotonic(), None
        busy = self.reading.busy
        self.polls.append(busy)
        if busy:
            self.idle_since = None
        elif self.idle_since is None:
            self.idle_since = time.monotonic()
        return self.reading

    async def _read(self) -> Reading:
        """/load every poll where it is tracked, /metrics every `metrics_every_s` (or every poll where it is not)."""
        in_flight = None
        if self.use_load is not False:
            in_flight = await fetch_in_flight(self.url, self.timeout, http=self.http)
            self.use_load = in_flight is not None
        now = time.monotonic()
        if in_flight is None or self.reading is None or now >= self.metrics_due:
            metrics = parse_metrics(await fetch_text(f"{self.url}/metrics", self.timeout, http=self.http))
            self.metrics_due = now + self.metrics_every_s
            if in_flight is not None and self._untracked(in_flight, metrics):
                in_flight = None
        else:
            metrics = self.reading
        metrics.in_flight = in_flight
        return metrics

    def _untracked(self, in_flight: float, metrics: Reading) -> bool:
        """vLLM answers /load with 0 unless started with --enable-server-load-tracking: /load is dropped once the
        engine's own counts show requests at several reads where /load never has."""
        self.load_seen_busy = self.load_seen_busy or in_flight > 0
        if self.load_seen_busy or in_flight > 0 or metrics.running + metrics.waiting == 0:
            return False
        self.contradicted += 1
        if self.contradicted < DISTRUST_AFTER:
            return False
        self.use_load = False
        log.warning(
            "%s: /load says no requests while /metrics shows some; reading /metrics at every poll instead "
            "(start vLLM with --enable-server-load-tracking for an earlier signal that costs it less)",
            self.label,
        )
        return True

    def idle_for(self) -> float:
        return 0.0 if self.idle_since is None else time.monotonic() - self.idle_since

    def silent_for(self) -> float:
        """Seconds since a poll last read the engine (0 while the last one did)."""
        return 0.0 if self.silent_since is None else time.monotonic() - self.silent_since

    async def close(self) -> None:
        """Let the HTTP session go (the agent's end)."""
        await self.http.close()

    def load(self) -> EngineLoad:
        r = self.reading
        running = max(r.running, r.in_flight or 0.0) if r else 0.0
        return EngineLoad(
            engine=self.label,
            devices=self.devices,
            running=int(running),
            waiting=int(r.waiting) if r else 0,
            kv_usage=r.kv_usage if r else None,
            busy_fraction=sum(self.polls) / len(self.polls) if self.polls else 0.0,
            error=self.error,
        )


def _why(error: Exception) -> str:
    """A failed read in a few words, for heartbeats (`jetlora nodes`) and the job's message: "connection refused at
    /load", "HTTP 500 at /metrics", or what its metrics lacked."""
    if isinstance(error, (NoAnswer, BadStatus)):
        return f"{error.reason} at {urlsplit(error.url).path or '/'}"
    return str(error) if isinstance(error, ValueError) else f"{type(error).__name__}: {error}"
