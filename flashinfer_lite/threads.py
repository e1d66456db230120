"""How many of Numba's threads a decode step uses: the thread policy, in one place.

The pools themselves are configured in flashinfer_lite/__init__.py (before numba loads: OpenMP first, one OpenBLAS
thread, a short spin). This module sets Numba's thread count (`set_threads`, what -t asks for) and, per decode step,
chooses among fewer (`StepThreads`).

Why choose per step: a decode step is ~90 parallel regions (per layer the q/k/v and o GEMVs and the FFN, then lm_head)
and each ends when its slowest thread does. When another process takes a core, a thread of ours waits in the run queue
for the scheduler's next slice (EEVDF: ~1-3 ms) and every region waits with it: beside one spinning process SmolLM2 in
RAM decodes several times slower on 2 threads than on 1 (bench/busy_decode.py measures it, bench/README.md "Decode on
a busy machine"). Which count is faster depends on what else runs, and that changes while we run, so it is measured,
not guessed: the step times at the chosen count against a few steps at another, now and then, the probes spaced out
exponentially while the choice holds. The run queue (the machine's runnable tasks besides this process's,
/proc/loadavg's fourth field less our own threads in state R, read at each step's start) says where to start: on the
most threads it shows free cores for, else on one, since on a busy machine a step on two threads costs many times more
than on one (while idle it costs less) and one lost step is cheap to find. A probe alternates its steps with the
chosen count's and compares each with the one just before it, so a load that comes or goes during the probe weighs on
both sides alike. Each probe step votes for the faster side (SWITCH_RATIO), the run queue casts the first vote (for
the count nearer the one it shows free cores for), and a majority of PROBE_STEPS votes decides: when the two agree,
one probe step settles it; one slow step alone does not (a probe ended by one slow step would leave a quiet machine on
one thread until the next probe, tens of steps later). When the run queue's median over the recent steps moves to
another count, that count is probed at the next step, so load that comes or goes is followed within a few steps, not
after the probe's back-off.
A count's first step loads that count's kernels from Numba's cache (5 kernels, several steps' time for SmolLM2): the
time spent in Numba's compiler lock does not count. A probe step that runs slow goes back to the chosen count at its
next layer, and a probe of more threads is skipped while this thread itself waits in the run queue for a sizeable
share of its steps (its schedstat): the cores are taken, and a second thread of ours would wait too. The threads
change no bits (every kernel's work split is a constant, not the thread count), so the choice can change at any step.
"""
from __future__ import annotations

import os
import statistics
import threading
import time
from collections import Counter, deque
from contextlib import contextmanager

import numba
import numba.core.event
import numba.np.ufunc.parallel
import numpy as np

PROBE_STEPS = 3        # votes per probe of another thread count, a majority decides: the run queue's, then each probe
                       # step's (alternating with the chosen count's)
FIRST_PERIOD = 16      # steps at a newly chosen count before another is probed
MAX_PERIOD = 512       # after a probe that lost, twice the gap before (at least 2 * FIRST_PERIOD), up to this
ABORT_RATIO = 1.5      # a probe step this much slower than the chosen count's median goes back to it at the next layer
SWITCH_RATIO = 0.95    # a probe step votes for its count when it takes at most this share of the chosen count's step
                       # just before it
HISTORY = 8            # recent steps per count, for their median
RUN_QUEUE_SHARE = 0.2  # no probe of more threads while this thread waited in the run queue for this share of its steps


def step_counts(most: int) -> list[int]:
    """The thread counts a decode step may run on when at most `most` are allowed: 1, most // 2 and most."""
    return sorted({most, max(1, most // 2), 1})


@contextmanager
def beside_reads(engine: str):
    """Numba's thread count while a reader's requests are in flight. The thread engine's reader threads issue and
    complete the reads on the CPU: one compute thread, so that a core stays free for them. The io_uring engine has no
    threads (the kernel completes its reads; the submitting thread refills the ring when it calls in), so compute
    keeps every thread the step has."""
    if engine != "threads":
        yield
        return
    n = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        yield
    finally:
        numba.set_num_threads(n)


_get_num_threads = None


def numba_threads() -> int:
    """numba.get_num_threads(), without its two locks on every call (~6 us, and a decode step asks ~60 times whether
    a GEMV should run parallel): the pool's own count function once the pool is up."""
    global _get_num_threads
    if _get_num_threads is None:
        n = numba.get_num_threads()                    # launches the pool
        _get_num_threads = getattr(numba.np.ufunc.parallel, "_get_num_threads", None) or numba.get_num_threads
        return n
    return _get_num_threads()


def set_threads(threads: int | None) -> None:
    """Numba's thread count for this Python thread (numba's count is per thread): -t, at most the pool's size."""
    if threads:
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))


class _CompilerLock(numba.core.event.Listener):
    """Seconds spent so far in Numba's compiler lock: loading kernels from its cache, or compiling them."""

    def __init__(self):
        self.seconds, self._depth, self._t0 = 0.0, 0, 0.0

    def on_start(self, event):
        if self._depth == 0:
            self._t0 = time.perf_counter()
        self._depth += 1

    def on_end(self, event):
        self._depth -= 1
        if self._depth == 0:
            self.seconds += time.perf_counter() - self._t0


_compiler_lock: _CompilerLock | None = None


def compiling_seconds() -> float:
    """Seconds this process has spent loading or compiling Numba kernels since its first call."""
    global _compiler_lock
    if _compiler_lock is None:
        _compiler_lock = _CompilerLock()
        numba.core.event.register("numba:compiler_lock", _compiler_lock)
    return _compiler_lock.seconds


class StepThreads:
    """The thread count of each decode step, chosen by timing the steps (the module's docstring says why).

    `most` is the thread count in force when the first step runs (-t); the candidates are 1, most // 2 and most.
    Around each step, `with step_threads.step():` sets the chosen (or probed) count and restores `most` after, so a
    prompt between decode steps runs on every thread."""

    def __init__(self, choose: bool = True):
        self.choose = choose                    # False: every step on `most` threads (no probes)
        self.most: int | None = None
        self.cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        self.counts: list[int] = []
        self.recent: dict[int, deque] = {}
        self.chosen = 0
        self.period = PROBE_STEPS          # the first probe comes once the chosen count has a median
        self.until_probe = PROBE_STEPS
        self.probing: int | None = None
        self.probe: list[float] = []            # the probe's steps
        self.votes = [0, 0]                     # while probing: votes for [the chosen count, the probed count]
        self.probe_turn = False                 # while probing: the next step runs at the probed count
        self.next_alt = 0
        self.switches = 0
        self.steps: Counter = Counter()              # decode steps run at each thread count
        self.queued: deque = deque(maxlen=HISTORY)   # share of each recent step this thread spent in the run queue
        self.others: deque = deque(maxlen=HISTORY)   # others' runnable tasks at each recent step's start
        self.fitting: int | None = None              # the count the run queue said fits, as of the last step
        self._schedstat: tuple[int, int] | None = None     # (native thread id, fd of its schedstat)
        self._loadavg: int | None = None                   # fd of /proc/loadavg (-1: none here)
        self._tasks: dict[str, int] = {}                   # this process's threads: fd of each one's /proc stat
        self._deadline: float | None = None   # perf_counter() past which a probe step goes back to the chosen count
        self._compiling0 = 0.0                # compiling_seconds() at the step's start
        self._cut = False

    def _start(self, others: int | None) -> None:
        """The counts to choose from, and the first: the most whose cores the run queue shows free (`others` runnable
        tasks besides this process's at the first step; None, unknown: one thread)."""
        self.most = numba.get_num_threads()
        self.counts = step_counts(self.most) if self.choose else [self.most]
        self.recent = {c: deque(maxlen=HISTORY) for c in self.counts}
        if others is not None:
            self.others.append(others)
        self.chosen = self.fitting = self.fits()

    def fits(self) -> int:
        """The most threads that the run queue shows cores for (the median of `others` over the recent steps), at
        least the fewest count; the fewest when it is not known."""
        if not self.others:
            return self.counts[0]
        free = self.cores - statistics.median(self.others)     # np.median: 10 us a step, this 1
        return max([c for c in self.counts if c <= free], default=self.counts[0])

    def _queued_ns(self) -> int | None:
        """Nanoseconds this thread has waited in the run queue (Linux schedstat's second field), None elsewhere."""
        tid = threading.get_native_id()
        if self._schedstat is None or self._schedstat[0] != tid:
            if self._schedstat is not None:
                os.close(self._schedstat[1])
            try:
                self._schedstat = (tid, os.open(f"/proc/self/task/{tid}/schedstat", os.O_RDONLY))
            except OSError:
                self._schedstat = (tid, -1)
        if self._schedstat[1] < 0:
            return None
        return int(os.pread(self._schedstat[1], 64, 0).split()[1])

    def _others_running(self) -> int | None:
        """Runnable tasks on the machine besides this process's (Linux /proc/loadavg's fourth field, less this
        process's threads in state R: the pool's threads spin ~1 ms after a parallel region, so after a prompt or a
        step on two threads one of ours is still counted), None elsewhere."""
        if self._loadavg is None:
            try:
                self._loadavg = os.open("/proc/loadavg", os.O_RDONLY)
            except OSError:
                self._loadavg = -1
        if self._loadavg < 0:
            return None
        others = int(os.pread(self._loadavg, 128, 0).split()[3].split(b"/")[0]) - 1
        return max(0, others - self._ours_running()) if others > 0 else 0

    def _ours_running(self) -> int:
        """This process's threads in state R, this one aside (each one's /proc stat, its fd kept while it lives)."""
        me, tids, n = str(threading.get_native_id()), set(os.listdir("/proc/self/task")), 0
        for tid in self._tasks.keys() - tids:
            os.close(self._tasks.pop(tid))
        for tid in tids - {me}:
            try:
                if tid not in self._tasks:
                    self._tasks[tid] = os.open(f"/proc/self/task/{tid}/stat", os.O_RDONLY)
                stat = os.pread(self._tasks[tid], 512, 0)
            except OSError:                            # the thread ended meanwhile
                continue
            n += stat[stat.rindex(b")") + 2:stat.rindex(b")") + 3] == b"R"
        return n

    @property
    def current(self) -> int:
        return self.probing if self.probing is not None and self.probe_turn else self.chosen

    @contextmanager
    def step(self, model=None):
        """One decode step. With `model` (a Transformer), a probe step that has already taken ABORT_RATIO times the
        chosen count's median goes back to the chosen count at its next layer (model.after_layer), so a probe on a
        busy machine costs that much, not a whole step of stalled regions. Time in Numba's compiler lock (a count's
        first step loads its kernels) counts neither here nor in the step's time."""
        others = self._others_running()
        if self.most is None:
            self._start(others)
            others = None                     # counted by _start
        count = self.current
        numba.set_num_threads(count)
        q0, c0, t0 = self._queued_ns(), compiling_seconds(), time.perf_counter()
        self._compiling0 = c0
        self._deadline = None
        if count != self.chosen:
            self._deadline = t0 + ABORT_RATIO * float(np.median(self.recent[self.chosen])) / 1e3
        self._cut = False
        if model is not None:
            model.after_layer = self._after_layer
        try:
            yield
        finally:
            numba.set_num_threads(self.most)
            if model is not None:
                model.after_layer = None
        wall, q1 = (time.perf_counter() - t0) * 1e3, self._queued_ns()
        ms = wall - (compiling_seconds() - c0) * 1e3
        if q1 is not None and count == self.chosen:
            self.queued.append((q1 - q0) / 1e6 / max(wall, 1e-3))
        self.record(count, ms, cut=self._cut, others=others)

    def _after_layer(self) -> None:
        if self._deadline is None:
            return
        if time.perf_counter() - (compiling_seconds() - self._compiling0) > self._deadline:
            numba.set_num_threads(self.chosen)
            self._deadline, self._cut = None, True

    def record(self, count: int, ms: float, cut: bool = False, others: int | None = None) -> None:
        """One decode step at `count` threads took `ms` (cut: a probe step sent back to the chosen count midway;
        others: runnable tasks besides this process's at its start, None if unknown): keep it, and move the probe
        schedule on."""
        self.steps[count] += 1
        if len(self.counts) < 2:
            return
        if others is not None:
            self.others.append(others)
        fitting, moved = self.fits(), False
        if fitting != self.fitting:                   # the run queue changed its mind: probe its count soon
            self.fitting, moved = fitting, fitting != self.chosen
        base = self.recent[self.chosen]
        if count == self.chosen:
            base.append(ms)
            if self.probing is not None:
                self.probe_turn = True
                return
            self.until_probe = 0 if moved and len(base) else self.until_probe - 1
            if self.until_probe <= 0:
                self._start_probe()
            return
        self.probe_turn = False                       # the next step runs at the chosen count
        self.probe.append(ms)
        self.votes[not cut and ms <= SWITCH_RATIO * base[-1]] += 1
        if max(self.votes) > PROBE_STEPS // 2:
            self._end_probe(switch=self.votes[1] > self.votes[0])

    def _start_probe(self) -> None:
        """Probe the count the run queue fits, else the next other count. The run queue casts the first vote: for
        the count nearer the one it fits."""
        others = [c for c in self.counts if c != self.chosen]
        if self.fitting != self.chosen:
            self.probing = self.fitting
        else:
            self.probing = others[self.next_alt % len(others)]
            self.next_alt += 1
        self.probe, self.probe_turn = [], True
        if self.probing > self.chosen and self.queued and float(np.median(self.queued)) > RUN_QUEUE_SHARE:
            self._end_probe(switch=False)     # the cores are taken: more threads would queue too
            return
        self.votes = [0, 0]
        if self.others:
            self.votes[abs(self.probing - self.fitting) < abs(self.chosen - self.fitting)] += 1

    def _end_probe(self, switch: bool) -> None:
        if switch:
            self.chosen = self.probing
            self.recent[self.chosen].clear()
            self.recent[self.chosen].extend(self.probe)
            self.period = FIRST_PERIOD
            self.switches += 1
        else:
            self.period = min(max(2 * self.period, 2 * FIRST_PERIOD), MAX_PERIOD)
        self.until_probe = self.period
        self.probing = None
        self.probe_turn = False
