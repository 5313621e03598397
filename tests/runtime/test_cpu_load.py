"""Spinning "auto": how busy other processes keep this process's CPUs (runtime/cpu_load.py),
and a Generator that reopens its sessions the other way when that changes, with the same
greedy tokens."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from specedge.runtime import Generator, cpu_load

ALLOW = "session.intra_op.allow_spinning"
PROMPT = "the cat sat on the mat, the cat sat on the"


def allow_spinning(gen: Generator) -> list[str]:
    return [b.session.get_session_options().get_session_config_entry(ALLOW)
            for b in (gen.target, gen.draft)]


@pytest.mark.skipif(not cpu_load.LoadMeter().available, reason="needs Linux /proc/stat")
def test_a_busy_process_counts_as_others_load():
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # let it start
        meter = cpu_load.LoadMeter()
        time.sleep(1.0)
        others = meter.others()
    finally:
        busy.kill()
        busy.wait()
    assert others is not None and others >= 0.5, others  # about one core


@pytest.mark.skipif(not cpu_load.LoadMeter().available, reason="needs Linux /proc/stat")
def test_this_process_own_work_is_not_others_load():
    meter = cpu_load.LoadMeter()
    end = time.monotonic() + 1.0
    n = 0
    while time.monotonic() < end:  # one core of our own work
        n += 1
    others = meter.others()
    assert others is not None and others < 0.5, others


def test_cpu_seconds_reads_the_process_cpus_only(tmp_path):
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal: busy = all but idle and iowait.
    stat.write_text("cpu  900 0 0 9000 0 0 0 0\n"
                    "cpu0 100 10 20 5000 40 1 2 3 0 0\n"
                    "cpu1 700 0 0 4000 0 0 0 0\n"
                    "intr 12345\n")
    tick = cpu_load.os.sysconf("SC_CLK_TCK")
    assert cpu_load.cpu_seconds({0}, str(stat)) == pytest.approx(136 / tick)
    assert cpu_load.cpu_seconds({0, 1}, str(stat)) == pytest.approx(836 / tick)
    assert cpu_load.cpu_seconds({0}, str(tmp_path / "missing")) is None


def test_without_cpu_times_auto_does_not_spin(tmp_path):
    meter = cpu_load.LoadMeter(stat=str(tmp_path / "missing"))
    assert not meter.available and meter.others() is None
    assert cpu_load.first_choice(meter, seconds=0) is False
    assert cpu_load.spin_now(None, spinning=True) is False


def test_the_first_reading_waits_only_for_the_rest_of_its_window():
    """The caller's own work since the meter was made counts as window (the tokenizer
    loads meanwhile): with the window gone by, the first choice does not wait."""
    meter = cpu_load.LoadMeter()
    assert meter.available
    time.sleep(0.25)
    start = time.monotonic()
    cpu_load.first_choice(meter, seconds=0.2)
    assert time.monotonic() - start < 0.1
    meter = cpu_load.LoadMeter()
    start = time.monotonic()
    cpu_load.first_choice(meter, seconds=0.2)
    assert time.monotonic() - start >= 0.19


def test_spinning_follows_the_load_with_two_thresholds():
    busy, quiet = cpu_load.BUSY_CORES, cpu_load.QUIET_CORES
    assert cpu_load.spin_now(0.0, spinning=False) is True
    assert cpu_load.spin_now((busy + quiet) / 2, spinning=True) is True    # stays on
    assert cpu_load.spin_now((busy + quiet) / 2, spinning=False) is False  # stays off
    assert cpu_load.spin_now(busy, spinning=True) is False
    assert cpu_load.spin_now(1.0, spinning=False) is False


class SteadyMeter:
    """A LoadMeter that always reads `others` cores, over windows of `elapsed` seconds."""

    available = True

    def __init__(self, others: float, elapsed: float = 1.0):
        self.value, self.seconds = others, elapsed

    def elapsed(self) -> float:
        return self.seconds

    def others(self) -> float:
        return self.value


def test_a_generator_reopens_its_sessions_when_the_load_changes(tiny_bundle):
    reference = Generator.from_bundle(tiny_bundle, threads=1, spinning=False)
    want = reference.generate(PROMPT, raw=True, max_new_tokens=24).token_ids
    gen = Generator.from_bundle(tiny_bundle, threads=1, spinning="auto")
    assert gen._auto_spinning is not None  # Linux: the meter reads /proc/stat
    gen.spinning = True
    gen._use_models(*gen._auto_spinning.open_models(True))
    assert allow_spinning(gen) == ["1", "1"]

    # Another process takes a core while it generates: read after the generation, the
    # next one runs without spinning.
    gen._auto_spinning.meter = SteadyMeter(1.0)
    result = gen.generate(PROMPT, raw=True, max_new_tokens=24)
    assert result.stats["threads_spinning"] is True
    result = gen.generate(PROMPT, raw=True, max_new_tokens=24)
    assert (gen.spinning, result.stats["threads_spinning"]) == (False, False)
    assert allow_spinning(gen) == ["0", "0"] and result.token_ids == want

    gen._auto_spinning.meter = SteadyMeter(0.0, elapsed=0.1)  # too short to judge
    gen.generate(PROMPT, raw=True, max_new_tokens=8)
    gen.generate(PROMPT, raw=True, max_new_tokens=8)
    assert gen.spinning is False

    gen._auto_spinning.meter = SteadyMeter(0.0)  # the cores are idle again
    gen.generate(PROMPT, raw=True, max_new_tokens=8)
    result = gen.generate(PROMPT, raw=True, max_new_tokens=24, draft_tokens=3)
    assert gen.spinning is True and allow_spinning(gen) == ["1", "1"]
    assert result.token_ids == want


class TurnMeter(SteadyMeter):
    """Another process busy only while the generator waits: the reading that ends a pause
    (at a generation's start) says one core, the one that ends a generation none."""

    def __init__(self):
        super().__init__(0.0)
        self.readings = 0

    def others(self) -> float:
        self.readings += 1
        return 1.0 if self.readings % 2 else 0.0


def test_a_load_between_generations_does_not_reopen_the_sessions(tiny_bundle):
    gen = Generator.from_bundle(tiny_bundle, threads=1, spinning="auto")
    gen.spinning = True
    gen._use_models(*gen._auto_spinning.open_models(True))
    sessions = gen.target.session
    gen._auto_spinning.meter = meter = TurnMeter()
    for _ in range(3):
        assert gen.generate(PROMPT, raw=True, max_new_tokens=8).stats["threads_spinning"]
    assert meter.readings == 6 and gen.target.session is sessions


def test_fixed_spinning_never_follows_the_load(tiny_bundle):
    gen = Generator.from_bundle(tiny_bundle, threads=1, spinning=True)
    assert gen._auto_spinning is None and gen.spinning is True
    assert allow_spinning(gen) == ["1", "1"]
