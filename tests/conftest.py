"""Fixtures: a real nats-server (the project's own launcher), services in-process or as subprocesses."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import inspect
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import nats
import pytest
from nats.js.errors import NoKeysError, NotFoundError, ServerError

from nats.js.api import DeliverPolicy

from schemas import names, nats_subjects
from schemas.events import Progress, StateChange
from schemas.jobs import SubmitReply
from schemas.job_status import JobList, JobListQuery, JobQuery, JobReply
from schemas.nodes import NodeList
from services import bus
from services.embedded import EmbeddedNats
from services.scheduler.core import SchedulerConfig
from services.scheduler.fence import TERM_KEY
from tests.harness.hang_dump import bounded
from schemas.job_records import LAYOUT

ROOT = Path(__file__).resolve().parents[1]
# One torch thread for every trainer the tests start (agents' subprocesses inherit it) and for torch in this
# process: two trainers' threads fighting over 2 cores made each ten times slower. A test that measures threads sets
# its own (torch.set_num_threads).
os.environ.setdefault("OMP_NUM_THREADS", "1")
HOLD_TRAINER = f"{sys.executable} {ROOT / 'tests' / 'programs' / 'hold_trainer.py'}"
HOLD_GROUP = f"{sys.executable} {ROOT / 'tests' / 'programs' / 'hold_group.py'}"  # its co-training groups' stand-in


_SESSION: dict[str, int] = {}


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto`: two workers per core (at most 16). A test mostly waits on the processes it starts and on windows
    of seconds (a heartbeat missed, a session silent), so one worker per core left the cores half idle (18 CPU-minutes
    in a 16-minute run on 2 cores)."""
    return min(16, 2 * len(os.sched_getaffinity(0)))


def pytest_configure(config) -> None:
    from tests.harness import hang_dump

    hang_dump.install()  # a timed-out test's asyncio tasks, with what each awaits


def pytest_sessionfinish(session, exitstatus) -> None:
    _SESSION["status"] = int(exitstatus)


def pytest_unconfigure(config) -> None:
    """A thread a test left running (a client retrying a dead gateway for minutes, a wait with no timeout) would keep
    the interpreter from exiting after the summary, and CI from ever ending. A watchdog, a daemon thread that dies
    with a normal exit, names each thread still running 30 s later with its stack and exits with the session's
    status."""
    import threading
    import traceback

    worker = hasattr(config, "workerinput")  # an xdist worker's main thread serves the controller until it says end

    def watchdog() -> None:
        time.sleep(30)  # a normal exit ends this thread long before
        frames, me = sys._current_frames(), threading.current_thread()
        left = [t for t in threading.enumerate() if t is not me and not t.daemon and t.ident in frames]
        if worker:
            left = [t for t in left if t is not threading.main_thread()]
            if not left:
                return  # waiting for the controller's word, as it should
        for t in left:
            stack = "".join(traceback.format_stack(frames[t.ident]))
            print(f"\nthread {t.name!r} kept the tests' process from exiting:\n{stack}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(_SESSION.get("status", 1))

    threading.Thread(target=watchdog, name="exit-watchdog", daemon=True).start()


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory):
    server = EmbeddedNats(store_dir=tmp_path_factory.mktemp("nats")).start()
    yield server
    server.stop()


async def reset_resources(nc) -> None:
    """Each test starts from empty jetlora streams and buckets on the shared server."""
    js = nc.jetstream()
    for stream in (
        names.JOBS_STREAM,
        nats_subjects.kv(names.JOBS_KV).stream,
        nats_subjects.kv(names.LEASE_KV).stream,
        nats_subjects.kv(names.TRAINER_LEASES_KV).stream,  # one test's trainer leases are none of the next's
        nats_subjects.kv(names.ADAPTERS_KV).stream,
        names.JOB_INDEX_STREAM,
        nats_subjects.kv(names.IDEMPOTENCY_KV).stream,
        nats_subjects.objects(names.ARTIFACTS_BUCKET).stream,
        nats_subjects.objects(names.DATASETS_BUCKET).stream,
        nats_subjects.kv(names.EVALS_KV).stream,  # one test's evals are none of the next's
        nats_subjects.kv(names.GATEWAY_JOBS_KV).stream,
        nats_subjects.kv(names.TINKER_KV).stream,  # one test's Tinker sessions are none of the next's
        nats_subjects.kv(names.TINKER_FUTURES_KV).stream,
        nats_subjects.objects(names.TINKER_RESULTS_BUCKET).stream,
        nats_subjects.kv(names.TENANTS_KV).stream,  # one test's tenants' quotas are none of the next's
    ):
        try:
            await js.delete_stream(stream)
        except NotFoundError:
            pass
    # a busy server may still be removing the deleted streams' files: "error creating store for stream"
    await retrying(lambda: bus.ensure_resources(nc), ServerError)


async def retrying(attempt, errors, timeout: float = 30.0, interval: float = 0.2):
    """await attempt() until it does not raise one of `errors`; past `timeout` the last error is raised."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await attempt()
        except errors:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(interval)


@pytest.fixture
async def nc(nats_server):
    conn = await nats.connect(nats_server.url)
    await reset_resources(conn)
    yield conn
    await bounded(conn.drain(), 60, "the test's NATS connection's drain")


class InProcess:
    """Services run as tasks on the test's loop, each with its own connection and stop event."""

    def __init__(self, url: str):
        self.url = url
        self.running: list[tuple[asyncio.Event, asyncio.Task, object]] = []

    async def start(self, factory):
        conn = await nats.connect(self.url)
        stop = asyncio.Event()
        service = factory(conn)
        task = asyncio.create_task(service.run(stop))
        self.running.append((stop, task, conn))
        return service, stop, task

    async def stop(self, stop, task, hard: bool = False):
        for entry in list(self.running):
            if entry[0] is stop:
                self.running.remove(entry)
                if hard:
                    task.cancel()
                else:
                    stop.set()
                try:
                    await asyncio.wait_for(task, 10)
                except (asyncio.CancelledError, Exception):
                    pass
                await bounded(entry[2].close(), 30, "an in-process service's NATS connection's close")

    async def close(self):
        for stop, task, conn in list(self.running):
            await self.stop(stop, task)


@pytest.fixture
async def services(nats_server, nc):
    s = InProcess(nats_server.url)
    yield s
    await s.close()


# co_train off: the stand-in trainer (hold_trainer.py) trains alone; tests/test_co_train_stack.py groups real ones
STACK_CONFIG = SchedulerConfig(co_train="off", heartbeat_interval=0.25, misses=3, assign_timeout=2.0)


@pytest.fixture
async def stack(services):
    """A scheduler (STACK_CONFIG: heartbeats every 0.25 s, 3 missed mean gone), an artifact service and the adapter
    registry, in-process."""
    return await start_stack(services, STACK_CONFIG)


async def start_stack(services, cfg: SchedulerConfig):
    """The stack fixture's services, the scheduler configured as `cfg`; the scheduler once it leads."""
    from services.artifacts.service import ArtifactService
    from services.registry.service import RegistryService
    from services.scheduler.service import Scheduler

    sched, *_ = await services.start(lambda c: Scheduler(c, cfg))
    await services.start(lambda c: ArtifactService(c))
    await services.start(lambda c: RegistryService(c))
    await asyncio.wait_for(sched.leading.wait(), 10)
    return sched


class Agents:
    """Agents as real subprocesses (`jetlora agent`), so they can be killed with SIGKILL."""

    def __init__(self, url: str, tmp: Path):
        self.url, self.tmp = url, tmp
        self.procs: dict[str, subprocess.Popen] = {}

    def start(
        self,
        node: str,
        gpus: str | None = "24576",
        offer_cpu: bool = False,
        trainer: str | None = HOLD_TRAINER,
        hold_s: float = 0.5,
        interval: float = 0.25,
        env: dict | None = None,
        bus_flags: tuple[str, ...] = (),
        extra: tuple[str, ...] = (),
    ) -> subprocess.Popen:
        cmd = [
            sys.executable,
            "-m",
            "services.cli",
            "agent",
            "--nats",
            self.url,
            "--node",
            node,
            "--work-dir",
            str(self.tmp / node),
            "--heartbeat-interval",
            str(interval),
            *bus_flags,
            *extra,
        ]
        if gpus:
            cmd += ["--simulate-gpus", gpus]
        if offer_cpu:
            cmd += ["--offer-cpu"]
        if trainer:
            cmd += ["--trainer-command", trainer]
        if trainer == HOLD_TRAINER:  # its co-training groups' stand-in beside it
            cmd += ["--group-command", HOLD_GROUP]
        proc_env = {**os.environ, "HOLD_S": str(hold_s), "PYTHONPATH": str(ROOT), **(env or {})}
        log = open(self.tmp / f"agent-{node}.log", "ab")
        proc = subprocess.Popen(cmd, cwd=ROOT, env=proc_env, stdout=log, stderr=subprocess.STDOUT)
        self.procs[node] = proc
        return proc

    def kill(self, node: str) -> None:
        self.procs[node].send_signal(signal.SIGKILL)
        self.procs[node].wait()

    def terminate(self, node: str, timeout: float = 15) -> int:
        proc = self.procs[node]
        proc.send_signal(signal.SIGTERM)
        return proc.wait(timeout)

    def log(self, node: str) -> str:
        return (self.tmp / f"agent-{node}.log").read_text(errors="replace")

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture
def trainer_signals():
    """For a test that installs the trainer's SIGUSR1/SIGUSR2 handlers (trainer.signals.Signals) in this process:
    pytest's own are back afterwards."""
    before = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGUSR2)}
    yield
    for s, handler in before.items():
        signal.signal(s, handler)


@pytest.fixture
def agents(nats_server, tmp_path):
    a = Agents(nats_server.url, tmp_path)
    yield a
    a.close()


# --- small clients the tests share ---------------------------------------------------------------
async def submit(nc, request) -> SubmitReply:
    payload = request if isinstance(request, (bytes, bytearray)) else msgspec.json.encode(request)
    return await bus.request(nc, names.SUBMIT, payload, SubmitReply)


async def get_job(nc, job: str):
    reply = await bus.request(nc, names.GET_JOB, JobQuery(job), JobReply)
    return reply.job


async def at_step(nc, job: str, step: int) -> bool:
    """Whether the job reached `step`; a job that ended before it fails the test at once, with its message."""
    status = await get_job(nc, job)
    if status.step >= step:
        return True
    assert status.state not in ("failed", "succeeded", "cancelled"), f"the job ended before step {step}: {status}"
    return False


async def list_jobs(nc, **query):
    return (await bus.request(nc, names.LIST_JOBS, JobListQuery(**query), JobList)).jobs


async def list_nodes(nc):
    return (await bus.request(nc, names.LIST_NODES, b"{}", NodeList)).nodes


async def wait_for(predicate, timeout: float = 20.0, interval: float = 0.05, what: str = "condition", progress=None):
    """Poll a predicate (plain or async) until it returns something truthy. With `progress` (plain or async, a value
    that changes as the work moves on), the deadline follows progress: `timeout` is how long nothing may move."""
    moved, mark = time.monotonic(), None
    last = None
    while True:
        last = predicate()
        if inspect.isawaitable(last):
            last = await last
        if last:
            return last
        if progress is not None:
            now = progress()
            now = await now if inspect.isawaitable(now) else now
            if now != mark:
                moved, mark = time.monotonic(), now
        if time.monotonic() - moved > timeout:
            still = f" (nothing moved: {mark!r})" if progress is not None else ""
            raise AssertionError(f"timed out after {timeout}s waiting for {what}{still}; last: {last!r}")
        await asyncio.sleep(interval)


async def wait_state(nc, job: str, states, timeout: float = 30.0):
    """Until the job is in one of `states`. The deadline follows progress: `timeout` is how long the job may go
    without moving (its state, step or attempt unchanged), so a job training on a loaded machine gets the time its
    steps take and a stuck one fails as soon as on a quiet one; a timeout says where it was last seen."""
    states = {states} if isinstance(states, str) else set(states)
    seen: list[str] = []
    moved: list = [None, time.monotonic()]  # the last (state, step, attempt) seen, and when it last changed

    async def check():
        try:
            j = await get_job(nc, job)
        except bus.RequestError:  # a scheduler between lives: ask again
            return None
        seen[:] = [f"{j.state} at step {j.step}/{j.steps} on {j.node} (attempt {j.attempt}): {j.message}"]
        if (j.state, j.step, j.attempt) != moved[0]:
            moved[:] = [(j.state, j.step, j.attempt), time.monotonic()]
        return j if j.state in states else None

    while not (found := await check()):
        if time.monotonic() - moved[1] > timeout:
            where = seen[0] if seen else "never seen"
            raise AssertionError(f"job {job} not in {states}: nothing moved for {timeout}s; it was last {where}")
        await asyncio.sleep(0.05)
    return found


async def wait_nodes(nc, count: int, timeout: float = 20.0):
    async def check():
        try:
            nodes = [n for n in await list_nodes(nc) if n.alive]
        except bus.RequestError:
            return None
        return nodes if len(nodes) >= count else None

    return await wait_for(check, timeout, what=f"{count} live nodes")


async def stream_events(nc, subject: str, decoder: msgspec.json.Decoder, timeout: float = 30.0) -> list:
    """Every event on `subject` in the JOBS stream, replayed whole: the stream's own count says when it is all read.
    JetStream requests that time out (a cluster electing a new leader) are tried again until `timeout`."""
    return await retrying(
        lambda: _replay(nc, subject, decoder), (nats.errors.TimeoutError, asyncio.TimeoutError), timeout
    )


async def _replay(nc, subject: str, decoder: msgspec.json.Decoder) -> list:
    js = nc.jetstream()
    info = await js.stream_info(names.JOBS_STREAM, subjects_filter=subject)
    if not sum((info.state.subjects or {}).values()):
        return []
    sub = await js.subscribe(subject, stream=names.JOBS_STREAM, ordered_consumer=True, deliver_policy=DeliverPolicy.ALL)
    out = []
    try:
        while True:
            msg = await sub.next_msg(timeout=10)
            out.append(decoder.decode(msg.data))
            if msg.metadata.num_pending == 0:
                return out
    finally:
        await sub.unsubscribe()


async def states_of(nc, job_id: str) -> list[StateChange]:
    return await stream_events(nc, names.job(job_id).state, msgspec.json.Decoder(StateChange))


async def progress_steps(nc, job_id: str) -> list[int]:
    return [p.step for p in await stream_events(nc, names.job(job_id).progress, msgspec.json.Decoder(Progress))]


async def kv_keys(nc) -> list[str]:
    """The jobs bucket's keys of jobs (the layout mark and the term a scheduler writes at start are none)."""
    kv = await nc.jetstream().key_value(names.JOBS_KV)
    try:
        return [k for k in await kv.keys() if k not in (LAYOUT, TERM_KEY)]
    except NoKeysError:  # nats-py's word for an empty bucket
        return []


async def object_names(nc) -> list[str]:
    obs = await nc.jetstream().object_store(names.ARTIFACTS_BUCKET)
    try:
        return [o.name for o in await obs.list(ignore_deletes=True)]
    except NotFoundError:  # nats-py's word for an empty bucket
        return []


@contextlib.asynccontextmanager
async def beating(nc, *nodes: str, interval: float = 0.2):
    """Heartbeats of `nodes` (no devices), as their agents send them, while the block runs: what the registry (and
    the scheduler) hear of nodes that a test stands in for."""
    from schemas.nodes import Heartbeat

    enc = msgspec.json.Encoder()

    async def beat() -> None:
        while True:
            for node in nodes:
                beat = Heartbeat(node=node, agent_version="test", devices=[], interval_s=interval, sent_at=time.time())
                await nc.publish(names.node(node).heartbeat, enc.encode(beat))
            await asyncio.sleep(interval)  # the heartbeat's own period, as an agent's

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def random_file(path, mib: int):
    with open(path, "wb") as f:
        for _ in range(mib):
            f.write(os.urandom(1 << 20))
    return path


def tinymodel():
    """deploy/demo/tinymodel.py: builds a small model and tokenizer locally (a script of the demo, not a package)."""
    spec = importlib.util.spec_from_file_location("tinymodel", ROOT / "deploy" / "demo" / "tinymodel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def run_held_job(
    nc, agents: "Agents", node: str = "n1", hold_s: float = 5.0, timeout: float = 30.0, **request
) -> str:
    """Start an agent whose trainer holds for `hold_s`, submit a job to it, return once it runs."""
    from schemas.jobs import Accepted
    from tests.qa import pairs

    agents.start(node, gpus="4096", interval=0.25, hold_s=hold_s)
    await wait_nodes(nc, 1, timeout=timeout)
    reply = await submit(nc, {"model": "tiny", "base_dir": "/models/tiny", "data": pairs(2), **request})
    assert isinstance(reply, Accepted), reply
    await wait_state(nc, reply.job, "running", timeout=timeout)
    return reply.job


async def answering(nc, subject: str, timeout: float = 30.0) -> None:
    """Until a service answers requests on `subject` (any reply will do)."""

    async def answers():
        try:
            return await bus.request(nc, subject, b"{}", msgspec.Raw, timeout=1)
        except bus.RequestError:
            return None

    await wait_for(answers, timeout=timeout, what=f"a service answering {subject}")


def spec_for(model_dir, tmp_path, **train):
    """The trainer's job file for a short run on the tiny model."""
    from schemas.events import TrainerSpec
    from schemas.jobs import JobRequest
    from tests.qa import pairs

    t = {
        "max_steps": 40,
        "learning_rate": 0.01,
        "batch_size": 1,
        "max_seq_length": 128,
        "warmup_steps": 0,
        "logging_steps": 1,
    }
    t.update(train)
    req = msgspec.convert({"model": "tiny", "base_dir": str(model_dir), "data": pairs(), "train": t}, JobRequest)
    return TrainerSpec(job="t", attempt=1, request=req, out_dir=str(tmp_path / "out"))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A 2-layer Llama with a locally trained BPE tokenizer, saved as safetensors."""
    from tests.qa import QA_PAIRS

    build = tinymodel().build

    texts = [f"{q} {a}" for q, a in QA_PAIRS]
    return build(tmp_path_factory.mktemp("tiny") / "model", texts, hidden=64, layers=2, vocab_size=400)


async def running_on(nc, job: str, node: str = "n1", attempt: int = 1, tenant: str | None = None) -> None:
    """A job record that says `node` runs the job's attempt `attempt`: what the artifact service checks an
    upload against (written straight into the jobs bucket, as the scheduler would)."""
    from schemas.jobs import JobRequest
    from schemas.job_status import JobStatus, StoredRequest
    from services.scheduler.store import JobStore

    store = JobStore(nc.jetstream(), await nc.jetstream().key_value(names.JOBS_KV))
    request = JobRequest(model="tiny", base_dir="/models/tiny")
    await store.add(StoredRequest(id=job, request=request, created=time.time(), tenant=tenant))
    await store.write_status(job, JobStatus(state="running", node=node, attempt=attempt), 0)


def slowed(write, seconds: float = 0.02):
    """A store write that takes `seconds` longer: the slow store the race tests run the scheduler against."""

    async def slow_write(*a, **kw):
        await asyncio.sleep(seconds)  # the fault itself, not a wait for something
        return await write(*a, **kw)

    return slow_write
