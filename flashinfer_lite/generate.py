"""`flashinfer-lite generate`: one prompt in, streamed text out, llama.cpp-style timings at the end."""
from __future__ import annotations

import json
import math
import numbers
import sys
import threading
import time
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from storage.config import DEFAULT_MAX_CTX
from storage.errors import UserError
from storage.gate_file import DEFAULT_SPARSITY, SPARSITIES
from storage.tokenizer import StreamDecoder, Tokenizer, check_utf8

from .constrain import Constraint, json_schema_grammar, text_grammar
from .flash_matrix import FlashMatrix
from .kv_pages import CACHE_TYPES, KVCache, KVOptions, parse_kcache, parse_kv_pages, parse_prompt_pruning
from .model import Transformer
from .process import peak_rss_bytes, rss_bytes

from .modes import FFN_MODES, ffn_help
from .runtime import load
from .threads import StepThreads


# ----------------------------------------------------------------------------------------------------------------------
# Sampling (llama.cpp's default chain: penalties (repetition, then frequency and presence), top-k, top-p, min-p,
# temperature, then draw)

class SamplingError(UserError, ValueError):
    """A sampling argument of the wrong type or out of its range. `name` is the Sampler field, so that each front end
    names it in its own words (the CLI's --temp, the API's temp, the server's "temperature")."""

    def __init__(self, name: str, value, rule: str):
        super().__init__(f"{name} {value!r} is out of range: {rule}")
        self.name, self.value, self.rule = name, value, rule


def _number(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


def _integer(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


# field: (test, rule). The one check of sampling arguments: the CLI, the Python API and the server all build a Sampler.
SAMPLING_RULES = {
    "temp": (lambda v: _number(v) and v >= 0, "a number >= 0 (0 = greedy)"),
    "top_k": (lambda v: _integer(v) and v >= 0, "an integer >= 0 (0 = off)"),
    "top_p": (lambda v: _number(v) and 0 <= v <= 1, "a number between 0 and 1"),
    "seed": (_integer, "an integer (-1 = random)"),
    "min_p": (lambda v: _number(v) and 0 <= v <= 1, "a number between 0 and 1 (0 = off)"),
    "repeat_penalty": (lambda v: _number(v) and v > 0, "a number > 0 (1 = off)"),
    "repeat_last_n": (lambda v: _integer(v) and v >= -1, "an integer >= -1 (-1 = the whole context)"),
    "presence_penalty": (lambda v: _number(v) and -2 <= v <= 2, "a number between -2 and 2 (0 = off)"),
    "frequency_penalty": (lambda v: _number(v) and -2 <= v <= 2, "a number between -2 and 2 (0 = off)"),
}


@dataclass
class Sampler:
    temp: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    seed: int = -1
    min_p: float = 0.05             # llama.cpp's default: drop tokens under 5% of the most likely one's probability
    repeat_penalty: float = 1.0     # 1 = off (llama.cpp's default)
    repeat_last_n: int = 64
    presence_penalty: float = 0.0   # OpenAI's: minus this from the logit of every token drawn at least once
    frequency_penalty: float = 0.0  # OpenAI's: minus this times the number of times a token was drawn
    rng: np.random.Generator = field(init=False)
    drawn: list[int] = field(init=False)    # the ids this Sampler returned, for the frequency and presence penalties

    def __post_init__(self):
        for name, (ok, rule) in SAMPLING_RULES.items():
            if not ok(getattr(self, name)):
                raise SamplingError(name, getattr(self, name), rule)
        self.rng = np.random.default_rng(None if self.seed < 0 else self.seed)
        self.drawn = []

    def penalize(self, logits: np.ndarray, history, drawn=()) -> np.ndarray:
        """llama.cpp's penalties, in its order: the repetition penalty (each distinct token of the last repeat_last_n
        ids of history has its logit divided by the penalty when positive, multiplied when negative), then OpenAI's
        frequency and presence penalties, logit - count * frequency_penalty - (count > 0) * presence_penalty, where
        count is how often the token is in `drawn`: the output so far, as OpenAI counts it. (llama.cpp counts the
        last repeat_last_n ids, prompt included: a chat template's own end-of-turn token would be penalized there.)"""
        repeat = self.repeat_penalty != 1.0 and self.repeat_last_n != 0 and len(history)
        counted = (self.presence_penalty or self.frequency_penalty) and len(drawn)
        if not repeat and not counted:
            return logits
        out = np.array(logits, dtype=np.float32, copy=True)
        if repeat:
            recent = history[-self.repeat_last_n:] if self.repeat_last_n > 0 else history
            ids = np.unique(np.asarray(recent, np.int64))
            v = out[ids]
            out[ids] = np.where(v > 0, v / self.repeat_penalty, v * self.repeat_penalty)
        if counted:
            ids, counts = np.unique(np.asarray(drawn, np.int64), return_counts=True)
            out[ids] -= (counts * self.frequency_penalty + self.presence_penalty).astype(np.float32)
        return out

    def __call__(self, logits: np.ndarray, history=(), processors=()) -> int:
        """The next token from logits [V]; history: the ids so far (prompt and output), for the penalties and the
        processors: callables (history, logits) -> logits as mlx-lm's logits_processors (a grammar's mask,
        constrain.Constraint), run after the penalties and before the cut-offs and the temperature. A Sampler counts
        what it draws for the frequency and presence penalties: one Sampler per completion (a chat's next turn:
        reset())."""
        logits = self.penalize(logits, history, self.drawn)
        for process in processors:
            logits = process(history, logits)
        tok = self.draw(logits)
        self.drawn.append(tok)
        return tok

    def reset(self) -> None:
        """Forget the output counted by the frequency and presence penalties (a new completion)."""
        self.drawn = []

    def draw(self, logits: np.ndarray) -> int:
        if self.temp <= 0:
            return int(np.argmax(logits))
        idx = np.argsort(-logits, kind="stable")
        if self.top_k > 0:
            idx = idx[: self.top_k]
        z = logits[idx].astype(np.float64)
        p = np.exp(z - z.max())
        p /= p.sum()
        if 0 < self.top_p < 1:
            keep = int(np.searchsorted(np.cumsum(p), self.top_p) + 1)
            idx, z, p = idx[:keep], z[:keep], p[:keep]
        if self.min_p > 0:
            keep = int(np.count_nonzero(p >= self.min_p * p[0]))   # p is sorted: p[0] is the most likely
            idx, z = idx[:keep], z[:keep]
        # shifted before the division: a tiny temperature (1e-310) makes the top logit 0 and the rest -inf, where
        # dividing first gave inf - inf = NaN
        p = np.exp((z - z.max()) / self.temp)
        return int(idx[self.rng.choice(len(idx), p=p / p.sum())])


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log p of every token [V], float32, from logits [V] (the exponentials summed in float64)."""
    z = np.asarray(logits, np.float32)
    top = z.max()
    return (z - np.float32(top + np.log(np.exp((z - top).astype(np.float64)).sum()))).astype(np.float32)


def sampler_from(args) -> Sampler:
    return Sampler(args.temp, args.top_k, args.top_p, args.seed, min_p=args.min_p,
                   repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n,
                   presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty)


# ----------------------------------------------------------------------------------------------------------------------
# Timings

@dataclass
class Timings:
    load_ms: float = 0.0
    prompt_tokens: int = 0
    prompt_ms: float = 0.0
    first_token_ms: float = 0.0      # the last prompt's time to its first token: its evaluation, then the sampling
    token_ms: list[float] = field(default_factory=list)
    constrain_ms: float = 0.0     # in logits processors (a grammar's masks)
    constrain_tokens: int = 0     # tokens sampled under them

    def as_dict(self) -> dict:
        n, ms = len(self.token_ms), float(sum(self.token_ms))
        q = (lambda p: float(np.percentile(self.token_ms, p))) if n else (lambda p: 0.0)
        return {"load_ms": round(self.load_ms, 3), "prompt_tokens": self.prompt_tokens,
                "prompt_ms": round(self.prompt_ms, 3),
                "prompt_tokens_per_second": round(self.prompt_tokens / self.prompt_ms * 1e3, 3) if self.prompt_ms else 0,
                "first_token_ms": round(self.first_token_ms, 3),
                "eval_tokens": n, "eval_ms": round(ms, 3), "ms_per_token": round(ms / n, 3) if n else 0,
                "tokens_per_second": round(n / ms * 1e3, 3) if ms else 0, "p50_ms": round(q(50), 3),
                "p99_ms": round(q(99), 3),
                **({"constrain_ms": round(self.constrain_ms, 3),
                    "constrain_ms_per_token": round(self.constrain_ms / self.constrain_tokens, 3)}
                   if self.constrain_tokens else {})}

    def report(self, out=sys.stderr, ffn=None, head=None, kv: KVCache | None = None) -> None:
        """The perf lines as llama.cpp prints them (llama_perf_context_print), then flash stats (the FFN's, a
        streamed head's: streamed_head; with kv, its pages read per decoded token) and peak RSS."""
        d = self.as_dict()
        w = "flashinfer_lite_perf"
        pt, pm = d["prompt_tokens"], d["prompt_ms"]
        print(f"{w}:        load time = {d['load_ms']:10.2f} ms", file=out)
        print(f"{w}: prompt eval time = {pm:10.2f} ms / {pt:5d} tokens ({pm / max(pt, 1):8.2f} ms per token, "
              f"{d['prompt_tokens_per_second']:8.2f} tokens per second)", file=out)
        print(f"{w}: first token time = {d['first_token_ms']:10.2f} ms", file=out)
        print(f"{w}:        eval time = {d['eval_ms']:10.2f} ms / {d['eval_tokens']:5d} runs   "
              f"({d['ms_per_token']:8.2f} ms per token, {d['tokens_per_second']:8.2f} tokens per second, "
              f"P50 {d['p50_ms']:.2f} ms, P99 {d['p99_ms']:.2f} ms)", file=out)
        print(f"{w}:       total time = {d['load_ms'] + pm + d['eval_ms']:10.2f} ms / {pt + d['eval_tokens']:5d} tokens",
              file=out)
        if self.constrain_tokens:
            print(f"{w}:   grammar's mask = {d['constrain_ms']:10.2f} ms / {self.constrain_tokens:5d} tokens "
                  f"({d['constrain_ms_per_token']:8.2f} ms per token, not in the eval time)", file=out)
        if ffn is not None:
            f = ffn.stats.as_dict()
            print(f"{w}:      flash reads = {f['mb_read_per_token']:10.2f} MB per token, hit rate {f['hit_rate']:.3f}, "
                  f"{f['read_mb_per_s']:.1f} MB/s, active FFN share {f['active_share']:.3f}", file=out)
            served = f" lookahead prefetch {f['prefetch_used_rows']} of {f['prefetched_rows']} rows used;" \
                if f["prefetched_rows"] else ""
            print(f"{w}:       flash wait = {f['read_wait_ms_per_token']:10.2f} ms per token blocked, "
                  f"{f['read_in_flight_ms_per_token']:.2f} ms in flight ({100 * f['overlapped_share']:.0f}% "
                  f"overlapped with compute);{served}", file=out)
        if head is not None:
            h = head.stats.as_dict()
            print(f"{w}:       head reads = {h['mb_read_per_token']:10.2f} MB per token, "
                  f"{h['read_wait_ms_per_token']:.2f} ms per token waiting for them, "
                  f"{h['compute_ms'] / max(h['decode_tokens'], 1):.2f} ms computing (the head streamed from flash)",
                  file=out)
        if kv is not None:
            p = kv.stats.per_token()
            print(f"{w}:         kv pages = {p['pages_read']:10.1f} read per token ({p['flash_pages_read']:.1f} from "
                  f"flash) of {p['pages']:.1f} in context, all layers; {kv.describe()}", file=out)
        m = rss_summary(ffn)
        line = f"{w}:         peak RSS = {m['peak_rss_mb']:10.1f} MiB"
        if "dram_budget_mb" in m:
            over = ", EXCEEDED" if m["peak_rss_mb"] > m["dram_budget_mb"] else ""
            line += f" (budget {m['dram_budget_mb']:.1f} MiB{over})"
        print(f"{line}, {m['rss_mb']:.1f} MiB now", file=out)


def streamed_head(model: Transformer) -> FlashMatrix | None:
    """The model's head when the plan streams it from flash (its stats: one pass a token), else None."""
    return model.lm_head if isinstance(model.lm_head, FlashMatrix) else None


def rss_summary(ffn=None) -> dict:
    """MiB: peak RSS (the kernel's high-water mark; psutil has no peak on Linux), RSS now (psutil), and the
    --dram-budget the peak is held to, when one was given (the plan of the FFN from flash, `ffn`)."""
    out = {"peak_rss_mb": round(peak_rss_bytes() / 2**20, 1), "rss_mb": round(rss_bytes() / 2**20, 1)}
    plan = getattr(ffn, "plan", None)
    if plan is not None and plan.requested:
        out["dram_budget_mb"] = round(plan.budget_bytes / 2**20, 1)
    return out


# ----------------------------------------------------------------------------------------------------------------------
# The generation loop

class Session:
    """A model, its tokenizer and one KV cache: the state a chat keeps across turns.

    `cached` mirrors the ids whose keys and values sit in the cache, so a new turn only evaluates what the
    conversation added since (the rendered template of the whole conversation shares a prefix with the last one).
    """

    def __init__(self, model: Transformer, tokenizer: Tokenizer, ctx: int, choose_threads: bool = True,
                 batch: "DecodeBatch | None" = None):
        self.model, self.tokenizer = model, tokenizer
        self.batch = batch      # the model is shared with other sessions: its passes run there (DecodeBatch)
        self.kv = model.new_cache(ctx)
        self.cached: list[int] = []
        self.timings = Timings()
        self.logits: np.ndarray | None = None
        # each decode step's thread count, by measured step times (choose_threads False: always -t, as a bench
        # that times the parts of a step at a given thread count needs)
        self.threads = StepThreads(choose=choose_threads)

    @property
    def ctx(self) -> int:
        return self.kv.capacity

    def reset(self, keep: int = 0) -> None:
        """Forget the cache but its first `keep` tokens (none if they end inside a pruned prompt)."""
        keep = self.kv.reusable(keep)
        self.kv.reset(keep)
        self.cached = self.cached[:keep]

    def generate(self, ids: list[int], n_predict: int, sampler: Sampler, ignore_eos: bool = False,
                 logits_processors=()):
        """Bring the cache to `ids` (reusing the common prefix), then yield sampled ids until EOS, n_predict, or a
        full context. logits_processors: the Sampler's processors (their time goes into timings.constrain_ms); one
        with a done(history) method (a grammar, constrain.Constraint) ends the output once it says so. A session of a
        DecodeBatch counts in its steps from its prompt to its end."""
        if self.batch is not None:
            self.batch.enter()
        try:
            yield from self._generate(ids, n_predict, sampler, ignore_eos, logits_processors)
        finally:
            if self.batch is not None:
                self.batch.leave()

    def forward(self, ids: list[int]) -> np.ndarray:
        """The model over ids at the cache's end (logits [V] of the last): here, or as one row of a DecodeBatch step."""
        if self.batch is not None:
            return self.batch.forward(self.kv, ids)
        return self.model.forward(ids, self.kv)

    def _generate(self, ids, n_predict, sampler, ignore_eos, logits_processors):
        if len(ids) > self.ctx:
            raise UserError(f"prompt is too long ({len(ids)} tokens, context is {self.ctx}); "
                            f"raise -c or shorten the prompt")
        keep = 0
        for a, b in zip(self.cached, ids[:-1]):  # at least one new token must be evaluated to get logits
            if a != b:
                break
            keep += 1
        keep = self.kv.reusable(keep)
        self.kv.reset(keep)
        self.cached = list(ids[:keep])
        new = ids[keep:]
        t0 = start = time.perf_counter()
        logits = self.forward(new)
        self.cached += new
        self.timings.prompt_ms += (time.perf_counter() - t0) * 1e3
        self.timings.prompt_tokens += len(new)
        produced = 0
        processors = [self.timed(p, count=not k) for k, p in enumerate(logits_processors)]
        ends = [self.timed(p.done, count=False) for p in logits_processors if hasattr(p, "done")]
        while n_predict < 0 or produced < n_predict:
            self.logits = logits    # the model's logits the token is drawn from, before the sampling chain (logprobs)
            tok = sampler(logits, self.cached, processors)
            produced += 1
            if produced == 1:
                self.timings.first_token_ms = (time.perf_counter() - start) * 1e3
            if tok in self.tokenizer.eos_ids and not ignore_eos:
                return
            yield tok
            # the grammar hears of the last token too, so it can tell whether it ended with the output
            if (ends and any([done(self.cached + [tok]) for done in ends])) or produced == n_predict:
                return
            if self.kv.length >= self.ctx:
                raise ContextFull(self.ctx)
            t0 = time.perf_counter()
            if self.batch is not None:
                logits = self.forward([tok])
            else:
                with self.threads.step(self.model):
                    logits = self.model.forward([tok], self.kv)
            self.cached.append(tok)
            self.timings.token_ms.append((time.perf_counter() - t0) * 1e3)


    def timed(self, process, count: bool = True):
        """process, its time added to timings.constrain_ms (a grammar's cost per token, apart from the forward
        pass's); count: a call is a token sampled under it."""
        def run(*args):
            t0 = time.perf_counter()
            try:
                return process(*args)
            finally:
                self.timings.constrain_ms += (time.perf_counter() - t0) * 1e3
                self.timings.constrain_tokens += count
        return run


class DecodeBatch:
    """The model's one thread for several Sessions (serve --parallel N), each with its own KV cache, sampler and
    grammar, its generation loop on a thread of its own: their prompts run one at a time, and their decode steps
    together, one Transformer.forward_batch over every token handed in (continuous batching: a sequence joins at the
    step after its prompt and leaves when its generation ends). A step starts once every session in a generation
    has handed in its token, or half the last step's time (GATHER_S at least) after the first one came. A token's
    way out to its client and the next one's way back take a few event-loop and thread switches, tens of ms on a
    loaded machine: sessions whose steps fell out of phase (a prompt evaluated between them) would otherwise stay
    so, each step computing a part of them (measured: 4 clients decoding as 1- and 2-row steps for a whole answer
    at a 20 ms wait); a client slow to take its text holds the others for at most that. Each row's logits are the
    ones its session would get alone (forward_batch), so the batching changes no token, only when each is
    computed."""

    GATHER_S = 0.05
    GATHER_SHARE = 0.5

    def __init__(self, model: Transformer, threads: int | None = None):
        self.model = model
        self.cond = threading.Condition()
        self.prompts: list[tuple] = []      # (kv, ids, Future) in arrival order
        self.tokens: list[tuple] = []       # (kv, token, Future)
        self.active = 0                     # sessions between the start and the end of a generation
        self.steps: Counter = Counter()     # decode steps run, by their number of sequences
        self.step_s = 0.0                   # the last decode step's time
        self.thread = threading.Thread(target=self._run, args=(threads,), name="decode-batch", daemon=True)
        self.thread.start()

    def enter(self) -> None:
        with self.cond:
            self.active += 1

    def leave(self) -> None:
        with self.cond:
            self.active -= 1
            self.cond.notify_all()

    def forward(self, kv, ids: list[int]) -> np.ndarray:
        """Session.forward's pass, run on the batch's thread; waits for it (logits [V])."""
        done: Future = Future()
        with self.cond:
            (self.tokens if len(ids) == 1 else self.prompts).append((kv, ids, done))
            self.cond.notify_all()
        return done.result()

    def _run(self, threads: int | None) -> None:
        import numba
        if threads:
            numba.set_num_threads(threads)
        while True:
            with self.cond:
                while not self.prompts and not self.tokens:
                    self.cond.wait()
                # a prompt first: its sequence joins the next step (at most N - 1 of them come between two steps,
                # one per other session); a step taken while prompts wait would leave them waiting for good
                if self.prompts:
                    work = [self.prompts.pop(0)]
                else:
                    deadline = time.monotonic() + max(self.GATHER_S, self.GATHER_SHARE * self.step_s)
                    while len(self.tokens) < self.active and not self.prompts:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            break
                        self.cond.wait(left)
                    work, self.tokens = self.tokens, []
            try:
                if len(work[0][1]) > 1:
                    kv, ids, done = work[0]
                    done.set_result(self.model.forward(ids, kv))
                    continue
                t0 = time.perf_counter()
                logits = self.model.forward_batch([ids[0] for _, ids, _ in work], [kv for kv, _, _ in work])
                self.step_s = time.perf_counter() - t0
                self.steps[len(work)] += 1
                for row, (_, _, done) in zip(logits, work):
                    done.set_result(row.copy())
            except BaseException as e:     # the waiting sessions raise it (a context overflow, a short read)
                for _, _, done in work:
                    if not done.done():
                        done.set_exception(e)


class ContextFull(Exception):
    def __init__(self, ctx: int):
        super().__init__(f"context is full ({ctx} tokens); raise -c for longer output")


# ----------------------------------------------------------------------------------------------------------------------
# Command

def add_model_arguments(p) -> None:
    """Flags shared by generate and chat, named as llama.cpp names them."""
    p.add_argument("-m", "--model", help="HF directory or .gguf file, or a repo id in the Hugging Face cache "
                                         "(ORG/NAME, a GGUF repo's ORG/NAME:Q4_K_M; offline) (default: "
                                         "SmolLM2-135M-Instruct, fetched on first use)")
    p.add_argument("-n", "--n-predict", type=int, default=256, help="tokens to generate, -1 = until EOS (default 256)")
    p.add_argument("-c", "--ctx-size", type=int, default=0, help=f"context size (default: the model's, at most {DEFAULT_MAX_CTX})")
    p.add_argument("--temp", type=float, default=0.8, help="temperature, 0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=40, help="top-k sampling, 0 = off (default 40)")
    p.add_argument("--top-p", type=float, default=0.95, help="top-p sampling, 1.0 = off (default 0.95)")
    p.add_argument("--min-p", type=float, default=0.05,
                   help="min-p sampling: drop tokens below this share of the top token's probability, 0 = off "
                        "(default 0.05, as llama.cpp)")
    p.add_argument("--repeat-penalty", type=float, default=1.0,
                   help="penalize repeated tokens: logit / P if positive, x P if negative, 1.0 = off (default 1.0)")
    p.add_argument("--repeat-last-n", type=int, default=64,
                   help="last N tokens to penalize, 0 = off, -1 = all (default 64)")
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtract this from the logit of every token the output already holds, -2 to 2, 0 = off "
                        "(OpenAI's; default 0)")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtract this times a token's count in the output from its logit, -2 to 2, 0 = off "
                        "(OpenAI's; default 0)")
    p.add_argument("-s", "--seed", type=int, default=-1, help="RNG seed, -1 = random (default -1)")
    p.add_argument("-sys", "--system-prompt", default=None, help="system prompt for the chat template")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    p.add_argument("--ffn", default="auto", choices=FFN_MODES,
                   help=f"FFN neurons to compute: {ffn_help()}")
    p.add_argument("--sparsity", type=float, default=DEFAULT_SPARSITY,
                   help=f"--ffn gate: the calibrated share of neurons dropped, one of {', '.join(map(str, SPARSITIES))} "
                        f"(default {DEFAULT_SPARSITY})")
    p.add_argument("--dram-budget", default="auto",
                   help="bytes the process may keep (e.g. 300M, 2GiB): weights, KV cache, neuron cache, buffers; "
                        "auto (default): available memory (and the memory cgroup's room) less a margin")
    p.add_argument("--lookahead", action="store_true",
                   help="start each layer's flash reads one layer early on a guess (its predictor on the previous "
                        "layer's input); pays only where compute, not flash bandwidth, is the bottleneck")
    add_kv_arguments(p)
    p.add_argument("-t", "--threads", type=int, default=None, help="compute threads (default: all cores)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="print the budget split and runtime decisions, and the KV pages read per token")


def add_kv_arguments(p) -> None:
    """The KV cache's flags (kv_options_from): generate, chat and serve's, and eval's."""
    p.add_argument("--cache-type-k", default="f16", choices=CACHE_TYPES,
                   help="KV cache type of the keys: f16 or q8_0 (blocks of 32 with a float16 scale, as llama.cpp's); "
                        "default f16")
    p.add_argument("--cache-type-v", default="f16", choices=CACHE_TYPES,
                   help="KV cache type of the values (default f16)")
    p.add_argument("--kv-pages", default=None, metavar="N|P%",
                   help="Quest: a decode step's attention reads the N KV pages (or P%% of them, at least 40) whose "
                        "keys bound its query's scores highest, plus the first and the latest (approximate; default: "
                        "every page, exact)")
    p.add_argument("--kcache", default=None, metavar="W",
                   help="KCache: a decode step scores every KV page's keys, then reads the values only of the pages "
                        "holding a position whose softmax weight reaches W (e.g. 0.001; approximate; default off: "
                        "every page's values); not with --kv-pages")
    p.add_argument("--prompt-pruning", default=None, metavar="RATIO",
                   help="LazyLLM: a prompt's tokens its last token attends to least are not computed by the later "
                        "layers, RATIO of them by the last quarter (e.g. 0.5; approximate, a faster first token; "
                        "default off)")
    p.add_argument("--kv-dir", default=None,
                   help="directory of the file of KV pages beyond the budget's DRAM share (default: next to the "
                        "model's flash files, else the cache directory); the file is deleted when the run ends")


def add_arguments(p) -> None:
    add_model_arguments(p)
    p.add_argument("-p", "--prompt", help="prompt text (- reads it from standard input)")
    p.add_argument("-f", "--file", help="read the prompt from a UTF-8 text file (- for standard input)")
    p.add_argument("-r", "--reverse-prompt", action="append", default=[], metavar="TEXT",
                   help="stop when the output contains TEXT (repeatable)")
    p.add_argument("--ignore-chat-template", action="store_true",
                   help="feed the prompt as is, even when the model has a chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object (tokens, text, timings) instead of text")
    p.add_argument("--json-schema", metavar="FILE", help="constrain the output to JSON that this JSON schema allows "
                                                         "(needs llguidance)")
    p.add_argument("--grammar", metavar="FILE", help="constrain the output to this grammar, GBNF (llama.cpp's) or Lark "
                                                     "(needs llguidance)")


def read_grammar(args) -> str | None:
    """The grammar of --json-schema or --grammar (llguidance's form), checked before the model loads; None without."""
    if args.json_schema and args.grammar:
        raise UserError("give one constraint: --json-schema FILE or --grammar FILE, not both")
    path = args.json_schema or args.grammar
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            raw = f.read(1 << 20)
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}") from None
    if len(raw) == 1 << 20:
        raise UserError(f"{path} is over 1 MiB, larger than any grammar or schema should be")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not valid UTF-8 (byte {e.start})") from None
    try:
        return json_schema_grammar(text) if args.json_schema else text_grammar(text)
    except UserError as e:
        raise UserError(f"{path}: {e}") from None


def check_arguments(args) -> None:
    """Every number flag in its range, as one line before anything loads (argparse checks only the type: -t -1,
    --min-p 5, --repeat-penalty 0 or --temp nan would crash or sample garbage later)."""
    def need(ok: bool, flag: str, value, rule: str) -> None:
        if not ok:
            raise UserError(f"{flag} {value} is out of range: {rule}")
    need(args.threads is None or args.threads >= 1, "-t", args.threads, "at least 1 thread")
    try:
        sampler_from(args)
    except SamplingError as e:    # the Sampler's own check, named by its flag
        need(False, "--" + e.name.replace("_", "-"), e.value, e.rule)
    need(args.n_predict >= -1, "-n", args.n_predict, ">= -1 (-1 = until end of sequence)")
    need(args.ctx_size >= 0, "-c", args.ctx_size, ">= 1 (or 0: the model's default)")
    kv_options_from(args)


def kv_options_from(args) -> KVOptions:
    """The KV flags (--cache-type-k/v, --kv-pages, --kcache, --prompt-pruning, --kv-dir) as load()'s kv."""
    return KVOptions(args.cache_type_k, args.cache_type_v, directory=args.kv_dir, **parse_kv_pages(args.kv_pages),
                     **parse_kcache(args.kcache), **parse_prompt_pruning(args.prompt_pruning))


def open_model(args):
    """(Model, Tokenizer) for the command's flags: -m (or the default model), --ffn, --dram-budget, -c, -t,
    --lookahead, -v, the KV flags, by the library's load()."""
    return load(args.model, args.dram_budget, args.ffn, args.ctx_size, args.threads, args.lookahead, args.verbose,
                sparsity=args.sparsity, kv=kv_options_from(args))


def open_prompt(args):
    """The prompt's source, checked before the model loads: the text of -p, or a binary file (-f FILE, or standard
    input for -p - and -f -) that read_prompt reads once the model's context and vocabulary set its cap."""
    if args.file and args.prompt is not None:
        raise UserError("give the prompt once: -p TEXT or -f FILE, not both")
    if args.prompt == "-" or args.file == "-":
        if sys.stdin is None:
            raise UserError("the prompt is to come from standard input, which is closed")
        return sys.stdin.buffer
    if args.file:
        try:
            return open(args.file, "rb")
        except OSError as e:
            raise UserError(f"cannot read prompt file {args.file}: {e.strerror}") from None
    if args.prompt is None:
        raise UserError("no prompt: pass -p TEXT or -f FILE")
    check_utf8(args.prompt, "prompt")
    return args.prompt


def read_prompt(source, tokenizer: Tokenizer, ctx: int) -> str:
    """The prompt's text, refused once its first pieces hold more than ctx tokens. A file is read only up to the
    bytes ctx tokens can spell (Tokenizer.text_cap), never whole: -f /dev/zero, or an endless pipe."""
    if not isinstance(source, str):
        where = "the prompt on standard input" if source is sys.stdin.buffer else f"prompt file {source.name}"
        cap = tokenizer.text_cap(ctx)
        try:
            raw = source.read(cap + 1)
        except OSError as e:
            raise UserError(f"cannot read {where}: {e.strerror}") from None
        finally:
            if source is not sys.stdin.buffer:
                source.close()
        if len(raw) > cap:
            raise UserError(f"{where} is over {cap} bytes, more than a context of {ctx} tokens can hold "
                            f"({tokenizer.longest_token_bytes} bytes at most per token); "
                            f"raise -c or shorten the prompt")
        try:
            source = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"{where} is not valid UTF-8 (byte {e.start})") from None
    tokenizer.check_length(source, ctx)
    return source


def prompt_ids(tokenizer: Tokenizer, text: str, system: str | None, use_template: bool) -> list[int]:
    if use_template and tokenizer.chat_template:
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        return tokenizer.encode_chat(msgs)
    return tokenizer.encode(text)


def run(args) -> int:
    check_arguments(args)
    source = open_prompt(args)
    grammar = read_grammar(args)
    model, tokenizer = open_model(args)
    text = read_prompt(source, tokenizer, model.ctx)
    ffn = model.ffn
    session = Session(model.transformer, tokenizer, model.ctx)
    session.timings.load_ms = model.load_ms
    ids = prompt_ids(tokenizer, text, args.system_prompt, not args.ignore_chat_template)
    sampler = sampler_from(args)
    processors = []
    if grammar is not None:
        processors.append(Constraint(tokenizer, grammar, model.transformer.cfg.vocab_size))
    raw = args.ignore_chat_template or not tokenizer.chat_template
    context = ids[-StreamDecoder.CONTEXT_IDS:] if raw else []     # a raw prompt's continuation joins its text
    out, stream, shown = [], StreamDecoder(tokenizer, context), ""
    note = None
    if not args.json and raw:
        sys.stdout.write(text)  # a raw prompt is echoed, as llama.cpp does, so the output reads as one text
    try:
        for tok in session.generate(ids, args.n_predict, sampler, args.ignore_eos, processors):
            out.append(tok)
            piece = stream.push(tok)
            if not args.json:
                sys.stdout.write(piece)
                sys.stdout.flush()
            shown += piece
            stop = next((r for r in args.reverse_prompt if r and r in shown), None)
            if stop is not None:
                note = f"reverse prompt {stop!r}"
                break
    except ContextFull as e:
        note = str(e)
    except KeyboardInterrupt:
        note = "interrupted"
    if args.json:
        flash = {"flash": ffn.stats.as_dict()} if ffn is not None else {}
        if streamed_head(model.transformer) is not None:
            flash["head"] = streamed_head(model.transformer).stats.as_dict()
        print(json.dumps({"tokens": out, "text": tokenizer.decode_after(context, out), "prompt_tokens": ids,
                          "timings": session.timings.as_dict(), **flash, **rss_summary(ffn),
                          "kv": {**session.kv.stats.per_token(), "dram_pages": session.kv.dram_pages,
                                 "pages": session.kv.pages},
                          **({"stopped": note} if note else {})}))
    else:
        sys.stdout.write("\n")
        if note:
            print(f"[{note}]", file=sys.stderr)
        session.timings.report(ffn=ffn, head=streamed_head(model.transformer), kv=session.kv if args.verbose else None)
    return 130 if note == "interrupted" else 0
