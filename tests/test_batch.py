"""Batched decoding (serve --parallel): Transformer.forward_batch's rows against one-sequence decode steps, and
generate.DecodeBatch's continuous batching against each sequence's solo answer."""
import threading

import numpy as np
import pytest

from conftest import STORIES

PROMPTS = ["Once upon a time", "The capital of France is", "def fib(n):", "Water boils at"]


_LOADED: dict = {}


def loaded(gguf, ffn: str):
    from flashinfer_lite.runtime import load
    if ffn not in _LOADED:
        _LOADED[ffn] = load(str(gguf), None, ffn, 128, say=False)
    return _LOADED[ffn]


@pytest.fixture(params=["dense", "gate"])
def smollm2(request, smollm2_gguf):
    """The default model (Q4_1 blocks: 8-bit activations) with every weight in DRAM, and with the exact gate's FFN
    from flash (its rows read for the union of the neurons the batch needs)."""
    return loaded(smollm2_gguf, request.param)


@pytest.fixture
def smollm2_gate(smollm2_gguf):
    return loaded(smollm2_gguf, "gate")


def solo_steps(model, ids, n):
    """Greedy decode of each prompt alone: (tokens, the logits of each decode step)."""
    out = []
    for p in ids:
        kv = model.new_cache(128)
        logits, toks, steps = model.forward(p, kv), [], []
        for _ in range(n):
            toks.append(int(np.argmax(logits)))
            logits = model.forward([toks[-1]], kv)
            steps.append(logits)
        out.append((toks, steps))
    return out


def batched_steps(model, ids, n):
    kvs = [model.new_cache(128) for _ in ids]
    cur = [int(np.argmax(model.forward(p, kv))) for p, kv in zip(ids, kvs)]
    steps = []
    for _ in range(n):
        logits = model.forward_batch(cur, kvs)
        steps.append(logits)
        cur = [int(np.argmax(row)) for row in logits]
    return steps


def test_a_batched_step_gives_each_row_its_single_sequence_logits(smollm2):
    """Four sequences of different lengths (so different positions) decoded together: every row's logits are the
    bits of that sequence's own one-token step, for 5 steps (8-bit activations are rounded per row; the flash FFN sums
    each row over its own neurons in bundle order, whichever union the batch read)."""
    model, tok = smollm2
    T = model.transformer
    ids = [tok.encode(p) for p in PROMPTS]
    assert len({len(i) for i in ids}) > 1
    solo = solo_steps(T, ids, 5)
    batched = batched_steps(T, ids, 5)
    for s, logits in enumerate(batched):
        for b in range(len(ids)):
            np.testing.assert_array_equal(logits[b], solo[b][1][s], err_msg=f"step {s} row {b}")
    if model.ffn is not None:      # told back that rows are a prompt's
        assert not model.ffn.decoding


def test_the_flash_ffn_batch_equals_its_solo_steps_on_stories():
    """stories260K with its FFN through the neuron cache (--ffn oracle: the neurons each row needs): exact too."""
    from flashinfer_lite.runtime import load
    model, tok = load(str(STORIES), None, "oracle", 128, say=False)
    ids = [tok.encode(p) for p in ("Once upon a time", "The little cat", "Tom and Sue went")]
    solo = solo_steps(model.transformer, ids, 4)
    for s, logits in enumerate(batched_steps(model.transformer, ids, 4)):
        for b in range(len(ids)):
            np.testing.assert_array_equal(logits[b], solo[b][1][s])


def test_a_sequence_joining_mid_batch_gets_its_solo_answer(smollm2_gate):
    """Continuous batching: two sequences start, a third joins after they have decoded 4 tokens, a fourth after the
    first ends; each one's greedy tokens are its solo ones, and the steps did run several sequences at once."""
    from flashinfer_lite.generate import DecodeBatch, Sampler, Session
    model, tok = smollm2_gate
    T = model.transformer
    ids = [tok.encode(p) for p in PROMPTS]
    want = [toks for toks, _ in solo_steps(T, ids, 8)]
    # solo_steps' tokens are argmax before each step; Session yields the same 8 (then stops at n_predict)
    batch = DecodeBatch(T, None)
    got = [None] * 4
    progress = [threading.Event() for _ in range(4)]
    first_done = threading.Event()

    def run(i: int, n: int):
        s = Session(T, tok, 128, batch=batch)
        out = []
        for t in s.generate(ids[i], n, Sampler(temp=0)):
            out.append(t)
            if len(out) == 4:
                progress[i].set()
        got[i] = out
        if i == 0:
            first_done.set()

    threads = [threading.Thread(target=run, args=(0, 6)), threading.Thread(target=run, args=(1, 8))]
    for t in threads:
        t.start()
    assert progress[0].wait(120) and progress[1].wait(120)
    threads.append(threading.Thread(target=run, args=(2, 8)))
    threads[-1].start()
    assert first_done.wait(120)
    threads.append(threading.Thread(target=run, args=(3, 8)))
    threads[-1].start()
    for t in threads:
        t.join(120)
    assert got[0] == want[0][:6] and got[1:] == want[1:], (got, want)
    assert sum(n for size, n in batch.steps.items() if size >= 2) > 0, batch.steps


def test_a_waiting_prompt_runs_before_the_next_step():
    """A prompt handed in while a step runs is evaluated before the next step, though a session's token is waiting
    too: steps taken first would let the decoding sessions keep the model and the prompt wait until they end."""
    from flashinfer_lite.generate import DecodeBatch

    class Recorder:
        def __init__(self):
            self.calls, self.gate, self.entered = [], threading.Event(), threading.Event()

        def forward(self, ids, kv):
            self.calls.append(("prompt", kv))
            return np.zeros(3, np.float32)

        def forward_batch(self, tokens, caches):
            self.entered.set()
            self.gate.wait(30)
            self.calls.append(("step", *caches))
            return np.zeros((len(tokens), 3), np.float32)

    model = Recorder()
    batch = DecodeBatch(model)
    batch.enter()
    batch.enter()
    first = threading.Thread(target=batch.forward, args=("a", [1]))
    first.start()                      # a's step starts (the other session is not decoding yet) and holds
    assert model.entered.wait(30)
    later = [threading.Thread(target=batch.forward, args=("b", [1, 2, 3])),
             threading.Thread(target=batch.forward, args=("a", [5]))]
    for t in later:
        t.start()
    for _ in range(3000):              # both wait behind a's step
        if batch.prompts and batch.tokens:
            break
        threading.Event().wait(0.01)
    model.gate.set()
    for t in [first, *later]:
        t.join(30)
    assert model.calls == [("step", "a"), ("prompt", "b"), ("step", "a")]


def test_a_load_counts_its_own_contexts_not_an_earlier_loads():
    """The contexts a plan counts KV caches for (serve --parallel) are the load's own: a load_runtime after a load of
    three contexts in this process plans one, and its kv line says so (a process-wide setting once leaked from one
    load into the next). No budget: every KV page in DRAM, three caches and two more sequences' logits."""
    from flashinfer_lite.budget import kv_all_bytes
    from flashinfer_lite.runtime import load, load_runtime
    model, _ = load(str(STORIES), None, "oracle", 128, parallel=3, say=False)
    three = model.ffn.plan
    assert three.contexts == 3 and "3 contexts of 128 positions" in three.table()
    _, _, ffn = load_runtime(str(STORIES), "oracle", None, 128)
    one = ffn.plan
    assert one.contexts == 1 and "3 contexts" not in one.table() and "128 positions" in one.table()
    cfg = model.transformer.cfg
    assert one.kv_bytes == kv_all_bytes(cfg, 128)
    assert three.kv_bytes == 3 * one.kv_bytes + 2 * 3 * cfg.vocab_size * 4    # logits, batch row, log-softmax
