"""A fake NVML that answers like `pynvml`, for machines without a GPU.

It answers the NVML Protocol the GPU collector calls (nvml_api.py: pynvml's function names and
signatures), with the same exception classes (pynvml's own `NVMLError_*`, raised through
`pynvml.NVMLError(code)`), the same return types (pynvml's ctypes structs) and the same units:
milliwatts, millijoules, bytes, MHz, KB/s, microsecond wall-clock timestamps. Callers take
constants and exception classes from pynvml itself, as with the real library.

Each scripted GPU follows a utilization timeline (percent as a function of seconds since
`nvmlInit`), can be lost at a given moment, can refuse some functions with NotSupported, and can
raise XID events. The driver can be unloaded mid-run.

The driver's utilization samples (`nvmlDeviceGetSamples`) come on an ideal grid, each the
utilization at its instant, unless a `DriverSampling` is given: then they look like a real driver's,
stamped off the nominal grid, some missing, now and then a stretch with none, and each the mean
utilization since the sample before it (the busy time the driver accumulated over its real period).
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
import struct
import time
import uuid as uuidlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import pynvml

from stallwatch.exporters.nvml_api import DeviceHandle, EventSet

Timeline = Callable[[float], float]
SAMPLE_PERIOD_S = 1 / 6  # the driver's utilization sample period (the real one's is 1/6 to 1 s)


def constant(percent: float) -> Timeline:
    return lambda t: percent


def steps(*segments: tuple[float, float], then: float = 100.0) -> Timeline:
    """Utilization by segments of (duration seconds, percent); `then` afterwards."""

    def timeline(t: float) -> float:
        start = 0.0
        for duration, percent in segments:
            if t < start + duration:
                return percent
            start += duration
        return then

    return timeline


def training(step_seconds: float = 1.0, stall_seconds: float = 0.2) -> Timeline:
    """A training loop: busy for a step, then idle for a stall, repeating."""
    period = step_seconds + stall_seconds
    return lambda t: 0.0 if t % period >= step_seconds else 97.0


class ComputeTrace:
    """Utilization that follows a real process: busy inside the compute spans it appends to a file.

    The file holds little-endian float64 pairs (start, end) of wall-clock seconds, appended by the
    emulated training job (`append_span`); the fake GPU is at 97 % inside a span and idle outside.
    """

    RECORD = struct.Struct("<dd")

    def __init__(self, path: Path | None) -> None:
        self._path = path
        self._offset = 0
        self._starts: list[float] = []
        self._ends: list[float] = []

    @classmethod
    def of_spans(cls, spans: Iterable[tuple[float, float]]) -> ComputeTrace:
        """A trace of known (start, end) spans in time order, with no file behind it."""
        trace = cls(None)
        for start, end in spans:
            trace._starts.append(start)
            trace._ends.append(end)
        return trace

    @staticmethod
    def append_span(path: Path, start: float, end: float) -> None:
        with path.open("ab") as handle:
            handle.write(ComputeTrace.RECORD.pack(start, end))

    def _refresh(self) -> None:
        if self._path is None:
            return
        try:
            with self._path.open("rb") as handle:
                handle.seek(self._offset)
                data = handle.read()
        except FileNotFoundError:
            return
        whole = len(data) - len(data) % self.RECORD.size
        for start, end in self.RECORD.iter_unpack(data[:whole]):
            self._starts.append(start)
            self._ends.append(end)
        self._offset += whole

    def percent_at(self, wall_seconds: float) -> float:
        self._refresh()
        index = bisect.bisect_right(self._starts, wall_seconds) - 1
        return 97.0 if index >= 0 and wall_seconds < self._ends[index] else 0.0

    def mean_percent(self, begin: float, end: float) -> float:
        """Mean utilization over (begin, end] of wall-clock seconds: 97 % times the busy share."""
        self._refresh()
        if end <= begin:
            return self.percent_at(end)
        first = bisect.bisect_right(self._ends, begin)
        last = bisect.bisect_left(self._starts, end)
        busy = sum(max(0.0, min(e, end) - max(s, begin)) for s, e in zip(self._starts[first:last],
                                                                        self._ends[first:last], strict=True))
        return 97.0 * busy / (end - begin)


@dataclass(frozen=True)
class DriverSampling:
    """Utilization samples as a real driver's look: each stamped up to `jitter` of a period after its
    nominal grid point, missing with probability `missing`, and in a stretch of `4 * gap_samples`
    samples, with probability `gap`, a run of `gap_samples` missing ones. Every sample is the mean
    utilization since the one before it, however long ago that was.
    Seeded: the same samples whenever they are read."""

    jitter: float = 0.5
    missing: float = 0.1
    gap: float = 0.2
    gap_samples: int = 8
    seed: int = 0

    def _draw(self, k: int, salt: int) -> float:
        return random.Random((self.seed * 1_000_003 + k) * 4 + salt).random()

    def kept(self, k: int) -> bool:
        if k < 0 or self._draw(k, 0) < self.missing:
            return False
        stretch = k // (4 * self.gap_samples)
        if self._draw(stretch, 1) >= self.gap:
            return True
        opened = stretch * 4 * self.gap_samples + int(self._draw(stretch, 3) * 3 * self.gap_samples)
        return not opened <= k < opened + self.gap_samples

    def stamp(self, k: int, period: float) -> float:
        """Seconds since init of the k-th grid point's sample."""
        return (k + self.jitter * self._draw(k, 2)) * period

    def previous(self, k: int) -> int:
        """The latest kept sample before k, or -1 when there is none."""
        j = k - 1
        while j >= 0 and not self.kept(j):
            j -= 1
        return j


@dataclass
class FakeGpu:
    name: str = "NVIDIA H200"
    uuid: str = ""
    memory_total: int = 143_771 * 1024 * 1024
    utilization: Timeline = field(default_factory=lambda: constant(100.0))
    lost_at: float | None = None
    unsupported: frozenset[str] = frozenset()
    xids: tuple[tuple[float, int], ...] = ()
    pids: tuple[int, ...] = ()
    idle_power_mw: int = 90_000
    max_power_mw: int = 700_000
    trace: ComputeTrace | None = None  # when set, utilization follows it instead of the timeline
    mig_uuids: tuple[str, ...] = ()  # with MIG mode on: the MIG devices carved out of it (`MIG-<uuid>`)


@dataclass
class _Handle:
    index: int


@dataclass
class _MigHandle:
    parent: int
    slot: int


# MIG slots per GPU (an A100/H100/H200 splits into at most seven); unused slots answer NOT_FOUND.
MAX_MIG_DEVICES = 7


@dataclass
class _Process:
    pid: int
    usedGpuMemory: int  # noqa: N815 - pynvml's field name
    gpuInstanceId: int = 0xFFFFFFFF  # noqa: N815
    computeInstanceId: int = 0xFFFFFFFF  # noqa: N815


@dataclass
class _EventData:
    """pynvml's c_nvmlEventData_t, with the device as a fake handle instead of a C pointer."""

    device: _Handle
    eventType: int  # noqa: N815
    eventData: int  # noqa: N815
    gpuInstanceId: int = 0xFFFFFFFF  # noqa: N815
    computeInstanceId: int = 0xFFFFFFFF  # noqa: N815


@dataclass
class _EventSet:
    handles: list[_Handle] = field(default_factory=list)
    delivered: set[tuple[int, int]] = field(default_factory=set)


# pynvml.NVMLError(code) makes the code's own subclass (NVMLError_GpuIsLost, ...), as the library raises it;
# its constructor is untyped, this is its type.
_nvml_error: Callable[[int], Exception] = pynvml.NVMLError


def _raise(code: int) -> NoReturn:
    raise _nvml_error(code)


class FakeNVML:
    """Drop-in for the `pynvml` module: pass it wherever the collector takes `nvml` (an `NvmlApi`)."""

    def __init__(
        self,
        gpus: Iterable[FakeGpu] = (),
        clock: Callable[[], float] = time.time,
        sample_period: float = SAMPLE_PERIOD_S,
        sample_buffer: int = 120,
        pcie_latency: float = 0.02,
        library_present: bool = True,
        sampling: DriverSampling | None = None,
    ) -> None:
        self.gpus = list(gpus)
        for i, gpu in enumerate(self.gpus):
            if not gpu.uuid:
                gpu.uuid = f"GPU-{uuidlib.UUID(int=0xFA4E0000 + i)}"
        self._clock = clock
        self._sample_period = sample_period
        self._sample_buffer = sample_buffer
        self._sampling = sampling
        self._pcie_latency = pcie_latency
        self._library_present = library_present
        self._driver_loaded = True
        self._started: float | None = None
        self._energy_mj = [0.0] * len(self.gpus)
        self._energy_at: list[float | None] = [None] * len(self.gpus)
        self.calls: dict[str, int] = {}

    # --- test controls -------------------------------------------------------------------------
    def unload_driver(self) -> None:
        self._driver_loaded = False

    # --- helpers -------------------------------------------------------------------------------
    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def _elapsed(self) -> float:
        assert self._started is not None
        return self._clock() - self._started

    def _handle(self, handle: DeviceHandle) -> _Handle:
        """The fake's own handle of one of its GPUs; anything else is an invalid argument, as to NVML."""
        if not isinstance(handle, _Handle) or not 0 <= handle.index < len(self.gpus):
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return handle

    @staticmethod
    def _event_set(event_set: EventSet) -> _EventSet:
        if not isinstance(event_set, _EventSet):
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return event_set

    def _device(self, handle: DeviceHandle, function: str) -> FakeGpu:
        self._count(function)
        if not self._driver_loaded:
            _raise(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
        if self._started is None:
            _raise(pynvml.NVML_ERROR_UNINITIALIZED)
        gpu = self.gpus[self._handle(handle).index]
        if gpu.lost_at is not None and self._elapsed() >= gpu.lost_at:
            _raise(pynvml.NVML_ERROR_GPU_IS_LOST)
        if function in gpu.unsupported:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu

    def _percent(self, gpu: FakeGpu, at: float | None = None) -> float:
        elapsed = self._elapsed() if at is None else at
        if gpu.trace is not None:
            assert self._started is not None
            return gpu.trace.percent_at(self._started + elapsed)
        return max(0.0, min(100.0, gpu.utilization(elapsed)))

    def _power_mw(self, gpu: FakeGpu) -> int:
        return int(gpu.idle_power_mw + (gpu.max_power_mw - gpu.idle_power_mw) * self._percent(gpu) / 100)

    # --- library -------------------------------------------------------------------------------
    def nvmlInit(self) -> None:  # noqa: N802 - pynvml's names
        self._count("nvmlInit")
        if not self._library_present:
            _raise(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
        if not self._driver_loaded:
            _raise(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
        if self._started is None:
            self._started = self._clock()

    def nvmlShutdown(self) -> None:  # noqa: N802
        self._count("nvmlShutdown")
        if self._started is None:
            _raise(pynvml.NVML_ERROR_UNINITIALIZED)
        self._started = None

    def nvmlSystemGetDriverVersion(self) -> str:  # noqa: N802
        self._count("nvmlSystemGetDriverVersion")
        if self._started is None:
            _raise(pynvml.NVML_ERROR_UNINITIALIZED)
        return "570.124.06"

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        self._count("nvmlDeviceGetCount")
        if self._started is None:
            _raise(pynvml.NVML_ERROR_UNINITIALIZED)
        if not self._driver_loaded:
            _raise(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:  # noqa: N802
        self._count("nvmlDeviceGetHandleByIndex")
        if self._started is None:
            _raise(pynvml.NVML_ERROR_UNINITIALIZED)
        if not 0 <= index < len(self.gpus):
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return _Handle(index)

    def nvmlDeviceGetIndex(self, handle: DeviceHandle) -> int:  # noqa: N802
        self._device(handle, "nvmlDeviceGetIndex")
        return self._handle(handle).index

    def nvmlDeviceGetUUID(self, handle: DeviceHandle) -> str:  # noqa: N802
        if isinstance(handle, _MigHandle):
            return self._device(_Handle(handle.parent), "nvmlDeviceGetUUID").mig_uuids[handle.slot]
        return self._device(handle, "nvmlDeviceGetUUID").uuid

    def nvmlDeviceGetMaxMigDeviceCount(self, device: DeviceHandle) -> int:  # noqa: N802
        if not self._device(device, "nvmlDeviceGetMaxMigDeviceCount").mig_uuids:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)  # as a GPU without MIG mode answers
        return MAX_MIG_DEVICES

    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: DeviceHandle, index: int) -> _MigHandle:  # noqa: N802
        gpu = self._device(device, "nvmlDeviceGetMigDeviceHandleByIndex")
        if not 0 <= index < MAX_MIG_DEVICES:
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if index >= len(gpu.mig_uuids):
            _raise(pynvml.NVML_ERROR_NOT_FOUND)
        return _MigHandle(self._handle(device).index, index)

    def nvmlDeviceGetName(self, handle: DeviceHandle) -> str:  # noqa: N802
        return self._device(handle, "nvmlDeviceGetName").name

    def nvmlDeviceGetUtilizationRates(self, handle: DeviceHandle) -> pynvml.c_nvmlUtilization_t:  # noqa: N802
        gpu = self._device(handle, "nvmlDeviceGetUtilizationRates")
        percent = self._percent(gpu)
        return pynvml.c_nvmlUtilization_t(gpu=int(percent), memory=int(percent * 0.6))

    def nvmlDeviceGetSamples(  # noqa: N802
        self, device: DeviceHandle, sampling_type: int, timeStamp: int  # noqa: N803
    ) -> tuple[int, list[pynvml.c_nvmlSample_t]]:
        gpu = self._device(device, "nvmlDeviceGetSamples")
        if sampling_type != pynvml.NVML_GPU_UTILIZATION_SAMPLES:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        assert self._started is not None
        # The driver samples on a fixed grid since init and keeps a bounded buffer of the latest.
        newest = math.floor(self._elapsed() / self._sample_period)
        oldest = max(0, newest - self._sample_buffer + 1)
        if timeStamp:  # skip straight to the first sample newer than the caller's last
            oldest = max(oldest, math.floor((timeStamp / 1e6 - self._started) / self._sample_period))
        samples = []
        elapsed = self._elapsed()
        for k in range(oldest, newest + 1):
            sample = self._sample(gpu, k)
            if sample is None or sample[0] > elapsed:
                continue
            at, percent = sample
            stamp_us = int((self._started + at) * 1_000_000)
            if stamp_us <= timeStamp:
                continue
            value = pynvml.c_nvmlValue_t()
            value.uiVal = int(percent)
            samples.append(pynvml.c_nvmlSample_t(timeStamp=stamp_us, sampleValue=value))
        if not samples:
            _raise(pynvml.NVML_ERROR_NOT_FOUND)
        return pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, samples

    def _sample(self, gpu: FakeGpu, k: int) -> tuple[float, float] | None:
        """The k-th grid point's sample, (seconds since init, percent), or None where the driver has none."""
        period, sampling = self._sample_period, self._sampling
        if sampling is None:
            return k * period, self._percent(gpu, k * period)
        if not sampling.kept(k):
            return None
        at = sampling.stamp(k, period)
        before = sampling.previous(k)
        since = sampling.stamp(before, period) if before >= 0 else max(0.0, at - period)
        return at, self._mean_percent(gpu, since, at)

    def _mean_percent(self, gpu: FakeGpu, begin: float, end: float) -> float:
        if gpu.trace is not None:
            assert self._started is not None
            return gpu.trace.mean_percent(self._started + begin, self._started + end)
        points = [begin + (end - begin) * (i + 0.5) / 16 for i in range(16)]  # a timeline has no integral
        return sum(self._percent(gpu, t) for t in points) / len(points)

    def nvmlDeviceGetMemoryInfo(self, handle: DeviceHandle, version: int | None = None) -> pynvml.c_nvmlMemory_t:  # noqa: N802
        gpu = self._device(handle, "nvmlDeviceGetMemoryInfo")
        used = gpu.memory_total // 3 if gpu.pids else 512 * 1024 * 1024
        return pynvml.c_nvmlMemory_t(total=gpu.memory_total, free=gpu.memory_total - used, used=used)

    def nvmlDeviceGetPowerUsage(self, handle: DeviceHandle) -> int:  # noqa: N802
        return self._power_mw(self._device(handle, "nvmlDeviceGetPowerUsage"))

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: DeviceHandle) -> int:  # noqa: N802
        gpu = self._device(handle, "nvmlDeviceGetTotalEnergyConsumption")
        index, now = self._handle(handle).index, self._clock()
        last = self._energy_at[index]
        if last is not None:
            self._energy_mj[index] += self._power_mw(gpu) * (now - last)
        self._energy_at[index] = now
        return int(self._energy_mj[index])

    def nvmlDeviceGetClockInfo(self, handle: DeviceHandle, type: int) -> int:  # noqa: N802
        gpu = self._device(handle, "nvmlDeviceGetClockInfo")
        if type == pynvml.NVML_CLOCK_MEM:
            return 2619
        if type == pynvml.NVML_CLOCK_SM:
            return 1980 if self._percent(gpu) > 0 else 345
        _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def nvmlDeviceGetPcieThroughput(self, device: DeviceHandle, counter: int) -> int:  # noqa: N802
        gpu = self._device(device, "nvmlDeviceGetPcieThroughput")
        time.sleep(self._pcie_latency)  # the real call blocks for the driver's 20 ms window
        scale = 12_000_000 if counter == pynvml.NVML_PCIE_UTIL_RX_BYTES else 1_500_000
        return int(scale * self._percent(gpu) / 100)

    def nvmlDeviceGetTemperature(self, handle: DeviceHandle, sensor: int) -> int:  # noqa: N802
        gpu = self._device(handle, "nvmlDeviceGetTemperature")
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return int(35 + 40 * self._percent(gpu) / 100)

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: DeviceHandle) -> int:  # noqa: N802
        gpu = self._device(handle, "nvmlDeviceGetCurrentClocksEventReasons")
        if self._percent(gpu) == 0:
            return int(pynvml.nvmlClocksEventReasonGpuIdle)
        return int(pynvml.nvmlClocksEventReasonNone)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: DeviceHandle) -> list[_Process]:  # noqa: N802
        gpu = self._device(handle, "nvmlDeviceGetComputeRunningProcesses")
        return [_Process(pid, gpu.memory_total // 3 // max(1, len(gpu.pids))) for pid in gpu.pids]

    # --- events (XID) --------------------------------------------------------------------------
    def nvmlEventSetCreate(self) -> _EventSet:  # noqa: N802
        self._count("nvmlEventSetCreate")
        if self._started is None:
            _raise(pynvml.NVML_ERROR_UNINITIALIZED)
        return _EventSet()

    def nvmlDeviceRegisterEvents(self, handle: DeviceHandle, eventTypes: int, eventSet: EventSet) -> None:  # noqa: N802, N803
        self._device(handle, "nvmlDeviceRegisterEvents")
        if eventTypes & pynvml.nvmlEventTypeXidCriticalError:
            self._event_set(eventSet).handles.append(self._handle(handle))

    def nvmlEventSetWait(self, eventSet: EventSet, timeoutms: int) -> _EventData:  # noqa: N802, N803
        self._count("nvmlEventSetWait")
        watched = self._event_set(eventSet)
        deadline = time.monotonic() + timeoutms / 1000
        for attempt in itertools.count():
            if not self._driver_loaded:
                _raise(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
            if self._started is None:
                _raise(pynvml.NVML_ERROR_UNINITIALIZED)
            elapsed = self._elapsed()
            for handle in watched.handles:
                for n, (at, xid) in enumerate(self.gpus[handle.index].xids):
                    if at <= elapsed and (handle.index, n) not in watched.delivered:
                        watched.delivered.add((handle.index, n))
                        return _EventData(handle, pynvml.nvmlEventTypeXidCriticalError, xid)
            if time.monotonic() >= deadline or attempt > 10_000:
                _raise(pynvml.NVML_ERROR_TIMEOUT)
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        raise AssertionError("unreachable")

    def nvmlEventSetFree(self, eventSet: EventSet) -> None:  # noqa: N802, N803
        self._count("nvmlEventSetFree")
        self._event_set(eventSet).handles.clear()
