"""LazyLLM's prompt pruning (pruning.py, --prompt-pruning): off, it is today's path bit for bit; on, the logits of the
prompt and of decode steps after it equal a float64 numpy model that runs the same pruned computation (its own
selection from its own attention probabilities, its own pruned layers and cache); the kept tokens are those the last
token attends to most; a bad RATIO is one line before any model loads."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from flashinfer_lite import pruning
from flashinfer_lite.kv_pages import KVCache, KVOptions, parse_prompt_pruning
from flashinfer_lite.model import load_reference, open_any
from storage.errors import UserError

from conftest import DATA, STORIES

STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her friends "
         "and her dog. One day, Lily saw a big red ball in the grass. She ran to get it, but her dog got there first. ")


def run(model, ids: list[int], n: int, options: KVOptions, ctx: int = 512) -> tuple[np.ndarray, KVCache]:
    """Logits [n + 1, V] of a prompt's last token and of n greedy decode steps after it."""
    kv = KVCache(model.cfg, ctx, options=options)
    rows = [model.forward(ids, kv)]
    for _ in range(n):
        rows.append(model.forward([int(np.argmax(rows[-1]))], kv))
    return np.stack(rows), kv


@pytest.fixture(scope="module")
def stories():
    return load_reference(STORIES)


def test_pruning_off_and_a_ratio_that_prunes_nothing_are_todays_bits(stories):
    """Off (no flag, 0, "off") the model runs today's path; a ratio too small to prune a token runs the staged path
    (each stage's layers over all chunks before the next stage), whose every logit is the unstaged run's bit for bit:
    a chunk's attention sees the same keys in either order."""
    model, tok = stories
    ids = tok.encode(STORY * 2)
    today, kv = run(model, ids, 6, KVOptions())
    assert not kv.pruned.any()
    for options in (KVOptions(prompt_pruning=0.0), KVOptions(**parse_prompt_pruning("off"))):
        assert np.array_equal(run(model, ids, 6, options)[0], today)
    tiny = 1 / (3 * len(ids))                          # round(T x ratio x share) = 0 at every stage
    staged, kv = run(model, ids, 6, KVOptions(prompt_pruning=tiny))
    assert not kv.pruned.any() and kv.pruned_end == len(ids)
    assert np.array_equal(staged, today)


def test_staged_chunks_are_todays_bits(stories, monkeypatch):
    """The same with chunks of 16 rows: the staged order runs chunk after chunk per stage, today's chunk by chunk
    through every layer."""
    monkeypatch.setattr("flashinfer_lite.model.PREFILL_CHUNK_ROWS", 16)
    model, tok = stories
    ids = tok.encode(STORY * 2)
    today, _ = run(model, ids, 3, KVOptions())
    staged, _ = run(model, ids, 3, KVOptions(prompt_pruning=1 / (3 * len(ids))))
    assert np.array_equal(staged, today)


# ----------------------------------------------------------------------------------------------------------------------
# The float64 oracle: stories260K (Llama: RMSNorm, RoPE half-split, GQA, SwiGLU, tied head) from its source weights

def f16(a: np.ndarray) -> np.ndarray:
    """The KV cache keeps keys and values in float16."""
    return a.astype(np.float16).astype(np.float64)


class Reference:
    """A float64 Llama over the checkpoint's tensors, layer by layer over the rows still computed, LazyLLM's selection
    at the documented stages: layers round(L/4), round(L/2), round(3L/4) keep T - round(T x ratio x k/3) tokens
    (k = 1, 2, 3): the last, and those the last token's attention at the layer before weighs most, averaged over
    heads."""

    def __init__(self, path):
        ckpt = open_any(path)
        self.cfg = c = ckpt.config
        self.w = {n: ckpt.tensor(n).astype(np.float64) for n in ckpt.names()}
        hd = c.head_dim
        self.inv = 1.0 / (c.rope_theta ** (np.arange(0, hd, 2) / hd))
        self.keys = self.values = None
        self.kept: list[np.ndarray] = []          # per stage after the first: the prompt rows kept
        self.weights: list[np.ndarray] = []       # ... and the weights they were ranked by

    def rms(self, x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.cfg.norm_eps) * w

    def rope(self, x, pos):                        # x [t, h, hd], pos [t]
        ang = pos[:, None] * self.inv[None, :]
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        h = x.shape[-1] // 2
        return np.concatenate([x[..., :h] * cos - x[..., h:] * sin, x[..., h:] * cos + x[..., :h] * sin], axis=-1)

    def layer(self, i, x, pos, past):
        """Layer i over rows x [t, d] at positions pos, after the layer's cached (positions, keys, values) `past`;
        returns (x, last row's attention probabilities [H, S] over past + these rows)."""
        c, w, p = self.cfg, self.w, f"layers.{i}."
        H, Hkv, hd = c.n_heads, c.n_kv_heads, c.head_dim
        a = self.rms(x, w[p + "attn_norm.weight"])
        q = self.rope((a @ w[p + "attn.q.weight"].T).reshape(-1, H, hd), pos)
        k = f16(self.rope((a @ w[p + "attn.k.weight"].T).reshape(-1, Hkv, hd), pos))
        v = f16((a @ w[p + "attn.v.weight"].T).reshape(-1, Hkv, hd))
        P, K, V = (np.concatenate([o, n]) for o, n in zip(past, (pos, k, v)))
        past[:] = [P, K, V]
        Kh, Vh = np.repeat(K, H // Hkv, axis=1), np.repeat(V, H // Hkv, axis=1)
        s = np.einsum("thd,shd->hts", q, Kh) / np.sqrt(hd)
        s = np.where(P[None, None, :] <= pos[None, :, None], s, -np.inf)
        prob = np.exp(s - s.max(axis=-1, keepdims=True))
        prob /= prob.sum(axis=-1, keepdims=True)
        o = np.einsum("hts,shd->thd", prob, Vh).reshape(len(x), -1)
        h = x + o @ w[p + "attn.o.weight"].T
        f = self.rms(h, w[p + "ffn_norm.weight"])
        g, u = f @ w[p + "ffn.gate.weight"].T, f @ w[p + "ffn.up.weight"].T
        return h + (g / (1 + np.exp(-g)) * u) @ w[p + "ffn.down.weight"].T, prob[:, -1]

    def logits(self, x):
        return self.rms(x[-1:], self.w["norm.weight"]) @ self.w["embed.weight"].T

    def prompt(self, ids, ratio):
        c, T = self.cfg, len(ids)
        L = c.n_layers
        plan = {round(L * at): T - round(T * ratio * k / 3) for at, k in ((0.25, 1), (0.5, 2), (0.75, 3))}
        self.past = [[np.zeros(0), np.zeros((0, c.n_kv_heads, c.head_dim)), np.zeros((0, c.n_kv_heads,
                                                                                      c.head_dim))] for _ in range(L)]
        x, pos = self.w["embed.weight"][ids], np.arange(T, dtype=np.float64)
        for i in range(L):
            if i in plan:
                n_past = len(self.past[i - 1][0]) - len(pos)     # the layer's keys before this prompt: none here
                weight = last_prob[:, n_past:].mean(axis=0)
                self.weights.append(weight)
                weight = weight[:-1]
                order = sorted(range(len(weight)), key=lambda j: (-weight[j], j))[:plan[i] - 1]
                keep = np.array(sorted(order) + [len(pos) - 1])
                self.kept.append(pos[keep].astype(int))
                x, pos = x[keep], pos[keep]
            x, last_prob = self.layer(i, x, pos, self.past[i])
        return self.logits(x)[0]

    def step(self, token, at):
        x = self.w["embed.weight"][[token]]
        for i in range(self.cfg.n_layers):
            x, _ = self.layer(i, x, np.array([float(at)]), self.past[i])
        return self.logits(x)[0]


@pytest.mark.parametrize("ratio", [0.4, 0.75])
def test_pruned_logits_equal_the_float64_pruned_model(stories, ratio, monkeypatch):
    """Prompt and 6 greedy decode steps with pruning: every logit within float32's rounding of the float64 model
    that prunes by its own attention probabilities; the tokens each stage keeps are the reference's, and they are
    the last token and the highest of the attention weights the runtime ranked (its weights = the oracle's)."""
    model, tok = stories
    ids = tok.encode(STORY * 2)
    seen = []
    ranked = pruning.kept_rows

    def record(weights, n_keep):
        seen.append((weights.copy(), ranked(weights, n_keep)))
        return seen[-1][1]
    monkeypatch.setattr(pruning, "kept_rows", record)
    ours, kv = run(model, ids, 6, KVOptions(prompt_pruning=ratio))
    ref = Reference(STORIES)
    want = [ref.prompt(ids, ratio)]
    for j in range(6):
        want.append(ref.step(int(np.argmax(ours[j])), len(ids) + j))
    want = np.stack(want)
    # 2e-2: keys and values rounded to float16 from float32 and from float64 land an ulp apart here and there (the
    # unpruned model is as far from its float64 twin: 1e-2); pruning moves the logits by 10x that and more
    assert np.abs(ours - want).max() < 2e-2, np.abs(ours - want).max()
    assert np.abs(ours[0] - run(model, ids, 0, KVOptions())[0][0]).max() > 0.2
    T = len(ids)
    rows = np.arange(T)
    for (weights, keep), want_kept, want_weights in zip(seen, ref.kept, ref.weights):
        rows = rows[keep]
        assert np.array_equal(rows, want_kept)
        assert np.abs(weights - want_weights).max() < 1e-4      # probabilities of float32 hidden states
        # the oracle of the ranking: each kept weight at least every pruned one (the last token kept whatever its own)
        pruned = np.setdiff1d(np.arange(len(weights) - 1), keep)
        assert weights[keep[:-1]].min() >= weights[pruned].max() and keep[-1] == len(weights) - 1
    # stages at layers 1, 2 and 4 of 5
    assert len(seen) == 3 and kv.pruned.tolist() == [0, T - len(ref.kept[0]), T - len(ref.kept[1]),
                                                     T - len(ref.kept[1]), T - len(ref.kept[2])]


def test_the_last_token_attention_weights_are_softmax_probabilities(stories, monkeypatch):
    """The weights a stage ranks by are probabilities: each layer's softmax over its keys sums to 1 per head, so
    their mean over the prompt's tokens sums to 1 (no earlier context here)."""
    model, tok = stories
    seen = []
    ranked = pruning.kept_rows
    monkeypatch.setattr(pruning, "kept_rows", lambda w, n: seen.append(w) or ranked(w, n))
    run(model, tok.encode(STORY), 0, KVOptions(prompt_pruning=0.5))
    assert len(seen) == 3 and all(abs(w.sum() - 1) < 1e-9 and (w >= 0).all() for w in seen)


def test_a_cut_inside_a_pruned_prompt_forgets_it(stories):
    """A chat turn that shares part of a pruned prompt evaluates it all again (its layers hold the kept tokens only);
    one that extends the prompt and answer keeps the cache: the logits are those of the run that never cut."""
    from flashinfer_lite.generate import Sampler, Session
    model, tok = stories
    model.kv_options = KVOptions(prompt_pruning=0.5)
    try:
        ids = tok.encode(STORY * 2)
        session = Session(model, tok, 512, choose_threads=False)
        first = list(session.generate(ids, 4, Sampler(temp=0.0), ignore_eos=True))
        assert session.kv.pruned.any() and session.kv.pruned_end == len(ids)
        assert session.kv.reusable(len(ids) - 5) == 0 and session.kv.reusable(len(ids) + 2) == len(ids) + 2
        again = list(session.generate(ids[:-5] + ids[-5:], 4, Sampler(temp=0.0), ignore_eos=True))
        assert again == first                          # the same prompt: evaluated anew, the same pruning
        with pytest.raises(ValueError, match="inside a pruned prompt"):
            session.kv.reset(3)
    finally:
        model.kv_options = None


def test_bad_ratios_are_one_line_before_the_model_loads():
    missing = str(DATA / "no-such-model.gguf")
    for command, value in (("generate", "1"), ("chat", "-0.1"), ("serve", "abc"), ("generate", "nan")):
        prompt = ["-p", "hi"] if command == "generate" else []
        r = subprocess.run([sys.executable, "-m", "flashinfer_lite", command, "-m", missing, *prompt,
                            "--prompt-pruning", value], capture_output=True, text=True, timeout=120)
        assert r.returncode == 1 and r.stderr.strip().splitlines() == [r.stderr.strip()], (command, r.stderr)
        assert r.stderr.startswith(f"error: --prompt-pruning {value!r}: a share"), (command, r.stderr)
    for bad in (1.0, -0.5, float("nan")):
        with pytest.raises(UserError, match="--prompt-pruning"):
            KVOptions(prompt_pruning=bad)
    from flashinfer_lite import api
    with pytest.raises(UserError, match="prompt_pruning 'half'"):
        api.load(missing, prompt_pruning="half")


def test_a_batched_decode_step_after_pruned_prompts_is_each_ones_own(stories):
    """serve --parallel's step (Transformer.forward_batch) over caches that pruned their prompts differently gives each
    row the logits of that cache's own decode step (float32 matrices: BLAS's order, so within 1e-4; a step that wrote or
    read the pruned layers at the position instead of the slot would be far off)."""
    model, tok = stories
    prompts = [tok.encode(STORY * 2), tok.encode(STORY)[:60]]
    alone, batched = [], []
    for ids, ratio in zip(prompts, (0.5, 0.3)):
        for out in (alone, batched):
            kv = KVCache(model.cfg, 512, options=KVOptions(prompt_pruning=ratio))
            out.append((kv, int(np.argmax(model.forward(ids, kv)))))
    want = np.stack([model.forward([t], kv) for kv, t in alone])
    got = model.forward_batch([t for _, t in batched], [kv for kv, _ in batched])
    assert np.abs(got - want).max() < 1e-4
    assert all(a.length == b.length and np.array_equal(a.pruned, b.pruned) for (a, _), (b, _) in zip(alone, batched))


def test_a_pruned_prompts_temporaries_fit_what_the_plan_counts(stories):
    """What a pruned prompt allocates beyond the same prompt unpruned (tracemalloc: every token's hidden state between
    stages, the kept ones' copy, the last token's scores, a block of keys at a time) is within what the plan adds for
    pruning (budget.prefill_transient_bytes with the KV options)."""
    import tracemalloc
    from flashinfer_lite.budget import prefill_transient_bytes
    model, tok = stories
    ctx = 1024
    ids = (tok.encode(STORY) * 20)[:ctx - 8]

    def peak(options: KVOptions) -> int:
        kv = KVCache(model.cfg, ctx, options=options)       # the cache before: the plan counts it apart
        tracemalloc.start()
        try:
            model.forward(ids, kv)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    options = KVOptions(prompt_pruning=0.5)
    peak(options)                                           # tables made once, kernels compiled: not a prompt's
    extra = peak(options) - peak(KVOptions())
    planned = prefill_transient_bytes(model.cfg, ctx, kv_options=options) - prefill_transient_bytes(model.cfg, ctx)
    assert 0 < extra <= planned, (extra, planned)
