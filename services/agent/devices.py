"""What devices a node has and how much memory each has free: NVML, simulated cards, the CPU."""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor

from schemas.nodes import CPU_DEVICE, Device


def nvml_init() -> str:
    """Initialise NVML once per process; '' when it works, else why not."""
    try:
        import pynvml
    except ImportError:
        return "nvidia-ml-py is not installed: `pip install nvidia-ml-py` (it comes with jetlora)"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return f"NVML is not available here ({e}): no NVIDIA driver on this node"
    return ""


def nvidia_gpus() -> tuple[list[Device], str]:
    """The node's NVIDIA GPUs (NVML initialised), or none and the reason why. A GPU that cannot be read is
    reported failed, with why; the others are reported as they are."""
    import pynvml

    try:
        count = pynvml.nvmlDeviceGetCount()
    except pynvml.NVMLError as e:
        return [], f"NVML could not count the GPUs ({e})"
    devices = [_gpu(pynvml, i) for i in range(count)]
    return devices, "" if devices else "NVML found no GPU on this node"


def _gpu(pynvml, index: int) -> Device:
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
        mem = pynvml.nvmlDeviceGetMemoryInfo(h)
        name = pynvml.nvmlDeviceGetName(h)
    except pynvml.NVMLError as e:
        return Device(
            index=index,
            kind="cuda",
            name="unreadable GPU",
            total_mib=0,
            free_mib=0,
            failed=f"NVML cannot read it ({e}): check `nvidia-smi` and the node's kernel log (Xid)",
        )
    try:
        util = pynvml.nvmlDeviceGetUtilizationRates(h).gpu
    except pynvml.NVMLError:
        util = None
    return Device(
        index=index,
        kind="cuda",
        name=name.decode() if isinstance(name, bytes) else name,
        total_mib=mem.total // 2**20,
        free_mib=mem.free // 2**20,
        utilization=util,
    )


def memory_mib() -> tuple[int, int]:
    """Total and available RAM in MiB."""
    info = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                info[key] = int(value.split()[0]) // 1024
        return info["MemTotal"], info.get("MemAvailable", info["MemFree"])
    except (OSError, KeyError, ValueError):
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
        return total, total


def cpu_device() -> Device:
    total, free = memory_mib()
    return Device(index=CPU_DEVICE, kind="cpu", name=f"CPU ({os.cpu_count()} cores)", total_mib=total, free_mib=free)


def simulated_gpus(spec: str) -> list[Device]:
    """`24576,81920/8000`: cards of that many MiB, free unless `/FREE` says how much is (tests and benchmarks)."""
    cards = [x.strip().partition("/") for x in spec.split(",") if x.strip()]
    return [
        Device(index=i, kind="cuda", name="simulated GPU", total_mib=int(total), free_mib=int(free or total))
        for i, (total, _, free) in enumerate(cards)
    ]


class DeviceProbe:
    """Reads the node's devices each heartbeat: read() blocking, read_async() from the agent's event loop on a
    thread of the probe's own, so a heartbeat never queues behind other work in asyncio's shared pool (an engine
    call, a file copy); close() at the agent's end."""

    def __init__(self, offer_cpu: bool = False, simulate: str | None = None) -> None:
        self.offer_cpu, self.simulate = offer_cpu, simulate
        self._no_nvml: str | None = None  # NVML is initialised on the first read, once
        self._executor: ThreadPoolExecutor | None = None  # made on the first read_async()

    async def read_async(self) -> tuple[list[Device], str]:
        """read() on the probe's own thread ("device-probe"): NVML may block, and the loop must not."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="device-probe")
        return await asyncio.get_running_loop().run_in_executor(self._executor, self.read)

    def close(self) -> None:
        """Let the probe's thread go (a read under way finishes on it; a later read_async() makes a new one)."""
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)

    def read(self) -> tuple[list[Device], str]:
        """The devices now (blocking: NVML calls; from the event loop, await read_async() instead)."""
        if self.simulate:
            devices, reason = simulated_gpus(self.simulate), ""
        else:
            if self._no_nvml is None:
                self._no_nvml = nvml_init()
            devices, reason = nvidia_gpus() if not self._no_nvml else ([], self._no_nvml)
        if self.offer_cpu:
            devices.append(cpu_device())
        elif reason:
            reason += "; start the agent with --offer-cpu to train on this node's CPU"
        return devices, reason
