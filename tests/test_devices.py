"""A GPU that NVML cannot read is reported failed and placed on by nobody; the node's other devices go on."""

from __future__ import annotations

import pynvml

from schemas.nodes import Device, Heartbeat
from services.agent.devices import DeviceProbe, _gpu
from services.scheduler.fleet import Fleet


def test_an_unreadable_gpu_is_reported_failed_with_why_not_raised():
    # before nvmlInit every query raises, as for a GPU fallen off the bus: the real library's own error
    dev = _gpu(pynvml, 0)
    assert dev.failed.startswith("NVML cannot read it") and "nvidia-smi" in dev.failed and dev.free_mib == 0


def test_a_node_without_nvidia_says_why_on_every_read_and_initialises_once():
    probe = DeviceProbe(offer_cpu=True)
    first = probe.read()
    assert probe.read()[1] == first[1] and probe._no_nvml is not None  # not tried again on each heartbeat
    assert [d.kind for d in first[0]] == ["cpu"]


def test_nothing_is_placed_on_a_failed_device_and_its_neighbours_still_take_jobs():
    fleet = Fleet()
    devices = [
        Device(index=0, total_mib=0, free_mib=0, failed="NVML cannot read it (GPU is lost)"),
        Device(index=1, total_mib=24576, free_mib=24576),
    ]
    fleet.heard(Heartbeat(node="n1", agent_version="x", devices=devices))
    assert fleet.find(0, "gpu") == ("n1", 1)  # a gpu_mib 0 job takes "any free GPU": not the failed one
    fleet.reserve(("n1", 1), "j")
    assert fleet.find(0, "gpu") is None
