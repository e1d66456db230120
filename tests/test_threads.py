"""The decode step's thread count (flashinfer_lite/threads.py): the choice follows the measured step times, and
the run queue (other runnable tasks) decides where to start and casts the first vote of each probe."""
import numba
import numba.core.event
import pytest

from flashinfer_lite import threads as T


def tuner(most=2, others=None, cores=2):
    """A StepThreads as its first step finds Numba at `most` threads (-t), `others` runnable tasks besides this
    process's (None: unknown, as off Linux) on `cores` cores."""
    st = T.StepThreads()
    st.cores = cores
    before = numba.get_num_threads()
    numba.set_num_threads(min(most, numba.config.NUMBA_NUM_THREADS))
    try:
        st._start(others)
    finally:
        numba.set_num_threads(before)
    return st


@pytest.mark.parametrize("others, first", [(1, 1), (0, 2)])
def test_a_step_starts_on_the_threads_the_run_queue_has_cores_for_and_restores_the_count_after(monkeypatch, others,
                                                                                               first):
    before = numba.get_num_threads()
    if first > before:
        pytest.skip("needs 2 Numba threads")
    st = T.StepThreads()
    st.cores = 2
    monkeypatch.setattr(st, "_others_running", lambda: others)
    try:
        with st.step():
            assert numba.get_num_threads() == first
        assert numba.get_num_threads() == st.most == before    # a prompt after it runs on every thread
    finally:
        numba.set_num_threads(before)


def run(st, ms_at, steps: int, others=None) -> list[int]:
    """`steps` decode steps, each taking ms_at[count] (or ms_at(step, count)), `others` runnable tasks besides this
    process's at each step's start (or others(step)); the counts they ran at."""
    used = []
    for i in range(steps):
        c = st.current
        used.append(c)
        st.record(c, ms_at(i, c) if callable(ms_at) else ms_at[c], others=others(i) if callable(others) else others)
    return used


needs_two = pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs 2 Numba threads")


QUIET, BUSY = {1: 10.3, 2: 7.2}, {1: 10.3, 2: 30.0}    # ms per step of SmolLM2 Q4_K_M, idle and beside a spinner


@needs_two
def test_idle_machine_starts_on_two_threads_and_stays_there():
    st = tuner(others=0)
    used = run(st, QUIET, 64, others=0)
    assert used[:T.PROBE_STEPS] == [2] * T.PROBE_STEPS and st.chosen == 2 and st.switches == 0
    # each probe of one thread is a single step: the run queue's vote and the step's agree
    assert used.count(1) == 2 and used[T.PROBE_STEPS] == 1 and used[T.PROBE_STEPS + 1] == 2


@needs_two
def test_without_the_run_queue_an_idle_machine_moves_to_more_threads_and_still_probes_one_now_and_then():
    st = tuner()
    used = run(st, {1: 20.0, 2: 12.0}, 600)
    assert st.chosen == 2 and st.switches == 1
    first_two = used.index(2)
    assert first_two == T.PROBE_STEPS
    assert used[first_two:first_two + 4] == [2, 1, 2, 2]     # alternating; two votes of three decide
    probes = [i for i in range(first_two + 3, len(used)) if used[i] == 1]
    assert len(probes) >= 2                                  # it keeps checking, with growing gaps
    assert probes[-1] - probes[0] > 2 * T.FIRST_PERIOD


@needs_two
def test_one_slow_step_does_not_decide_a_probe():
    # without the run queue (as off Linux) the first probe of two threads meets a step that something else slowed
    # down (page faults, another process's burst): the next two probe steps outvote it
    st = tuner()
    first_probe = T.PROBE_STEPS
    used = run(st, lambda i, c: 40.0 if i == first_probe else QUIET[c], 64)
    assert used[first_probe:first_probe + 6] == [2, 1, 2, 1, 2, 2] and st.chosen == 2 and st.switches == 1


@needs_two
def test_one_slow_step_before_a_probe_does_not_decide_it():
    # on two threads, the step just before the first probe of one thread runs slow, so that probe step looks faster:
    # the run queue's vote (its cores are free) and the next probe step outvote it
    st = tuner(others=0)
    used = run(st, lambda i, c: 40.0 if i == T.PROBE_STEPS - 1 else QUIET[c], 64, others=0)
    assert used[T.PROBE_STEPS:T.PROBE_STEPS + 4] == [1, 2, 1, 2] and st.chosen == 2 and st.switches == 0


@needs_two
def test_load_that_comes_during_a_probe_weighs_on_both_sides():
    # steps alternate, so a step time that doubles halfway through the probe does not make two threads look slower
    st = tuner()
    run(st, {1: 20.0, 2: 12.0}, T.PROBE_STEPS + 2)           # the median, the probe's first step at two threads
    assert st.probing == 2
    run(st, {1: 40.0, 2: 24.0}, 2 * T.PROBE_STEPS)
    assert st.chosen == 2


@needs_two
@pytest.mark.parametrize("others, per_probe", [(1, 1), (None, 2)])
def test_busy_machine_stays_on_one_thread_and_a_probe_ends_after_its_first_lost_steps(others, per_probe):
    # with the run queue showing the cores taken its vote and the first lost step end a probe; without it, two
    st = tuner(others=others)
    used = run(st, BUSY, 200, others=others)
    assert used[0] == 1 and st.chosen == 1 and st.switches == 0
    twos = [i for i, c in enumerate(used) if c == 2]
    runs = [len(twos[i::per_probe]) for i in range(per_probe)]
    assert twos and len(twos) % per_probe == 0 and len(set(runs)) == 1
    assert all(twos[k + per_probe] - twos[k + per_probe - 1] > 2 for k in range(0, len(twos) - per_probe, per_probe))
    assert len(twos) <= 4 * per_probe                          # spaced out: after 3, 32, 64, 128 ... steps


@needs_two
@pytest.mark.parametrize("others_before, others_after", [(None, None), (0, 1)])
def test_load_arriving_later_moves_back_to_one_thread(others_before, others_after):
    st = tuner(others=others_before)
    run(st, QUIET, 50, others=others_before)
    assert st.chosen == 2
    used = run(st, BUSY, 600, others=others_after)
    assert st.chosen == 1
    if others_after is not None:                             # the run queue's change starts a probe at once
        assert used.index(1) <= T.HISTORY
        twos = [i for i, c in enumerate(used) if c == 2 and i > T.HISTORY]
        assert len(twos) <= 5 and all(b - a > 1 for a, b in zip(twos, twos[1:]))   # after 16, 32, 64 ... steps


@needs_two
def test_load_leaving_moves_to_two_threads_within_a_few_steps():
    st = tuner(others=1)
    run(st, BUSY, 40, others=1)
    assert st.chosen == 1
    used = run(st, QUIET, 64, others=0)                      # the next probe by the schedule would be 32+ steps on
    assert st.chosen == 2 and used.index(2) <= T.HISTORY
    assert used[T.HISTORY + 2:].count(1) <= 2                # probes of one thread after 16 and 32 steps, one step each


@needs_two
def test_when_the_run_queue_is_wrong_the_step_times_decide():
    # a free run queue, but one thread is faster (a model too small to split, or a niced process on the other core)
    st = tuner(others=0)
    used = run(st, {1: 5.0, 2: 8.0}, 600, others=0)
    assert used[0] == 2 and st.chosen == 1 and st.switches == 1
    assert used.index(1) == T.PROBE_STEPS and used[T.PROBE_STEPS:T.PROBE_STEPS + 3] == [1, 2, 1]
    # later probes of two threads, backed off (after 16, 32, 64 ... steps): two lost steps outvote the run queue
    twos = [i for i, c in enumerate(used) if c == 2 and i > T.PROBE_STEPS + 2]
    assert len(twos) <= 10 and [b - a for a, b in zip(twos, twos[1:])][::2] == [2] * (len(twos) // 2)


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


@pytest.mark.skipif(not T.os.path.exists("/proc/self/task"), reason="Linux /proc")
def test_the_run_queue_leaves_out_this_process_s_own_running_threads():
    # a thread of ours that spins (as the pool's threads do after a parallel region) is ours, not another task
    import threading
    import time
    st, stop = T.StepThreads(), threading.Event()

    def spin():
        while not stop.is_set():
            pass
    t = threading.Thread(target=spin)
    t.start()
    try:
        seen = [st._ours_running() for _ in range(50) if not time.sleep(0.002)]
        assert str(t.native_id) in st._tasks
    finally:
        stop.set()
        t.join()
    assert max(seen) >= 1                       # the spinning thread (state R)
    assert str(threading.get_native_id()) not in st._tasks                    # never this one
    for _ in range(100):                        # join returns a moment before the kernel removes the thread
        if str(t.native_id) not in T.os.listdir("/proc/self/task"):
            break
        time.sleep(0.01)
    st._ours_running()
    assert str(t.native_id) not in st._tasks    # an ended thread's fd is closed
