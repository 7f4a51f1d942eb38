"""Measurement helpers without a GPU: ncu CSV parsing on real H200 output, availability probes."""

import sys
import types
from pathlib import Path

import numpy as np
import pytest
from fake_cupti import install as install_fake_cupti

from questprof.measure import ceilings, cupti, ncu, nvml

FIXTURES = Path(__file__).parent / "fixtures"


def test_parse_base_units_fixture():
    """ncu --print-units base on a 256 MiB read of kernels/ceilings.cu (H200, 2026)."""
    (k,) = ncu.parse_csv((FIXTURES / "ncu_read_base_h200.csv").read_text())
    assert k.name == "ceilings_read" and k.id == 0
    assert k.read_bytes == 268_446_976  # 256 MiB = 268,435,456: +0.004%
    assert k.write_bytes == 2_418_432
    assert k.duration_ns == 63_264


def test_parse_auto_units_fixture():
    (k,) = ncu.parse_csv((FIXTURES / "ncu_read_auto_h200.csv").read_text())
    assert abs(k.read_bytes / 268_435_456 - 1) < 1e-4
    assert k.duration_ns > 0


@pytest.mark.parametrize("value, unit, expected", [
    ("268,445,952", "byte", 268_445_952), ("268.45", "Mbyte", 268.45e6), ("1.5", "Gbyte", 1.5e9),
    ("12", "Kbyte", 12e3), ("63,264", "ns", 63_264), ("63.26", "usecond", 63_260),
    ("2", "msecond", 2e6), ("4", "MiB", 4 * 1024**2), ("7", "", 7)])
def test_parse_value_units(value, unit, expected):
    assert ncu.parse_value(value, unit) == pytest.approx(expected)


def test_parse_value_rejects_unknown_unit():
    with pytest.raises(ValueError, match="furlong"):
        ncu.parse_value("3", "furlong")


def _row(kid, name, metric, unit, value):
    return (f'"{kid}","1","python3","h","{name}","1","7","(256, 1, 1)","(8, 1, 1)","0","9.0",'
            f'"Command line profiler metrics","{metric}","{unit}","{value}"')


def test_parse_several_kernels_and_split_by_marker():
    header = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
              '"Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit",'
              '"Metric Value"')
    rows = []
    for kid, name in enumerate(["ceilings_read", "estimate_kernel<fp16, 128>", "ceilings_read",
                                "attention_kernel", "merge_kernel"]):
        rows += [_row(kid, name, "dram__bytes_read.sum", "Kbyte", f"{kid + 1},000.5"),
                 _row(kid, name, "dram__bytes_write.sum", "byte", "32"),
                 _row(kid, name, "gpu__time_duration.sum", "usecond", "1.5")]
    text = "==PROF== Connected\nprogram output\n" + "\n".join([header] + rows)
    kernels = ncu.parse_csv(text)
    assert [k.id for k in kernels] == [0, 1, 2, 3, 4]
    assert kernels[1].read_bytes == pytest.approx(2_000_500)
    groups = ncu.split_by_marker(kernels, "ceilings_read")
    assert [[k.name for k in g] for g in groups] == [["estimate_kernel<fp16, 128>"],
                                                    ["attention_kernel", "merge_kernel"]]


def test_parse_empty_output():
    assert ncu.parse_csv("==PROF== no kernels were profiled\n") == []


def test_availability_never_raises():
    for probe in (cupti.available, ncu.available, nvml.available, nvml.gpm_available):
        ok, why = probe()
        assert isinstance(ok, bool)
        assert ok or (isinstance(why, str) and why)


class FakeNvml(types.ModuleType):
    """pynvml with one device at known clocks, power, memory and throttle mask; calls named in
    `failing` raise NVMLError."""

    NVML_CLOCK_SM, NVML_CLOCK_MEM = 1, 2

    class NVMLError(Exception):
        pass

    def __init__(self, failing=()):
        super().__init__("pynvml")
        self.failing = set(failing)

    def _answer(self, name, value):
        if name in self.failing:
            raise self.NVMLError("Not Supported")
        return value

    def nvmlInit(self):
        return self._answer("nvmlInit", None)

    def nvmlDeviceGetHandleByIndex(self, index):
        return self._answer("handle", f"gpu{index}")

    def nvmlDeviceGetHandleByPciBusId(self, bus_id):
        return self._answer("handle", "gpu0")

    def nvmlDeviceGetClockInfo(self, handle, kind):
        return self._answer(f"clock{kind}", {1: 1980, 2: 3201}[kind])

    def nvmlDeviceGetPowerUsage(self, handle):
        return self._answer("power", 351_500)

    def nvmlDeviceGetMemoryInfo(self, handle):
        return self._answer("memory", types.SimpleNamespace(used=7 << 30))

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle):
        return self._answer("reasons", 0x1 | 0x4)


@pytest.fixture
def fake_nvml(monkeypatch):
    def install(failing=()):
        nvml._init.cache_clear()
        monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(failing))
        monkeypatch.setitem(sys.modules, "cupy", None)  # NVML's device 0, not CuPy's bus id
    yield install
    nvml._init.cache_clear()


def test_nvml_snapshot_reads_every_field(fake_nvml):
    fake_nvml()
    snap = nvml.snapshot()
    assert snap == {"sm_clock_mhz": 1980, "mem_clock_mhz": 3201, "power_w": 351.5,
                    "memory_used_bytes": 7 << 30, "reasons": ["sw_power_cap", "gpu_idle"],
                    "throttled": True, "unavailable": {}}


def test_nvml_snapshot_names_what_nvml_cannot_give(fake_nvml):
    fake_nvml(failing={"power", "reasons"})
    snap = nvml.snapshot()
    assert snap["power_w"] is None and snap["throttled"] is None and snap["reasons"] == []
    assert snap["sm_clock_mhz"] == 1980
    assert set(snap["unavailable"]) == {"power_w", "reasons", "throttled"}
    assert "nvmlDeviceGetPowerUsage: Not Supported" in snap["unavailable"]["power_w"]


def test_nvml_snapshot_without_nvml(fake_nvml):
    fake_nvml(failing={"nvmlInit"})
    snap = nvml.snapshot()
    assert snap["sm_clock_mhz"] is None and snap["reasons"] == []
    assert "nvmlInit: Not Supported" in snap["unavailable"]["all"]


def test_throttle_reasons():
    assert nvml._reasons(0x1) == (["gpu_idle"], False)
    names, throttled = nvml._reasons(0x4 | 0x40)
    assert throttled and set(names) == {"sw_power_cap", "hw_thermal"}


def test_gpm_bytes_from_full_scale():
    window = nvml.GpmWindow(dram_util_pct=50.0, seconds=0.5)
    assert window.bytes(full_scale_gbs=5000.0) == pytest.approx(1.25e12)


def test_ceilings_unavailable_on_cpu_backend():
    from questprof.backends.numpy import NumpyBackend

    result = ceilings.measure_ceilings(NumpyBackend())
    assert result["available"] is False and "CPU" in result["reason"]
    assert result["read_gbs"] is None


def test_datasheet_table():
    assert ceilings.datasheet("NVIDIA H200") == (4800.0, 989.4)
    assert ceilings.datasheet("NVIDIA H100 PCIe")[0] == 2000.0
    assert ceilings.datasheet("NVIDIA H100 80GB HBM3")[0] == 3350.0
    assert ceilings.datasheet("Some Future GPU") == (None, None)


def test_cupti_interval_bounds_samples():
    assert cupti._interval(0.01) == cupti.INTERVAL_NS
    long = cupti._interval(10.0)
    assert 10.0 * 1e9 / long < cupti.MAX_SAMPLES / 2


def test_a_window_longer_than_one_decode_holds_is_an_error_not_a_lost_count():
    """The process samples at its first window's interval: a window of more intervals than
    MAX_SAMPLES says so (it would decode only the first MAX_SAMPLES samples)."""
    assert cupti.check_span(0.5, cupti.INTERVAL_NS) == 0.5
    too_long = (cupti.MAX_SAMPLES + 1) * cupti.INTERVAL_NS * 1e-9
    with pytest.raises(cupti.CuptiError, match="one decode holds"):
        cupti.check_span(too_long, cupti.INTERVAL_NS)


def test_cupti_error_text_keeps_status():
    class Fake(Exception):
        status = 99999

    assert "99999" in cupti._text(Fake("boom"))
    with pytest.raises(cupti.CuptiError, match="CUPTI decode"):
        cupti._check("decode", lambda: (_ for _ in ()).throw(Fake("boom")))


class FakeCollector:
    """cupti.pm_sampling.Collector that records its calls; `fails` names the one that raises."""

    calls: list = []
    fails: str | None = None

    def __init__(self, device_index):
        self.calls.clear()

    def _step(self, name, value=None):
        self.calls.append(name)
        if name == self.fails:
            raise RuntimeError(f"{name}: CUPTI_ERROR_INVALID_PARAMETER")
        return value

    def enable(self):
        return self._step("enable")

    def disable(self):
        return self._step("disable")

    def configure(self, **kwargs):
        return self._step("configure")

    def start(self):
        return self._step("start")

    def stop(self):
        return self._step("stop")

    def decode(self, max_samples):
        type(self).provisioned = max_samples
        return self._step("decode", Samples())


class Samples(list):
    """A decoded window with no samples."""

    num_populated_samples = num_completed_samples = 0


@pytest.fixture
def fake_cupti(monkeypatch):
    """A visible device (fake CuPy) and a fake cupti-python; no torch to initialise CUDA."""
    install_fake_cupti(monkeypatch, FakeCollector)
    yield FakeCollector
    FakeCollector.fails = None
    cupti._collector.cache_clear()


def test_cupti_available_runs_a_real_session(fake_cupti):
    assert cupti.available() == (True, None)
    assert fake_cupti.calls == ["enable", "configure", "start", "stop", "decode"]


def test_decode_provisions_the_window_not_the_maximum():
    """A 30 ms window at 100 us needs ~300 samples: provision twice that, not MAX_SAMPLES (whose
    counter image cost 28 ms a decode), and never fewer than the window spanned."""
    assert 600 <= cupti.decode_samples(0.030, 100_000) <= 700
    assert cupti.decode_samples(60.0, 100_000) == cupti.MAX_SAMPLES
    assert cupti.decode_samples(0.0, 100_000) >= 64


def test_a_window_decodes_with_its_own_sample_count(fake_cupti):
    cupti.measure(lambda: None, 3, 0.01, cupti.IdleRate(0.0, 0.0))
    assert 64 <= fake_cupti.provisioned < cupti.MAX_SAMPLES


def test_cupti_available_reports_a_failing_configure(fake_cupti):
    fake_cupti.fails = "configure"
    works, why = cupti.available()
    assert not works
    assert why.startswith("CUPTI configure: ") and "CUPTI_ERROR_INVALID_PARAMETER" in why


def test_stage_fixture_against_the_model():
    """ncu on the CuPy stages, llama3-8b L=16K B=1 S=16 budget 1024 per-head (H200, 2026)."""
    from questprof.core import model
    from questprof.core.config import Config
    from questprof.core.scenarios import load_scenario

    groups = ncu.split_by_marker(
        ncu.parse_csv((FIXTURES / "ncu_stages_h200.csv").read_text()), "ceilings_read")
    assert [len(g) for g in groups] == [1, 1, 2, 2]  # estimate, topk, attention+merge, dense+merge
    work = model.stage_work(Config(load_scenario("llama3-8b").model, 16384, 1, 16, 1024))
    read = lambda g: sum(k.read_bytes for k in g)  # noqa: E731
    estimate, dense = work["estimate"], work["dense"]
    assert abs(read(groups[0]) / estimate.total_read - 1) < 0.01  # measured +0.68%
    assert abs(read(groups[3][:1]) / dense.total_read - 1) < 0.002  # attention kernel: +0.08%


@pytest.mark.gpu
@pytest.mark.parametrize("n4", [1, 7, 270_336 * 4 + 5, 2_097_152, 2_097_152 + 3])
def test_read_kernel_reaches_every_float4(gpu, rng, n4):
    """The read kernel's sink fires only when one thread's sum is the magic value: a lone magic
    float at a position proves that position was read (the main loop and the rest alike)."""
    import cupy
    magic = np.float32(1.2345e30)
    for at in {0, n4 - 1, int(rng.integers(n4)), int(rng.integers(n4))}:
        x = cupy.zeros(4 * n4, dtype=cupy.float32)
        x[4 * at + int(rng.integers(4))] = magic
        sink = cupy.zeros(1, dtype=cupy.float32)
        ceilings.launch_read(x, sink)
        assert float(sink[0]) == magic, f"float4 {at} of {n4} was not read"


@pytest.mark.gpu
def test_read_ladder_is_plausible(gpu):
    """Plain reads of 16 and 64 MiB: more bytes take longer, and no read beats the datasheet."""
    ladder = ceilings.read_ladder(gpu, 60 << 20, sizes=(64 << 20, 16 << 20), repeats=5, tries=2)
    assert [n for n, _ in ladder] == [16 << 20, 64 << 20]
    (n0, t0), (n1, t1) = ladder
    assert 0 < t0 < t1
    sheet = ceilings.datasheet(_gpu_name())[0] or 10_000.0
    assert all(100.0 < n / (ms * 1e-3) / 1e9 <= 1.02 * sheet for n, ms in ladder)


def _gpu_name() -> str:
    import cupy
    name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
    return name.decode() if isinstance(name, bytes) else name


def test_ladder_interpolates_between_rungs():
    ladder = [(100, 2.0), (200, 3.0), (400, 5.0)]  # t = 1 + n / 100 ms
    assert ceilings.ladder_ms(ladder, 100) == 2.0
    assert ceilings.ladder_ms(ladder, 150) == pytest.approx(2.5)
    assert ceilings.ladder_ms(ladder, 300) == pytest.approx(4.0)
    assert ceilings.ladder_ms(ladder, 800) == pytest.approx(9.0)  # last segment extended
    assert ceilings.ladder_ms(ladder, 99) is None  # below the first rung: unknown
    assert ceilings.ladder_ms([(100, 2.0)], 300) == pytest.approx(6.0)
    assert ceilings.ladder_ms([], 300) is None


def test_git_commit_can_be_named_for_a_copied_tree(monkeypatch):
    from questprof.core import machine

    monkeypatch.setenv("QUESTPROF_GIT_COMMIT", "abc123")
    assert machine.git_commit() == "abc123"
    monkeypatch.delenv("QUESTPROF_GIT_COMMIT")
    assert machine.git_commit() != "abc123"


def test_a_failed_ncu_run_says_its_exception_not_the_middle_of_a_traceback():
    output = ("==PROF== Connected\nTraceback (most recent call last):\n  File \"x.py\", line 3\n"
              + "    frame\n" * 50 + "cupy_backends.cuda.api.runtime.CUDARuntimeError: "
              "cudaErrorMemoryAllocation: out of memory\n==ERROR== The application returned "
              "an error code (1).\n")
    text = ncu.failure_text(output)
    assert "cudaErrorMemoryAllocation: out of memory" in text
    assert "==ERROR== The application returned an error code (1)." in text
    assert "frame" not in text
    assert ncu.failure_text("") == "no output"
