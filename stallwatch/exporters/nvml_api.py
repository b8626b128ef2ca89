"""The NVML the gpu collector calls, as a Protocol that `pynvml` (nvidia-ml-py) and the fake NVML both answer.

The functions keep pynvml's names and parameter names; their types say what the collector relies on.
Handles and event sets are opaque: the collector only hands them back. Constants and the exception
classes are not part of the seam: the fake raises and takes pynvml's own, so both sides share them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeAlias

DeviceHandle: TypeAlias = object  # pynvml's c_nvmlDevice_t, or the fake's handle
EventSet: TypeAlias = object  # pynvml's c_nvmlEventSet_t, or the fake's


class Utilization(Protocol):
    @property
    def gpu(self) -> int: ...

    @property
    def memory(self) -> int: ...


class SampleValue(Protocol):
    @property
    def uiVal(self) -> int: ...  # noqa: N802 - pynvml's field names


class Sample(Protocol):
    @property
    def timeStamp(self) -> int: ...  # noqa: N802

    @property
    def sampleValue(self) -> SampleValue: ...  # noqa: N802


class MemoryInfo(Protocol):
    @property
    def used(self) -> int: ...

    @property
    def total(self) -> int: ...


class ProcessInfo(Protocol):
    @property
    def pid(self) -> int: ...


class EventData(Protocol):
    @property
    def device(self) -> DeviceHandle: ...

    @property
    def eventData(self) -> int: ...  # noqa: N802


class NvmlApi(Protocol):
    """What the gpu collector calls (and benchmarks/gpu_check.py, which exercises each on a GPU node)."""

    def nvmlInit(self) -> None: ...  # noqa: N802 - pynvml's names

    def nvmlShutdown(self) -> None: ...  # noqa: N802

    def nvmlSystemGetDriverVersion(self) -> str: ...  # noqa: N802

    def nvmlDeviceGetCount(self) -> int: ...  # noqa: N802

    def nvmlDeviceGetHandleByIndex(self, index: int) -> DeviceHandle: ...  # noqa: N802

    def nvmlDeviceGetIndex(self, handle: DeviceHandle) -> int: ...  # noqa: N802

    def nvmlDeviceGetUUID(self, handle: DeviceHandle) -> str: ...  # noqa: N802

    def nvmlDeviceGetName(self, handle: DeviceHandle) -> str: ...  # noqa: N802

    def nvmlDeviceGetMaxMigDeviceCount(self, device: DeviceHandle) -> int: ...  # noqa: N802

    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: DeviceHandle, index: int) -> DeviceHandle: ...  # noqa: N802

    def nvmlDeviceGetUtilizationRates(self, handle: DeviceHandle) -> Utilization: ...  # noqa: N802

    def nvmlDeviceGetSamples(  # noqa: N802
        self, device: DeviceHandle, sampling_type: int, timeStamp: int  # noqa: N803
    ) -> tuple[int, Sequence[Sample]]: ...

    def nvmlDeviceGetMemoryInfo(self, handle: DeviceHandle, version: int | None = None) -> MemoryInfo: ...  # noqa: N802

    def nvmlDeviceGetPowerUsage(self, handle: DeviceHandle) -> int: ...  # noqa: N802 - mW

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: DeviceHandle) -> int: ...  # noqa: N802 - mJ

    def nvmlDeviceGetClockInfo(self, handle: DeviceHandle, type: int) -> int: ...  # noqa: N802 - MHz

    def nvmlDeviceGetPcieThroughput(self, device: DeviceHandle, counter: int) -> int: ...  # noqa: N802 - KB/s

    def nvmlDeviceGetTemperature(self, handle: DeviceHandle, sensor: int) -> int: ...  # noqa: N802 - °C

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: DeviceHandle) -> int: ...  # noqa: N802

    def nvmlDeviceGetComputeRunningProcesses(self, handle: DeviceHandle) -> Sequence[ProcessInfo]: ...  # noqa: N802

    def nvmlEventSetCreate(self) -> EventSet: ...  # noqa: N802

    def nvmlDeviceRegisterEvents(  # noqa: N802
        self, handle: DeviceHandle, eventTypes: int, eventSet: EventSet  # noqa: N803
    ) -> None: ...

    def nvmlEventSetWait(self, eventSet: EventSet, timeoutms: int) -> EventData: ...  # noqa: N802, N803

    def nvmlEventSetFree(self, eventSet: EventSet) -> None: ...  # noqa: N802, N803
