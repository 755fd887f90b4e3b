"""A serving engine's load, read from its own metrics: vLLM's Prometheus `/metrics`, or llama-server's (started
with `--metrics`). Polled with a timeout; an engine that does not answer is reported as such, never guessed."""

from __future__ import annotations

import asyncio
import collections
import re
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from schemas.nodes import EngineLoad

# metric name -> what it counts; the first of each kind that an engine exposes is used
RUNNING = ("vllm:num_requests_running", "llamacpp:requests_processing")
WAITING = ("vllm:num_requests_waiting", "llamacpp:requests_deferred")
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "llamacpp:kv_cache_usage_ratio")
PREEMPTIONS = ("vllm:num_preemptions_total", "vllm:num_preemptions")
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfINFaN]+)")
BUSY_WINDOW = 600  # polls the busy fraction is taken over


@dataclass
class Reading:
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float | None = None
    preemptions: float | None = None

    @property
    def busy(self) -> bool:
        return self.running + self.waiting > 0


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
        raise ValueError("no request counts in its metrics (vllm:num_requests_running, llamacpp:requests_processing); "
                         "for llama-server, start it with --metrics")
    kv = first(KV_USAGE)
    return Reading(running=first(RUNNING) or 0.0, waiting=first(WAITING) or 0.0,
                   kv_usage=None if kv is None else min(max(kv, 0.0), 1.0), preemptions=first(PREEMPTIONS))


def fetch_metrics(url: str, timeout: float) -> str:
    with urllib.request.urlopen(f"{url}/metrics", timeout=timeout) as r:
        return r.read(4 * 2**20).decode(errors="replace")


class LoadWatch:
    """One engine's latest reading and how busy it has been lately."""

    def __init__(self, label: str, url: str, devices: list[int], timeout: float) -> None:
        self.label, self.url, self.devices, self.timeout = label, url, devices, timeout
        self.reading: Reading | None = None
        self.error = ""
        self.polls: collections.deque[bool] = collections.deque(maxlen=BUSY_WINDOW)
        self.idle_since: float | None = None  # monotonic: when it was last seen turning idle

    async def poll(self) -> Reading | None:
        """Read the engine once; None (and `error` says why) when it did not answer or made no sense."""
        try:
            text = await asyncio.to_thread(fetch_metrics, self.url, self.timeout)
            self.reading, self.error = parse_metrics(text), ""
        except (OSError, urllib.error.URLError, ValueError) as e:
            self.reading, self.error = None, f"{type(e).__name__}: {e}"
            return None
        busy = self.reading.busy
        self.polls.append(busy)
        if busy:
            self.idle_since = None
        elif self.idle_since is None:
            self.idle_since = time.monotonic()
        return self.reading

    def idle_for(self) -> float:
        return 0.0 if self.idle_since is None else time.monotonic() - self.idle_since

    def load(self) -> EngineLoad:
        r = self.reading
        return EngineLoad(engine=self.label, devices=self.devices, running=int(r.running) if r else 0,
                          waiting=int(r.waiting) if r else 0, kv_usage=r.kv_usage if r else None,
                          busy_fraction=sum(self.polls) / len(self.polls) if self.polls else 0.0, error=self.error)
