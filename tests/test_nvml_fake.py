"""The fake NVML is only useful if it is faithful to pynvml: same names, signatures, errors, types."""

from __future__ import annotations

import inspect

import pynvml
import pytest

from stallwatch.exporters.nvml_fake import FakeGpu, FakeNVML

# Every NVML function the gpu collector calls (grep `nvml\w+` in stallwatch/exporters/gpu.py to extend).
CALLED = [
    "nvmlInit", "nvmlShutdown", "nvmlDeviceGetCount", "nvmlDeviceGetHandleByIndex", "nvmlDeviceGetIndex",
    "nvmlDeviceGetUUID", "nvmlDeviceGetName", "nvmlDeviceGetUtilizationRates", "nvmlDeviceGetSamples",
    "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetPowerUsage", "nvmlDeviceGetTotalEnergyConsumption",
    "nvmlDeviceGetClockInfo", "nvmlDeviceGetPcieThroughput", "nvmlDeviceGetTemperature",
    "nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetComputeRunningProcesses", "nvmlEventSetCreate",
    "nvmlDeviceRegisterEvents", "nvmlEventSetWait", "nvmlEventSetFree", "nvmlDeviceGetMaxMigDeviceCount",
    "nvmlDeviceGetMigDeviceHandleByIndex",
]


@pytest.mark.parametrize("name", CALLED)
def test_same_signature_as_pynvml(name: str) -> None:
    real = inspect.signature(getattr(pynvml, name))
    fake = inspect.signature(getattr(FakeNVML([]), name))
    assert list(fake.parameters) == list(real.parameters), name


def test_the_collector_calls_nothing_the_fake_lacks() -> None:
    import re
    from pathlib import Path

    from stallwatch.exporters import gpu

    called = set(re.findall(r'"(nvml[A-Z]\w+)"', Path(gpu.__file__).read_text()))
    called |= set(re.findall(r"nvml\.(nvml[A-Z]\w+)\(", Path(gpu.__file__).read_text()))
    functions = {n for n in called if callable(getattr(pynvml, n, None)) and not n.startswith("nvmlClocksEvent")}
    assert functions <= set(CALLED), functions - set(CALLED)


def test_errors_are_pynvml_classes_with_pynvml_codes() -> None:
    nvml = FakeNVML([FakeGpu(lost_at=0.0)])
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nvml.nvmlDeviceGetCount()
    nvml.nvmlInit()
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_GpuIsLost) as lost:
        nvml.nvmlDeviceGetPowerUsage(handle)
    assert lost.value.value == pynvml.NVML_ERROR_GPU_IS_LOST
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetHandleByIndex(5)
    assert nvml.NVMLError is pynvml.NVMLError
    assert nvml.NVML_CLOCK_SM == pynvml.NVML_CLOCK_SM
    with pytest.raises(AttributeError):
        _ = nvml.nvmlDeviceGetFanSpeed  # not implemented: must not fall through to the real library


def test_uuids_and_mig_devices_answer_as_pynvml_does() -> None:
    mig = "MIG-0d5e7c2a-aaaa-4bbb-8ccc-dddddddddddd"
    nvml = FakeNVML([FakeGpu(), FakeGpu(mig_uuids=(mig,))])
    nvml.nvmlInit()
    plain, split = nvml.nvmlDeviceGetHandleByIndex(0), nvml.nvmlDeviceGetHandleByIndex(1)
    uuid = nvml.nvmlDeviceGetUUID(plain)
    assert isinstance(uuid, str) and uuid.startswith("GPU-") and len(uuid) == 40
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetMaxMigDeviceCount(plain)
    assert nvml.nvmlDeviceGetMaxMigDeviceCount(split) == 7
    assert nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetMigDeviceHandleByIndex(split, 0)) == mig
    with pytest.raises(pynvml.NVMLError_NotFound):
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
    with pytest.raises(pynvml.NVMLError_NotFound):
        nvml.nvmlDeviceGetSamples(handle, pynvml.NVML_GPU_UTILIZATION_SAMPLES, raw[-1].timeStamp)
    assert nvml.nvmlDeviceGetComputeRunningProcesses(handle)[0].pid == 7
    event_set = nvml.nvmlEventSetCreate()
    nvml.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError, event_set)
    with pytest.raises(pynvml.NVMLError_Timeout):
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
