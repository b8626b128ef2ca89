"""The `gpu` collector: NVIDIA GPUs through NVML (pynvml from nvidia-ml-py).

NVML is read in a background thread, never on the scrape path: `nvmlDeviceGetPcieThroughput` alone
blocks ~20 ms per call. Each poll reads every field of every GPU; the driver's high-rate utilization
samples (`nvmlDeviceGetSamples`) are read since the last timestamp seen, so a 200 ms dip between
two polls still shows, as `stallwatch_gpu_utilization_min_ratio` and in
`stallwatch_gpu_idle_seconds_total`, and reaches the correlator as `gpu_util` batches. Each sample is
the GPU's mean utilization over its period, so its idle time is (1 - utilization) x period: an
input-bound GPU mixes compute and idle within most samples, and counting only samples near 0 % would
miss most of its idle time.

NVML is reached through `NvmlApi` (nvml_api.py): pynvml in production, the fake NVML in tests and demos.

A failing call degrades one metric of one GPU and is counted in `stallwatch_gpu_nvml_errors_total`:
NotSupported stops asking for that field, GpuIsLost marks the GPU down until it answers again, a
missing library or driver turns the collector into "no GPU" (said once) while the agent runs on.
XID events arrive on their own thread through an NVML event set.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import numpy as np
import pynvml
from prometheus_client.core import Metric

from stallwatch import catalogue
from stallwatch.correlator.wallclock import wall_offset_ns
from stallwatch.eventbatch import EventBatch, EventSink, discard
from stallwatch.exporters.collector import CollectorContext, register_collector
from stallwatch.exporters.gpu_directory import GpuDirectory
from stallwatch.exporters.nvml_api import DeviceHandle, NvmlApi
from stallwatch.flags import bounded_float, bounded_int, non_negative_float

log = logging.getLogger(__name__)

# Bits of nvmlDeviceGetCurrentClocksEventReasons; gpu_idle is the starvation signal.
CLOCK_EVENT_REASONS: dict[str, int] = {
    "gpu_idle": pynvml.nvmlClocksEventReasonGpuIdle,
    "applications_clocks_setting": pynvml.nvmlClocksEventReasonApplicationsClocksSetting,
    "sw_power_cap": pynvml.nvmlClocksEventReasonSwPowerCap,
    "hw_slowdown": pynvml.nvmlClocksEventReasonHwSlowdown,
    "sync_boost": pynvml.nvmlClocksEventReasonSyncBoost,
    "sw_thermal_slowdown": pynvml.nvmlClocksEventReasonSwThermalSlowdown,
    "hw_thermal_slowdown": pynvml.nvmlClocksEventReasonHwThermalSlowdown,
    "hw_power_brake_slowdown": pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown,
    "display_clock_setting": pynvml.nvmlClocksEventReasonDisplayClockSetting,
}
RETRY_INIT_SECONDS = 30.0
XID_WAIT_MS = 500

T = TypeVar("T")


class _DeviceLostError(Exception):
    pass


class _DriverGoneError(Exception):
    pass


def error_label(error: Exception) -> str:
    """`NVMLError_GpuIsLost` -> `gpu_is_lost`: a short, bounded label value."""
    name = type(error).__name__.removeprefix("NVMLError_").removeprefix("NVMLError")
    if not name:
        return f"code_{getattr(error, 'value', 'unknown')}"
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


@dataclass
class _Reading:
    """One poll's values for one GPU; a field that failed is simply absent."""

    gauges: dict[str, float] = field(default_factory=dict)
    pcie: dict[str, float] = field(default_factory=dict)
    reasons: int | None = None
    pids: tuple[int, ...] | None = None
    utilization_min: float | None = None


@dataclass
class _Device:
    index: int
    handle: DeviceHandle
    uuid: str = ""
    name: str = ""
    mig_uuids: list[str] = field(default_factory=list)
    up: bool = True
    unsupported: set[str] = field(default_factory=set)
    last_sample_us: int = 0
    follows_last_sample: bool = False  # whether the driver's next sample follows the one read last
    sample_period_us: float = 0.0
    idle_seconds: float = 0.0
    samples: int = 0
    reading: _Reading = field(default_factory=_Reading)

    @property
    def label(self) -> str:
        return str(self.index)


def _mig_uuids(nvml: NvmlApi, handle: DeviceHandle) -> list[str]:
    """The MIG devices carved out of a GPU, read once at init: none when MIG is off or unsupported."""
    try:
        slots = int(nvml.nvmlDeviceGetMaxMigDeviceCount(handle))
    except pynvml.NVMLError:
        return []
    found = []
    for slot in range(slots):
        try:
            found.append(str(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot))))
        except pynvml.NVMLError:  # an empty slot
            continue
    return found


class GpuCollector:
    def __init__(
        self,
        nvml: NvmlApi,
        *,
        interval: float = 0.5,
        pcie_interval: float = 10.0,
        sink: EventSink = discard,
        clock: Callable[[], float] = time.monotonic,
        wall_offset: Callable[[], int] = wall_offset_ns,
        start: bool = True,
        directory: GpuDirectory | None = None,
    ) -> None:
        """`clock` (the node's monotonic seconds) schedules the reads; `wall_offset` (ns, wall clock minus
        monotonic clock: wallclock's mapping) moves NVML's wall-clock sample stamps onto the events' clock.
        Both are the only times the collector reads: a test drives them from one fake clock."""
        self._nvml = nvml
        self._directory = directory if directory is not None else GpuDirectory()
        self._interval = interval
        self._pcie_interval = pcie_interval
        self._sink = sink
        self._clock = clock
        self._wall_offset = wall_offset
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._devices: list[_Device] = []
        self._initialised = False
        self._said_no_gpu = False
        self._next_init = 0.0
        self._next_pcie = 0.0
        self._errors: Counter[tuple[str, str, str]] = Counter()
        self._xids: Counter[tuple[str, str]] = Counter()
        self._threads: list[threading.Thread] = []
        if start:
            self._start_thread(self._poll_forever, "stallwatch-gpu-poll")

    # --- lifecycle -----------------------------------------------------------------------------
    def _start_thread(self, target: Callable[[], None], name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=2)
        if self._initialised:
            with contextlib.suppress(pynvml.NVMLError):
                self._nvml.nvmlShutdown()

    def _poll_forever(self) -> None:
        while not self._stop.is_set():
            started = self._clock()
            try:
                self.poll()
            except Exception:  # a bug here must not kill the thread: the scrape would freeze
                log.exception("gpu poll failed")
            self._stop.wait(max(0.0, self._interval - (self._clock() - started)))

    def _count_error(self, gpu: str, call: str, error: Exception) -> None:
        with self._lock:
            self._errors[(gpu, call, error_label(error))] += 1

    def _try_init(self) -> bool:
        now = self._clock()
        if now < self._next_init:
            return False
        self._next_init = now + RETRY_INIT_SECONDS
        nvml = self._nvml
        try:
            nvml.nvmlInit()
            count = nvml.nvmlDeviceGetCount()
            driver = nvml.nvmlSystemGetDriverVersion()
            devices = [_Device(i, nvml.nvmlDeviceGetHandleByIndex(i)) for i in range(count)]
            for device in devices:
                device.uuid = str(nvml.nvmlDeviceGetUUID(device.handle))
                device.name = str(nvml.nvmlDeviceGetName(device.handle))
                device.mig_uuids = _mig_uuids(nvml, device.handle)
        except pynvml.NVMLError as error:
            self._count_error("", "nvmlInit", error)
            if not self._said_no_gpu:
                log.warning("gpu collector: no GPU (NVML: %s); GPU metrics are off, the agent runs on", error)
                self._said_no_gpu = True
            with self._lock:
                self._devices = []
            return False
        if not devices and not self._said_no_gpu:
            log.warning("gpu collector: NVML found no GPU; GPU metrics are off, the agent runs on")
            self._said_no_gpu = True
        log.info("gpu collector: driver %s, %d GPU(s): %s", driver, len(devices), ", ".join(d.name for d in devices))
        # Before the devices show in a scrape; a MIG device's steps count on the GPU it is carved from.
        self._directory.learn({uuid: d.index for d in devices for uuid in (d.uuid, *d.mig_uuids)},
                              {d.index: d.name for d in devices})
        with self._lock:
            self._devices = devices
        self._initialised = True
        self._said_no_gpu = False
        self._start_thread(self._watch_xids, "stallwatch-gpu-xid")
        return True

    # --- polling -------------------------------------------------------------------------------
    def poll(self) -> None:
        """Read every GPU once. Runs on the poll thread; tests call it directly."""
        if not self._initialised and not self._try_init():
            return
        read_pcie = self._pcie_interval > 0 and self._clock() >= self._next_pcie
        if read_pcie:
            self._next_pcie = self._clock() + self._pcie_interval
        for device in list(self._devices):
            try:
                reading = self._read_device(device, read_pcie)
            except _DeviceLostError:
                if device.up:
                    log.warning("gpu %d (%s) is lost", device.index, device.uuid)
                reading, device.up, device.follows_last_sample = _Reading(), False, False
            except _DriverGoneError:
                log.warning("gpu collector: the NVIDIA driver went away; retrying every %ss", RETRY_INIT_SECONDS)
                with self._lock:
                    for d in self._devices:
                        d.up, d.reading = False, _Reading()
                self._initialised = False
                self._next_init = self._clock() + RETRY_INIT_SECONDS
                return
            with self._lock:
                device.reading = reading

    def _call(self, device: _Device, function: Callable[..., T], *args: object) -> T | None:
        """One NVML call for one GPU: None when it failed, the failure counted."""
        if function.__name__ in device.unsupported:
            return None
        try:
            return function(device.handle, *args)
        except pynvml.NVMLError as error:
            self._call_failed(device, function.__name__, error)
            return None

    def _read_device(self, device: _Device, read_pcie: bool) -> _Reading:
        nvml = self._nvml
        reading = _Reading()
        gauges = reading.gauges
        utilization = self._call(device, nvml.nvmlDeviceGetUtilizationRates)
        if not device.up:
            log.info("gpu %d answers again", device.index)
            device.up = True
        if utilization is not None:
            gauges[catalogue.GPU_UTILIZATION.name] = utilization.gpu / 100
            gauges[catalogue.GPU_MEMORY_UTILIZATION.name] = utilization.memory / 100
        reading.utilization_min = self._read_samples(device)
        memory = self._call(device, nvml.nvmlDeviceGetMemoryInfo)
        if memory is not None:
            gauges[catalogue.GPU_MEMORY_USED.name] = float(memory.used)
            gauges[catalogue.GPU_MEMORY_TOTAL.name] = float(memory.total)
        scaled: tuple[tuple[catalogue.AnyMetricDef, Callable[..., int], tuple[int, ...], float], ...] = (
            (catalogue.GPU_POWER, nvml.nvmlDeviceGetPowerUsage, (), 1e-3),  # mW
            (catalogue.GPU_ENERGY, nvml.nvmlDeviceGetTotalEnergyConsumption, (), 1e-3),  # mJ
            (catalogue.GPU_SM_CLOCK, nvml.nvmlDeviceGetClockInfo, (pynvml.NVML_CLOCK_SM,), 1e6),  # MHz
            (catalogue.GPU_MEMORY_CLOCK, nvml.nvmlDeviceGetClockInfo, (pynvml.NVML_CLOCK_MEM,), 1e6),
            (catalogue.GPU_TEMPERATURE, nvml.nvmlDeviceGetTemperature, (pynvml.NVML_TEMPERATURE_GPU,), 1.0),
        )
        for metric, function, args, scale in scaled:
            value = self._call(device, function, *args)
            if value is not None:
                gauges[metric.name] = value * scale
        reading.reasons = self._call(device, nvml.nvmlDeviceGetCurrentClocksEventReasons)
        processes = self._call(device, nvml.nvmlDeviceGetComputeRunningProcesses)
        if processes is not None:
            reading.pids = tuple(int(p.pid) for p in processes)
        if read_pcie:
            for direction, counter in (("rx", pynvml.NVML_PCIE_UTIL_RX_BYTES), ("tx", pynvml.NVML_PCIE_UTIL_TX_BYTES)):
                value = self._call(device, nvml.nvmlDeviceGetPcieThroughput, counter)
                if value is not None:
                    reading.pcie[direction] = value * 1024.0  # KB/s
        else:
            reading.pcie = dict(device.reading.pcie)
        return reading

    def _read_samples(self, device: _Device) -> float | None:
        """Fold the driver's new utilization samples into idle seconds; return their minimum, or the previous
        reading's when there is no new sample (as PCIe throughput holds between its reads)."""
        read = self._nvml.nvmlDeviceGetSamples
        if read.__name__ in device.unsupported:
            return None
        try:
            _, raw = read(device.handle, pynvml.NVML_GPU_UTILIZATION_SAMPLES, device.last_sample_us)
        except pynvml.NVMLError as error:
            if getattr(error, "value", None) == pynvml.NVML_ERROR_NOT_FOUND:
                return device.reading.utilization_min  # no sample since the last one: the last minimum holds
            self._call_failed(device, read.__name__, error)
            return None
        stamps = np.fromiter((s.timeStamp for s in raw), dtype=np.int64, count=len(raw))
        values = np.fromiter((s.sampleValue.uiVal for s in raw), dtype=np.float64, count=len(raw)) / 100
        fresh = stamps > device.last_sample_us
        stamps, values = stamps[fresh], values[fresh]
        if stamps.size == 0:  # as above: a poll quicker than the driver's sample period keeps the series
            return device.reading.utilization_min
        order = np.argsort(stamps, kind="stable")
        stamps, values = stamps[order], values[order]
        gaps = np.diff(stamps).astype(np.float64)
        if gaps.size:
            device.sample_period_us = float(np.median(gaps))
        # A sample is the mean since the driver's sample before it, however far back the driver's irregular
        # sampling put that one (as the correlator reads it). The first read of a GPU, or once it answers
        # again, has no known predecessor: it covers one typical period.
        first = device.last_sample_us if device.follows_last_sample else stamps[0] - device.sample_period_us
        periods_us = np.diff(stamps, prepend=first).astype(np.float64)
        device.follows_last_sample = True
        device.idle_seconds += float(((1.0 - np.clip(values, 0.0, 1.0)) * periods_us).sum()) / 1e6
        device.samples += int(stamps.size)
        device.last_sample_us = int(stamps[-1])
        self._sink(
            EventBatch.of(
                "gpu_util",
                {
                    "ts_ns": stamps * 1000 - self._wall_offset(),
                    "period_ns": (periods_us * 1000).astype(np.int64),
                    "gpu": np.full(stamps.size, device.index),
                    "util": values,
                },
            )
        )
        return float(values.min())

    def _call_failed(self, device: _Device, function: str, error: Exception) -> None:
        """Count a failed call; stop asking for what is unsupported; escalate a lost GPU or driver."""
        self._count_error(device.label, function, error)
        code = getattr(error, "value", None)
        if code == pynvml.NVML_ERROR_NOT_SUPPORTED:
            device.unsupported.add(function)
        elif code in (pynvml.NVML_ERROR_GPU_IS_LOST, pynvml.NVML_ERROR_GPU_NOT_FOUND):
            raise _DeviceLostError from error
        elif code in (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, pynvml.NVML_ERROR_UNINITIALIZED):
            raise _DriverGoneError from error

    # --- XID events ----------------------------------------------------------------------------
    def _watch_xids(self) -> None:
        nvml = self._nvml
        try:
            event_set = nvml.nvmlEventSetCreate()
        except pynvml.NVMLError as error:
            self._count_error("", "nvmlEventSetCreate", error)
            return
        for device in list(self._devices):
            try:
                nvml.nvmlDeviceRegisterEvents(device.handle, pynvml.nvmlEventTypeXidCriticalError, event_set)
            except pynvml.NVMLError as error:
                self._count_error(device.label, "nvmlDeviceRegisterEvents", error)
        while not self._stop.is_set() and self._initialised:
            try:
                event = nvml.nvmlEventSetWait(event_set, XID_WAIT_MS)
            except pynvml.NVMLError as error:
                if getattr(error, "value", None) == pynvml.NVML_ERROR_TIMEOUT:
                    continue
                self._count_error("", "nvmlEventSetWait", error)
                self._stop.wait(self._interval)
                continue
            try:
                gpu = str(nvml.nvmlDeviceGetIndex(event.device))
            except pynvml.NVMLError:
                gpu = ""
            with self._lock:
                self._xids[(gpu, str(event.eventData))] += 1
            log.warning("gpu %s: XID %s", gpu, event.eventData)
        with contextlib.suppress(pynvml.NVMLError):
            nvml.nvmlEventSetFree(event_set)

    # --- what others read ----------------------------------------------------------------------
    def pid_to_gpu(self) -> dict[int, int]:
        """Which GPU each compute process runs on (the correlator maps pid -> rank with it)."""
        with self._lock:
            return {pid: d.index for d in self._devices for pid in (d.reading.pids or ())}

    def collect(self) -> Iterator[Metric]:
        c = catalogue
        with self._lock:
            devices = [(d.label, d.uuid, d.name, d.up, d.reading, d.idle_seconds, d.samples) for d in self._devices]
            errors = dict(self._errors)
            xids = dict(self._xids)
        count = c.GPU_DEVICES.family()
        count.add_metric([], len(devices))
        yield count
        info, up = c.GPU_INFO.family(), c.GPU_UP.family()
        gauges = {m.name: m.family() for m in _READING_GAUGES}
        energy = c.GPU_ENERGY.family()
        minimum, idle = c.GPU_UTILIZATION_MIN.family(), c.GPU_IDLE_SECONDS.family()
        samples, pcie = c.GPU_UTILIZATION_SAMPLES.family(), c.GPU_PCIE_THROUGHPUT.family()
        reasons, processes = c.GPU_CLOCKS_EVENT_REASON.family(), c.GPU_PROCESSES.family()
        for gpu, uuid, name, is_up, reading, idle_seconds, sample_count in devices:
            info.add_metric([gpu, uuid, name], 1)
            up.add_metric([gpu], 1 if is_up else 0)
            idle.add_metric([gpu], idle_seconds)
            samples.add_metric([gpu], sample_count)
            for metric_name, value in reading.gauges.items():
                if metric_name == c.GPU_ENERGY.name:
                    energy.add_metric([gpu], value)
                else:
                    gauges[metric_name].add_metric([gpu], value)
            if reading.utilization_min is not None:
                minimum.add_metric([gpu], reading.utilization_min)
            for direction, value in reading.pcie.items():
                pcie.add_metric([gpu, direction], value)
            if reading.reasons is not None:
                for reason, bit in CLOCK_EVENT_REASONS.items():
                    reasons.add_metric([gpu, reason], 1 if reading.reasons & bit else 0)
            if reading.pids is not None:
                processes.add_metric([gpu], len(reading.pids))
        xid_family = c.GPU_XID_ERRORS.family()
        for (gpu, xid), n in sorted(xids.items()):
            xid_family.add_metric([gpu, xid], n)
        error_family = c.GPU_NVML_ERRORS.family()
        for (gpu, call, error), n in sorted(errors.items()):
            error_family.add_metric([gpu, call, error], n)
        yield from (info, up, *gauges.values(), energy, minimum, idle, samples, pcie, reasons, processes)
        yield xid_family
        yield error_family


_READING_GAUGES = (
    catalogue.GPU_UTILIZATION,
    catalogue.GPU_MEMORY_UTILIZATION,
    catalogue.GPU_MEMORY_USED,
    catalogue.GPU_MEMORY_TOTAL,
    catalogue.GPU_POWER,
    catalogue.GPU_SM_CLOCK,
    catalogue.GPU_MEMORY_CLOCK,
    catalogue.GPU_TEMPERATURE,
)


def _add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--gpu.interval", dest="gpu_interval", type=bounded_float(0, 60, above=True), default=0.5,
                       metavar="SECONDS", help="how often NVML is polled, at most 60 (default: %(default)s)")
    group.add_argument("--gpu.pcie-interval", dest="gpu_pcie_interval", type=non_negative_float, default=10.0,
                       metavar="SECONDS", help="how often PCIe throughput is read, 0 to never; each read "
                       "blocks ~20 ms per GPU (default: %(default)s)")
    group.add_argument("--gpu.fake-devices", dest="gpu_fake_devices", type=bounded_int(0, 64), default=0,
                       metavar="N", help="emulate N GPUs with stallwatch's fake NVML instead of the real one "
                       "(demos, tests)")
    group.add_argument("--gpu.fake-trace", dest="gpu_fake_trace", type=Path, default=None, metavar="FILE",
                       help="the emulated GPUs are busy exactly in the compute spans a training job appends "
                       "to FILE (the demo's emulated job does)")


def _from_context(context: CollectorContext) -> GpuCollector:
    options = context.options
    nvml: NvmlApi
    if options.gpu_fake_devices > 0:
        from stallwatch.exporters.nvml_fake import ComputeTrace, DriverSampling, FakeGpu, FakeNVML, training

        trace = ComputeTrace(options.gpu_fake_trace) if options.gpu_fake_trace else None
        nvml = FakeNVML(
            [FakeGpu(utilization=training(1.0 + 0.1 * i, 0.2), trace=trace) for i in range(options.gpu_fake_devices)],
            pcie_latency=0.0,
            sampling=DriverSampling(),
        )
    else:
        nvml = pynvml
    return GpuCollector(
        nvml,
        interval=options.gpu_interval,
        pcie_interval=options.gpu_pcie_interval,
        sink=context.sink,
        directory=context.gpus,
    )


register_collector("gpu", True, "NVIDIA GPUs through NVML", _from_context, _add_arguments)
