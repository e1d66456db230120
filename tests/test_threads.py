"""The decode step's thread count (flashinfer_lite/threads.py): the choice follows the measured step times."""
import numba
import numba.core.event
import pytest

from flashinfer_lite import threads as T


def tuner(most=2):
    """A StepThreads as its first step finds Numba at `most` threads (-t)."""
    st = T.StepThreads()
    before = numba.get_num_threads()
    numba.set_num_threads(min(most, numba.config.NUMBA_NUM_THREADS))
    try:
        st._start()
    finally:
        numba.set_num_threads(before)
    return st


def test_a_step_runs_on_one_thread_first_and_restores_the_count_after():
    st = T.StepThreads()
    before = numba.get_num_threads()
    try:
        with st.step():
            assert numba.get_num_threads() == 1
        assert numba.get_num_threads() == st.most == before    # a prompt after it runs on every thread
    finally:
        numba.set_num_threads(before)


def run(st, ms_at: dict, steps: int) -> list[int]:
    """`steps` decode steps, each taking ms_at[count]; the counts they ran at."""
    used = []
    for _ in range(steps):
        c = st.current
        used.append(c)
        st.record(c, ms_at[c])
    return used


needs_two = pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs 2 Numba threads")


@needs_two
def test_idle_machine_moves_to_more_threads_and_still_probes_one_now_and_then():
    st = tuner()
    used = run(st, {1: 20.0, 2: 12.0}, 600)
    assert st.chosen == 2 and st.switches == 1
    first_two = used.index(2)
    assert used[first_two:first_two + 2 * T.PROBE_STEPS] == [2, 1] * (T.PROBE_STEPS - 1) + [2, 2]   # alternating
    probes = [i for i in range(first_two + 2 * T.PROBE_STEPS, len(used)) if used[i] == 1]
    assert len(probes) >= 2                                  # it keeps checking, with growing gaps
    assert probes[-1] - probes[0] > 2 * T.FIRST_PERIOD


@needs_two
def test_load_that_comes_during_a_probe_weighs_on_both_sides():
    # steps alternate, so a step time that doubles halfway through the probe does not make two threads look slower
    st = tuner()
    run(st, {1: 20.0, 2: 12.0}, T.PROBE_STEPS + 2)           # the median, the probe's first step at two threads
    assert st.probing == 2
    run(st, {1: 40.0, 2: 24.0}, 2 * T.PROBE_STEPS)
    assert st.chosen == 2


@needs_two
def test_busy_machine_stays_on_one_thread_and_a_slow_probe_ends_after_one_step():
    st = tuner()
    used = run(st, {1: 25.0, 2: 300.0}, 200)
    assert st.chosen == 1 and st.switches == 0
    twos = [i for i, c in enumerate(used) if c == 2]
    assert twos and all(b - a > 1 for a, b in zip(twos, twos[1:]))    # each probe cut short after its first step
    assert len(twos) <= 5                                               # spaced out: after 3, 32, 64, 128 ... steps


@needs_two
def test_load_arriving_later_moves_back_to_one_thread():
    st = tuner()
    run(st, {1: 20.0, 2: 12.0}, 50)
    assert st.chosen == 2
    run(st, {1: 25.0, 2: 300.0}, 600)
    assert st.chosen == 1


@needs_two
def test_no_probe_of_more_threads_while_this_thread_waits_in_the_run_queue():
    st = tuner()
    st.queued.extend([0.5] * T.HISTORY)          # half of each step spent waiting for a core
    used = run(st, {1: 25.0, 2: 10.0}, 100)
    assert used == [1] * 100 and st.chosen == 1


def test_one_thread_has_nothing_to_choose():
    st = tuner(most=1)
    assert run(st, {1: 20.0}, 50) == [1] * 50


@needs_two
@pytest.mark.parametrize("engine, inside", [("threads", 1), ("io_uring", 2)])
def test_compute_beside_reads_leaves_a_core_to_reader_threads_only(engine, inside):
    before = numba.get_num_threads()
    numba.set_num_threads(2)
    try:
        with T.beside_reads(engine):
            assert numba.get_num_threads() == inside
        assert numba.get_num_threads() == 2
    finally:
        numba.set_num_threads(before)


class Layers:
    """A stand-in for Transformer.forward_rows: calls after_layer (as the model does) after each of its layers, each
    layer taking `ms` of fake time (the first `loading` layers also `loading_ms` in Numba's compiler lock, as a
    count's first step loads its kernels); records Numba's thread count per layer."""

    def __init__(self, clock, ms: float, n: int = 10):
        self.after_layer, self.clock, self.ms, self.n, self.threads = None, clock, ms, n, []
        self.loading, self.loading_ms = 0, 0.0

    def forward(self):
        for i in range(self.n):
            self.threads.append(numba.get_num_threads())
            if i < self.loading:
                numba.core.event.start_event("numba:compiler_lock")
                self.clock[0] += self.loading_ms / 1e3
                numba.core.event.end_event("numba:compiler_lock")
            self.clock[0] += self.ms / 1e3
            if self.after_layer is not None:
                self.after_layer()


def steps_until_probe(st, layers):
    while st.current == st.chosen:
        with st.step(layers):
            layers.forward()


@needs_two
def test_a_slow_probe_step_goes_back_to_one_thread_at_its_next_layer(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(T.time, "perf_counter", lambda: clock[0])
    st = tuner()
    fast, slow = Layers(clock, 2.0), Layers(clock, 40.0)      # steps of 20 ms on one thread, 400 ms on two
    steps_until_probe(st, fast)
    assert fast.after_layer is None                          # the hook is the step's only
    with st.step(slow):
        slow.forward()
    # over 1.5 x 20 ms after its first layer: the rest of the step ran on the chosen count
    assert slow.threads == [2] + [1] * 9
    assert st.current == 1 and st.chosen == 1 and numba.get_num_threads() == st.most


@needs_two
def test_time_loading_kernels_does_not_count(monkeypatch):
    # the first step at a count loads its kernels (here 3 layers of 40 ms, against steps of 20 ms on one thread and
    # 12 on two): neither cut nor judged by it, an idle machine moves to two threads at the first probe
    clock = [0.0]
    monkeypatch.setattr(T.time, "perf_counter", lambda: clock[0])
    st = tuner()
    one, two = Layers(clock, 2.0), Layers(clock, 1.2)
    one.loading = two.loading = 3
    one.loading_ms = two.loading_ms = 40.0
    steps_until_probe(st, one)
    assert max(st.recent[1]) == pytest.approx(20.0)        # the steps' 140 ms counted as 20
    with st.step(two):
        two.forward()
    assert two.threads == [2] * 10 and st.probe == [pytest.approx(12.0)]    # not cut, not slower
    two.loading = 0
    while st.probing is not None:
        layers = two if st.current == 2 else one
        with st.step(layers):
            layers.forward()
    assert st.chosen == 2 and st.switches == 1


@needs_two
def test_a_session_can_keep_every_step_on_its_thread_count():
    before = numba.get_num_threads()
    numba.set_num_threads(2)
    try:
        st = T.StepThreads(choose=False)
        for _ in range(40):
            with st.step():
                assert numba.get_num_threads() == 2
        assert st.steps == {2: 40}
    finally:
        numba.set_num_threads(before)
