"""What devices a node has and how much memory each has free: NVML, simulated cards, the CPU."""

from __future__ import annotations

import os

from schemas.nodes import CPU_DEVICE, Device


def nvidia_gpus() -> tuple[list[Device], str]:
    """The node's NVIDIA GPUs, or none and the reason why."""
    try:
        import pynvml
    except ImportError:
        return [], "nvidia-ml-py is not installed: `pip install nvidia-ml-py` (it comes with jetlora)"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return [], f"NVML is not available here ({e}): no NVIDIA driver on this node"
    devices = []
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        mem = pynvml.nvmlDeviceGetMemoryInfo(h)
        try:
            util = pynvml.nvmlDeviceGetUtilizationRates(h).gpu
        except pynvml.NVMLError:
            util = None
        name = pynvml.nvmlDeviceGetName(h)
        devices.append(Device(index=i, kind="cuda", name=name.decode() if isinstance(name, bytes) else name,
                              total_mib=mem.total // 2**20, free_mib=mem.free // 2**20, utilization=util))
    return devices, "" if devices else "NVML found no GPU on this node"


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
    """`24576,81920`: cards of that many MiB, all free (for tests and benchmarks)."""
    return [Device(index=i, kind="cuda", name="simulated GPU", total_mib=int(m), free_mib=int(m))
            for i, m in enumerate(x for x in spec.split(",") if x.strip())]


class DeviceProbe:
    """Reads the node's devices each heartbeat."""

    def __init__(self, offer_cpu: bool = False, simulate: str | None = None) -> None:
        self.offer_cpu, self.simulate = offer_cpu, simulate

    def read(self) -> tuple[list[Device], str]:
        if self.simulate:
            devices, reason = simulated_gpus(self.simulate), ""
        else:
            devices, reason = nvidia_gpus()
        if self.offer_cpu:
            devices.append(cpu_device())
        elif reason:
            reason += "; start the agent with --offer-cpu to train on this node's CPU"
        return devices, reason
