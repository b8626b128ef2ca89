"""Exercise every NVML call the gpu collector makes and print what works and what each call costs.

Run it on a GPU node (`python benchmarks/gpu_check.py`); on a machine without a GPU it says so and
exits 0. `--fake N` runs the same calls against stallwatch's fake NVML, to check the script itself.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import pynvml

from stallwatch.exporters.nvml_api import DeviceHandle, NvmlApi


def calls(nvml: NvmlApi, handle: DeviceHandle) -> list[tuple[str, Callable[[], object]]]:
    samples = pynvml.NVML_GPU_UTILIZATION_SAMPLES
    rx, tx = pynvml.NVML_PCIE_UTIL_RX_BYTES, pynvml.NVML_PCIE_UTIL_TX_BYTES
    return [
        ("nvmlDeviceGetUUID", lambda: nvml.nvmlDeviceGetUUID(handle)),
        ("nvmlDeviceGetName", lambda: nvml.nvmlDeviceGetName(handle)),
        ("nvmlDeviceGetUtilizationRates", lambda: nvml.nvmlDeviceGetUtilizationRates(handle).gpu),
        ("nvmlDeviceGetSamples", lambda: len(nvml.nvmlDeviceGetSamples(handle, samples, 0)[1])),
        ("nvmlDeviceGetMemoryInfo", lambda: nvml.nvmlDeviceGetMemoryInfo(handle).used),
        ("nvmlDeviceGetPowerUsage", lambda: nvml.nvmlDeviceGetPowerUsage(handle)),
        ("nvmlDeviceGetTotalEnergyConsumption", lambda: nvml.nvmlDeviceGetTotalEnergyConsumption(handle)),
        ("nvmlDeviceGetClockInfo(SM)", lambda: nvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)),
        ("nvmlDeviceGetClockInfo(MEM)", lambda: nvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_MEM)),
        ("nvmlDeviceGetTemperature", lambda: nvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)),
        ("nvmlDeviceGetCurrentClocksEventReasons", lambda: hex(nvml.nvmlDeviceGetCurrentClocksEventReasons(handle))),
        ("nvmlDeviceGetComputeRunningProcesses", lambda: len(nvml.nvmlDeviceGetComputeRunningProcesses(handle))),
        ("nvmlDeviceGetPcieThroughput(RX)", lambda: nvml.nvmlDeviceGetPcieThroughput(handle, rx)),
        ("nvmlDeviceGetPcieThroughput(TX)", lambda: nvml.nvmlDeviceGetPcieThroughput(handle, tx)),
        ("nvmlDeviceGetMaxMigDeviceCount", unless_mig_off(lambda: nvml.nvmlDeviceGetMaxMigDeviceCount(handle))),
        ("nvmlDeviceGetMigDeviceHandleByIndex(0) UUID", unless_mig_off(
            lambda: nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, 0)))),
    ]


def unless_mig_off(call: Callable[[], object]) -> Callable[[], object]:
    """A GPU without MIG devices answers the MIG calls with an error: an expected result, not a failure."""
    def answer() -> object:
        try:
            return call()
        except pynvml.NVMLError as error:
            return f"{type(error).__name__} (no MIG devices: expected)"

    return answer


def time_call(call: Callable[[], object], repeat: int) -> tuple[str, float]:
    durations, shown = [], ""
    for _ in range(repeat):
        start = time.perf_counter()
        try:
            shown = str(call())
        except Exception as error:  # the point is to report what fails
            return f"FAILS: {type(error).__name__}: {error}", float("nan")
        durations.append(time.perf_counter() - start)
    return shown, statistics.median(durations) * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fake", type=int, default=0, metavar="N", help="use N fake GPUs instead of NVML")
    parser.add_argument("--repeat", type=int, default=5, help="calls per function (default: %(default)s)")
    options = parser.parse_args()
    nvml: NvmlApi
    if options.fake:
        from stallwatch.exporters.nvml_fake import FakeGpu, FakeNVML

        nvml = FakeNVML([FakeGpu() for _ in range(options.fake)])
    else:
        nvml = pynvml
    try:
        nvml.nvmlInit()
        count = nvml.nvmlDeviceGetCount()
    except pynvml.NVMLError as error:
        print(f"no GPU: NVML says: {error}")
        return 0
    if count == 0:
        print("no GPU: NVML found no device")
        return 0
    print(f"driver {nvml.nvmlSystemGetDriverVersion()}, {count} GPU(s)")
    event_set = nvml.nvmlEventSetCreate()
    for index in range(count):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        print(f"\nGPU {index}: {nvml.nvmlDeviceGetName(handle)}")
        print(f"{'call':42} {'median µs':>10}  result")
        for name, call in calls(nvml, handle):
            shown, micros = time_call(call, options.repeat)
            print(f"{name:42} {micros:10.1f}  {shown[:60]}")
        shown, micros = time_call(
            functools.partial(nvml.nvmlDeviceRegisterEvents, handle, pynvml.nvmlEventTypeXidCriticalError, event_set), 1
        )
        print(f"{'nvmlDeviceRegisterEvents(Xid)':42} {micros:10.1f}  {shown[:60]}")

    def wait() -> str:
        try:
            return str(nvml.nvmlEventSetWait(event_set, 100).eventData)
        except pynvml.NVMLError as error:
            if getattr(error, "value", None) != pynvml.NVML_ERROR_TIMEOUT:
                raise
            return "timeout (no XID pending: expected)"

    shown, micros = time_call(wait, 1)
    print(f"{'nvmlEventSetWait(100 ms)':42} {micros:10.1f}  {shown[:60]}")
    nvml.nvmlEventSetFree(event_set)
    nvml.nvmlShutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
