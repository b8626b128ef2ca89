"""The fake NVML is only useful if it is faithful to pynvml: same names, signatures, errors, types."""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import pynvml
import pytest

from stallwatch.exporters.nvml_api import NvmlApi
from stallwatch.exporters.nvml_fake import ComputeTrace, DriverSampling, FakeGpu, FakeNVML

# Every NVML function the gpu collector calls: the members of the Protocol it types its NVML with.
CALLED = sorted(name for name in vars(NvmlApi) if name.startswith("nvml"))


def nvml_error(code: int) -> Any:
    """What pynvml raises for an error code: the code's own subclass of NVMLError (NVMLError_GpuIsLost, ...)."""
    return pytest.raises(pynvml.nvmlExceptionClass(code))


def test_pynvml_and_the_fake_answer_the_protocol() -> None:
    # mypy checks these two assignments (names, arity, the fake's types); at run time, the functions are there.
    real: NvmlApi = pynvml
    fake: NvmlApi = FakeNVML([])
    assert len(CALLED) > 20
    assert all(callable(getattr(real, name, None)) and callable(getattr(fake, name, None)) for name in CALLED)


@pytest.mark.parametrize("name", CALLED)
def test_same_parameter_names_as_pynvml(name: str) -> None:
    real = list(inspect.signature(getattr(pynvml, name)).parameters)
    assert list(inspect.signature(getattr(FakeNVML([]), name)).parameters) == real, name
    assert list(inspect.signature(getattr(NvmlApi, name)).parameters)[1:] == real, name  # less self


def test_errors_are_pynvml_classes_with_pynvml_codes() -> None:
    nvml = FakeNVML([FakeGpu(lost_at=0.0)])
    with nvml_error(pynvml.NVML_ERROR_UNINITIALIZED):
        nvml.nvmlDeviceGetCount()
    nvml.nvmlInit()
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    with nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST) as lost:
        nvml.nvmlDeviceGetPowerUsage(handle)
    assert lost.value.value == pynvml.NVML_ERROR_GPU_IS_LOST
    with nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT):
        nvml.nvmlDeviceGetHandleByIndex(5)
    with nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT):  # a handle NVML never gave, as the real library answers
        nvml.nvmlDeviceGetName(object())
    assert not hasattr(nvml, "nvmlDeviceGetFanSpeed")  # not implemented: must not fall through to the real library


def test_uuids_and_mig_devices_answer_as_pynvml_does() -> None:
    mig = "MIG-0d5e7c2a-aaaa-4bbb-8ccc-dddddddddddd"
    nvml = FakeNVML([FakeGpu(), FakeGpu(mig_uuids=(mig,))])
    nvml.nvmlInit()
    plain, split = nvml.nvmlDeviceGetHandleByIndex(0), nvml.nvmlDeviceGetHandleByIndex(1)
    uuid = nvml.nvmlDeviceGetUUID(plain)
    assert isinstance(uuid, str) and uuid.startswith("GPU-") and len(uuid) == 40
    with nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED):
        nvml.nvmlDeviceGetMaxMigDeviceCount(plain)
    assert nvml.nvmlDeviceGetMaxMigDeviceCount(split) == 7
    assert nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetMigDeviceHandleByIndex(split, 0)) == mig
    with nvml_error(pynvml.NVML_ERROR_NOT_FOUND):
        nvml.nvmlDeviceGetMigDeviceHandleByIndex(split, 1)


def test_return_types_and_units_match_pynvml() -> None:
    nvml = FakeNVML([FakeGpu(pids=(7,))], sample_period=0.1)
    nvml.nvmlInit()
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    assert isinstance(nvml.nvmlDeviceGetMemoryInfo(handle), pynvml.c_nvmlMemory_t)
    assert isinstance(nvml.nvmlDeviceGetUtilizationRates(handle), pynvml.c_nvmlUtilization_t)
    assert 100_000 <= nvml.nvmlDeviceGetPowerUsage(handle) <= 700_000  # milliwatts
    kind, raw = nvml.nvmlDeviceGetSamples(handle, pynvml.NVML_GPU_UTILIZATION_SAMPLES, 0)
    assert kind == pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
    assert isinstance(raw[0], pynvml.c_nvmlSample_t) and raw[0].timeStamp > 1_600_000_000_000_000  # µs epoch
    with nvml_error(pynvml.NVML_ERROR_NOT_FOUND):
        nvml.nvmlDeviceGetSamples(handle, pynvml.NVML_GPU_UTILIZATION_SAMPLES, raw[-1].timeStamp)
    assert nvml.nvmlDeviceGetComputeRunningProcesses(handle)[0].pid == 7
    event_set = nvml.nvmlEventSetCreate()
    nvml.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError, event_set)
    with nvml_error(pynvml.NVML_ERROR_TIMEOUT):
        nvml.nvmlEventSetWait(event_set, 10)


def test_gpu_check_script_runs_against_the_fake_and_here() -> None:
    import subprocess
    import sys

    from tests.conftest import ROOT

    script = str(ROOT / "benchmarks" / "gpu_check.py")
    fake = subprocess.run([sys.executable, script, "--fake", "2", "--repeat", "1"], capture_output=True, text=True,
                          timeout=60)
    assert fake.returncode == 0 and "FAILS" not in fake.stdout, fake.stdout + fake.stderr
    for name in CALLED:
        if name.startswith("nvmlDevice") and name not in ("nvmlDeviceGetCount", "nvmlDeviceGetHandleByIndex",
                                                          "nvmlDeviceGetIndex"):
            assert name in fake.stdout, name
    here = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=60)
    assert here.returncode == 0 and ("no GPU" in here.stdout or "GPU 0:" in here.stdout)


def test_driver_like_samples_are_irregular_with_gaps_and_average_their_real_period() -> None:
    """Busy 1 s, idle 1 s, repeating: each sample is the busy share since the sample before it, so the
    samples' idle time over their real periods adds up to the idle time, whatever the spacing."""
    spans = [(float(t), t + 1.0) for t in range(0, 60, 2)]
    now = [0.0]
    nvml = FakeNVML([FakeGpu(trace=ComputeTrace.of_spans(spans))], clock=lambda: now[0], sample_period=1 / 6,
                    sample_buffer=1000, sampling=DriverSampling(seed=3))
    nvml.nvmlInit()
    now[0] = 60.0
    _, raw = nvml.nvmlDeviceGetSamples(nvml.nvmlDeviceGetHandleByIndex(0), pynvml.NVML_GPU_UTILIZATION_SAMPLES, 0)
    stamps = np.array([s.timeStamp for s in raw]) / 1e6
    util = np.array([s.sampleValue.uiVal for s in raw]) / 100
    periods = np.diff(stamps)
    assert periods.min() < 0.9 / 6 and periods.max() > 4 / 6  # irregular, with gaps past 4 periods
    assert 0.7 * 360 < stamps.size < 0.95 * 360
    idle = float(((1 - util[1:] / 0.97) * periods).sum())  # busy is 97 % inside a span
    assert idle == pytest.approx(stamps[-1] - stamps[0] - sum(min(e, stamps[-1]) - max(s, stamps[0])
                                                              for s, e in spans if e > stamps[0]), rel=0.02)
    again = nvml.nvmlDeviceGetSamples(nvml.nvmlDeviceGetHandleByIndex(0), pynvml.NVML_GPU_UTILIZATION_SAMPLES, 0)[1]
    assert [s.timeStamp for s in again] == [s.timeStamp for s in raw]  # the same samples on every read
