"""Session trainers driven directly over their stdin and stdout, as the agent drives them, for bench/tinker_api.py:
K sessions as members of one session group's process (`python -m trainer.co_train`, MemberCall lines, trainer/
session_group.py), or K session processes of their own (`python -m trainer JOB.json`, SessionLine lines). Each
client is a thread that sends a forward_backward and an optim_step (as the tinker client sends them, without
waiting between) and waits for both answers. What each costs: the time per step, and the process(es)' peak
resident memory (VmHWM)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import msgspec

from schemas.events import GroupControl, TrainerSpec
from schemas.jobs import JobRequest
from schemas.sessions import MemberCall, SessionCall, SessionLine

ROOT = Path(__file__).resolve().parents[1]
_encode = msgspec.json.Encoder()


def session_spec(model_dir: Path, out: Path, job: str, seed: int) -> TrainerSpec:
    request = msgspec.convert(
        {"model": "tiny", "base_dir": str(model_dir), "train": {"method": "session"},
         "session": {"rank": 8, "seed": seed, "train_unembed": False, "idle_s": 3600}, "accelerator": "cpu"},
        JobRequest,
    )  # fmt: skip
    return TrainerSpec(job=job, attempt=1, request=request, out_dir=str(out / job))


class Process:
    """One trainer process: lines in, and a thread that hands each answer to whoever waits for its number."""

    def __init__(self, argv: list[str], threads: int, env: dict | None = None) -> None:
        full_env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(threads),
                    **(env or {})}  # fmt: skip
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=full_env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.waiting: dict[tuple[str, int], Future] = {}
        self.started: dict[str, threading.Event] = {}
        self.lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            try:
                line = msgspec.json.decode(raw)
            except msgspec.DecodeError:
                continue
            if not isinstance(line, dict):
                continue
            event = line.get("event", line)  # a group's lines carry the job's event; a session's are it
            if isinstance(event, dict) and event.get("type") == "started":
                self.started.setdefault(line.get("job", ""), threading.Event()).set()
            if line.get("type") in ("answer", "member_answer"):
                with self.lock:
                    waiter = self.waiting.pop((line.get("job", ""), line["id"]), None)
                if waiter is not None:
                    waiter.set_result(line["reply"])

    def send(self, raw: bytes, job: str, number: int) -> Future:
        waiter: Future = Future()
        with self.lock:
            self.waiting[(job, number)] = waiter
        assert self.proc.stdin is not None
        self.proc.stdin.write(raw)
        self.proc.stdin.flush()
        return waiter

    def wait_started(self, job: str, timeout: float = 120) -> None:
        if not self.started.setdefault(job, threading.Event()).wait(timeout):
            raise SystemExit(f"session {job} did not start within {timeout:.0f} s")

    def peak_mib(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return 0.0

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Sessions:
    """K sessions: in one group's process (`shared`), or each in a process of its own; `step(calls)` runs one
    forward_backward + optim_step of every session at once, each from a thread of its own, and returns each
    session's time for it."""

    def __init__(self, k: int, shared: bool, model_dir: Path, out: Path, threads: int, batch: bool = True) -> None:
        self.k, self.shared, self.jobs = k, shared, [f"s{i}" for i in range(k)]
        self.numbers = [0] * k
        self.pool = ThreadPoolExecutor(k)
        specs = [session_spec(model_dir, out, job, seed=i) for i, job in enumerate(self.jobs)]
        if shared:
            env = {"JETLORA_SESSION_BATCH": "on" if batch else "off"}
            self.procs = [Process([sys.executable, "-m", "trainer.co_train"], threads, env)]
            for spec in specs:
                line = GroupControl(action="add", job=spec.job, spec=spec, attempt=1)
                self.procs[0].proc.stdin.write(_encode.encode(line) + b"\n")  # type: ignore[union-attr]
            self.procs[0].proc.stdin.flush()  # type: ignore[union-attr]
        else:
            self.procs = []
            out.mkdir(parents=True, exist_ok=True)
            for spec in specs:
                path = out / f"{spec.job}.json"
                path.write_bytes(msgspec.json.encode(spec))
                self.procs.append(Process([sys.executable, "-m", "trainer", str(path)], threads))
        for i, job in enumerate(self.jobs):
            self.procs[0 if shared else i].wait_started(job if shared else "")

    def _call(self, i: int, call: SessionCall) -> Future:
        self.numbers[i] += 1
        number, job = self.numbers[i], self.jobs[i]
        if self.shared:
            raw = MemberCall(job=job, attempt=1, id=number, call=call)
            return self.procs[0].send(_encode.encode(raw) + b"\n", job, number)
        return self.procs[i].send(_encode.encode(SessionLine(id=number, call=call)) + b"\n", "", number)

    def _client_step(self, i: int, calls: tuple[SessionCall, SessionCall]) -> float:
        start = time.perf_counter()
        answers = [self._call(i, call) for call in calls]
        for answer in answers:
            reply = answer.result(timeout=300)
            if reply.get("type") == "error":
                raise SystemExit(f"session {self.jobs[i]} refused a call: {reply}")
        return time.perf_counter() - start

    def step(self, calls: tuple[SessionCall, SessionCall]) -> list[float]:
        return list(self.pool.map(lambda i: self._client_step(i, calls), range(self.k)))

    def peak_mib(self) -> float:
        return sum(p.peak_mib() for p in self.procs)

    def close(self) -> None:
        for p in self.procs:
            p.close()
        self.pool.shutdown()
