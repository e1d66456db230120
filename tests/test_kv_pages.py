"""The KV cache in pages (kv_pages): pages on flash give the DRAM cache's logits bit for bit (the exact mode is the
oracle of every budget), Quest's bound is an upper bound of every q.k of its page, q8_0 pages are llama.cpp's blocks
(gguf-py's quantizer as the oracle), and the file of pages leaves nothing behind."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from flashinfer_lite import kv_pages
from flashinfer_lite.kv_pages import PAGE_POSITIONS, KVCache, KVOptions, quest_bounds, quantize_q8_0
from flashinfer_lite.model import load_reference
from storage.errors import UserError

from conftest import DATA, STORIES


def run(model, ids: list[int], n: int, options: KVOptions, ctx: int) -> tuple[np.ndarray, KVCache]:
    """Logits of a prompt (every position) and of n greedy decode steps after it, on a cache kept as `options`."""
    kv = KVCache(model.cfg, ctx, options=options)
    rows = [model.forward(ids, kv, all_logits=True)]
    for _ in range(n):
        rows.append(model.forward([int(np.argmax(rows[-1][-1]))], kv)[None])
    return np.concatenate(rows), kv


def stories_prompt(tok) -> list[int]:
    return tok.encode("Once upon a time, there was a little girl named Lily. She loved to play outside in the park "
                      "with her friends and her dog. One day, Lily saw a big red ball in the grass. She ran to get it, "
                      "but her dog got there first.")


@pytest.mark.parametrize("dram_pages", [0, 1, 2])
def test_pages_on_flash_give_the_dram_caches_logits_bit_for_bit(dram_pages, tmp_path, monkeypatch):
    """A prompt in chunks that cross pages (model.PREFILL_CHUNK_ROWS 24: pages fill mid-chunk and are flushed then;
    its attention over blocks of two pages, some in DRAM, some on flash, some the one being filled), then decode steps
    over a context of 3+ pages: every logit equal to the all-DRAM cache's, and the file of pages (unlinked at
    creation) leaves nothing in the directory."""
    from flashinfer_lite import model as model_math
    monkeypatch.setattr(model_math, "PREFILL_CHUNK_ROWS", 24)
    monkeypatch.setattr(model_math, "ATTENTION_KEY_BLOCK", 2 * PAGE_POSITIONS)     # a prompt's blocks cross flash
    model, tok = load_reference(STORIES)
    ids = stories_prompt(tok)
    assert len(ids) > 2 * PAGE_POSITIONS
    want, _ = run(model, ids, 40, KVOptions(), 160)
    got, kv = run(model, ids, 40, KVOptions(dram_pages=dram_pages, directory=str(tmp_path)), 160)
    assert kv.on_flash >= model.cfg.n_layers * (3 - dram_pages)        # the pages past the DRAM share were written
    assert kv.stats.flash_pages_read > 0
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert list(tmp_path.iterdir()) == []


def test_a_context_cut_inside_a_flushed_page_reads_it_back(tmp_path):
    """A chat's next turn keeps a prefix that ends inside a page already on flash (Session.generate: kv.reset(keep)):
    the page comes back from the file, and the logits equal the DRAM cache's; with Quest too (its bounds of that page
    rebuilt from the rows kept)."""
    model, tok = load_reference(STORIES)
    ids = stories_prompt(tok)
    keep = PAGE_POSITIONS + 5
    other = ids[:keep] + tok.encode(" the sun was shining and the birds sang")
    outs = []
    for options in (KVOptions(), KVOptions(dram_pages=0, directory=str(tmp_path)), KVOptions(quest_pages=1),
                    KVOptions(quest_pages=1, dram_pages=0, directory=str(tmp_path))):
        kv = KVCache(model.cfg, 160, options=options)
        model.forward(ids, kv)
        kv.reset(keep)
        logits = [model.forward(other[keep:], kv, all_logits=True)]
        for _ in range(8):                      # decode steps: Quest's bounds of the page cut, recomputed
            logits.append(model.forward([int(np.argmax(logits[-1][-1]))], kv)[None])
        outs.append(np.concatenate(logits))
    assert np.array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32))
    assert np.array_equal(outs[2].view(np.uint32), outs[3].view(np.uint32))


def test_q8_0_cache_on_flash_equals_q8_0_in_dram_and_stays_close_to_f16(smollm2_gguf, tmp_path):
    """q8_0 keys and values (SmolLM2: head_dim 64, two blocks a head): pages on flash give the q8_0 DRAM cache's bits;
    and the quantized cache's logits stay near the float16 cache's."""
    model, tok = load_reference(smollm2_gguf)
    ids = tok.encode("The capital of France is Paris. The capital of Germany is Berlin. The capital of Spain is "
                     "Madrid. The capital of Portugal is Lisbon. The capital of Austria is Vienna. The capital of "
                     "Italy is")
    assert len(ids) > PAGE_POSITIONS
    q8 = dict(type_k="q8_0", type_v="q8_0")
    want, _ = run(model, ids, 8, KVOptions(**q8), 64)
    got, kv = run(model, ids, 8, KVOptions(dram_pages=0, directory=str(tmp_path), **q8), 64)
    assert kv.on_flash > 0
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    f16, _ = run(model, ids, 8, KVOptions(), 64)
    assert not np.array_equal(f16, want)                                    # the cache type is in effect
    np.testing.assert_allclose(want, f16, atol=0.05 * np.abs(f16).max())


def test_q8_0_blocks_are_gguf_pys(tmp_path):
    """quantize_q8_0's bytes equal gguf-py's quantizer's (llama.cpp's quantize_row_q8_0 ported), on keys' kind of
    values: normal, a zero block, tiny and large magnitudes, halves that round away from zero."""
    gguf = pytest.importorskip("gguf")
    from gguf.quants import quantize
    rng = np.random.default_rng(7)
    x = rng.standard_normal((6, 2, 64)).astype(np.float32) * np.float32(3)
    x[0, 0, :32] = 0                                      # d = 0: q all zero
    x[1, 1] *= np.float32(1e-6)
    x[2, 0] *= np.float32(2000)
    x[3, 1, :32] = np.arange(32, dtype=np.float32) - 15.5    # amax 15.5: x / d hits .5 steps
    want = quantize(x.reshape(-1, 64), gguf.GGMLQuantizationType.Q8_0)
    got = quantize_q8_0(x.reshape(-1, 64))
    assert got.dtype == np.uint8 and got.shape == want.shape
    assert np.array_equal(got, want)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, PAGE_POSITIONS), st.sampled_from([(1, 1), (2, 4), (2, 1)]),
       st.integers(-20, 20))
def test_quest_bound_is_at_least_every_qk_of_its_page(seed, rows, heads, exponent):
    """For any query and any keys of a page (1 to PAGE_POSITIONS rows, any GQA group), the bound sum_c max(q_c min_c,
    q_c max_c) is >= q.k of every key of the page. Values are integers times a power of two, so that every product
    and sum is exact in float64: the comparison needs no tolerance, and a wrong formula (max(q_c max_c) alone, the
    sum of the maxima over the page's rows) fails it."""
    Hkv, g = heads
    rng = np.random.default_rng(seed)
    hd = 16
    keys = rng.integers(-1000, 1001, (rows, Hkv, hd)).astype(np.float64) * 2.0 ** exponent
    q = rng.integers(-1000, 1001, (Hkv, g, hd)).astype(np.float64)
    b = quest_bounds(q, keys.min(axis=0)[None], keys.max(axis=0)[None])        # [Hkv, g, 1]
    qk = np.einsum("cgd,rcd->cgr", q, keys)                                    # every q.k [Hkv, g, rows]
    assert np.all(b >= qk)
    if rows == 1:                                                              # one key: the bound is its q.k
        assert np.array_equal(b, qk)


def test_quest_reads_the_first_the_latest_and_the_top_pages_round_robin_over_kv_heads():
    """select: the first page, the latest and pages_read pages more, taken by rank round robin over the KV heads (each
    head's bound the largest over its group's queries: GQA), every head reading all of them: a page holds every
    head's keys, so the pages read are never more than asked. Here one page is made to win for each head's second
    query."""
    cfg = type("C", (), dict(n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8))
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((10 * PAGE_POSITIONS, 2, 8)).astype(np.float32) * 0.1
    keys[3 * PAGE_POSITIONS + 4, 0] = 5.0                  # page 3 wins for KV head 0's queries along +1
    keys[6 * PAGE_POSITIONS + 9, 1] = -5.0                 # page 6 for KV head 1's along -1
    q = np.zeros((4, 8), np.float32)
    q[1] = 1.0                                             # head 1: KV head 0's group (heads 0, 1)
    q[3] = -1.0                                            # head 3: KV head 1's group (heads 2, 3)
    for pages, want in ((1, [0, 3, 9]), (2, [0, 3, 6, 9])):
        kv = KVCache(cfg, 10 * PAGE_POSITIONS, options=KVOptions(quest_pages=pages))
        kv.write(0, 0, keys, keys)
        chosen = kv.select(0, q, 9)
        assert chosen.shape == (10, 2)
        for c in range(2):
            assert sorted(np.flatnonzero(chosen[:, c])) == want, (pages, c)
    # with 3 pages, the next by rank: head 0's second (6, in already), then head 1's second (a plain loop as oracle)
    kv = KVCache(cfg, 10 * PAGE_POSITIONS, options=KVOptions(quest_pages=3))
    kv.write(0, 0, keys, keys)
    stored = keys.astype(np.float16).astype(np.float32).reshape(10, PAGE_POSITIONS, 2, 8)   # the bounds as stored
    b = quest_bounds(q.reshape(2, 2, 8), stored.min(axis=1), stored.max(axis=1)).max(axis=1)
    ranks = [sorted(range(1, 9), key=lambda p: (-b[c, p], p)) for c in range(2)]
    picked = []
    for r in range(8):
        for c in range(2):
            if len(picked) < 3 and ranks[c][r] not in picked:
                picked.append(ranks[c][r])
    assert picked[:2] == [3, 6]
    for c in range(2):
        assert sorted(np.flatnonzero(kv.select(0, q, 9)[:, c])) == sorted([0, *picked, 9])


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 24), st.sampled_from([0.1, 0.25, 0.5, 1.0]), st.integers(1, 12),
       st.sampled_from([(1, 1), (2, 2), (2, 1), (4, 2)]))
def test_quest_reads_its_share_of_the_pages_and_never_fewer_than_its_floor(seed, n, share, floor, heads):
    """With a share (--kv-pages P%), a decode step reads max(quest_min_pages, int(share x pages)) pages besides the
    first and the latest (every page of a context that has no more), chosen as a float64 numpy oracle does: each
    page's bound per KV head (the largest over its group's queries), pages ranked by it (ties to the earlier), taken
    round robin over the KV heads until that many are in. Keys and queries are small integers (each page scaled by
    its own factor, so bounds spread): float16 holds them and float32 sums them exactly, so the ranks agree."""
    Hkv, g = heads
    hd, P = 8, PAGE_POSITIONS
    cfg = type("C", (), dict(n_layers=1, n_heads=Hkv * g, n_kv_heads=Hkv, head_dim=hd))
    rng = np.random.default_rng(seed)
    keys = rng.integers(-30, 31, (n, P, Hkv, hd)) * rng.integers(1, 5, (n, 1, 1, 1))
    q = rng.integers(-30, 31, (Hkv * g, hd))
    kv = KVCache(cfg, n * P, options=KVOptions(quest_share=share, quest_min_pages=floor))
    kv.write(0, 0, keys.reshape(n * P, Hkv, hd).astype(np.float32), keys.reshape(n * P, Hkv, hd).astype(np.float32))
    got = set(np.flatnonzero(kv.select(0, q.astype(np.float32), n - 1).any(axis=1)))
    keep = max(floor, int(share * n))
    if n <= keep + 2:
        want = set(range(n))
    else:
        lo, hi = keys.min(axis=1).astype(np.float64), keys.max(axis=1).astype(np.float64)     # [n, Hkv, hd]
        qg = q.reshape(Hkv, g, 1, hd).astype(np.float64)
        bound = np.maximum(qg * lo.transpose(1, 0, 2)[:, None], qg * hi.transpose(1, 0, 2)[:, None]).sum(-1).max(1)
        ranks = [sorted(range(1, n - 1), key=lambda p: (-bound[c, p], p)) for c in range(Hkv)]
        picked: list[int] = []
        for r in range(n - 2):
            for c in range(Hkv):
                if len(picked) < keep and ranks[c][r] not in picked:
                    picked.append(ranks[c][r])
        want = {0, n - 1, *picked}
    assert got == want
    assert len(got) == min(n, keep + 2)


def test_quest_is_deterministic_off_by_default_and_exact_when_it_reads_every_page():
    """Quest is off unless asked; asked with as many pages as the context has, its logits are the exact mode's bits;
    with fewer, two runs give the same bits and it reads fewer pages than the exact mode. A share of a context shorter
    than Quest's floor reads every page: the exact mode's bits too."""
    assert not KVOptions().quest
    model, tok = load_reference(STORIES)
    ids = stories_prompt(tok) * 3
    exact, kv_exact = run(model, ids, 24, KVOptions(), 320)
    every, _ = run(model, ids, 24, KVOptions(quest_pages=100), 320)
    assert np.array_equal(every.view(np.uint32), exact.view(np.uint32))
    floor, kv_floor = run(model, ids, 24, KVOptions(quest_share=0.25), 320)
    assert np.array_equal(floor.view(np.uint32), exact.view(np.uint32))
    assert kv_floor.stats.pages_read == kv_exact.stats.pages_read
    quarter, kv_quarter = run(model, ids, 24, KVOptions(quest_share=0.25, quest_min_pages=1), 320)
    assert kv_quarter.stats.pages_read < kv_exact.stats.pages_read and not np.array_equal(quarter, exact)
    a, kv_a = run(model, ids, 24, KVOptions(quest_pages=2), 320)
    b, _ = run(model, ids, 24, KVOptions(quest_pages=2), 320)
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    assert kv_a.stats.pages_read < kv_exact.stats.pages_read
    assert not np.array_equal(a, exact)                    # it did leave pages out


def test_kv_options_refuse_bad_values_in_one_line():
    with pytest.raises(UserError, match="--cache-type-k 'q4_0'"):
        KVOptions(type_k="q4_0")
    for bad in ("0", "150%", "x"):
        with pytest.raises(UserError, match="--kv-pages"):
            kv_pages.parse_kv_pages(bad)
    assert kv_pages.parse_kv_pages("25%") == {"quest_share": 0.25}
    assert kv_pages.parse_kv_pages("8") == {"quest_pages": 8}
    with pytest.raises(UserError, match="--kv-pages"):
        KVOptions(quest_share=0.25, quest_min_pages=0)
    cfg = type("C", (), dict(n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8))
    with pytest.raises(UserError, match="q8_0 KV needs a head dimension"):
        KVCache(cfg, 8, options=KVOptions(type_v="q8_0"))


@pytest.mark.parametrize("window", [None, 5, 40])
@pytest.mark.parametrize("block_pages", [1, 2, 16])
def test_prompt_attention_over_blocks_matches_float64(window, block_pages, monkeypatch, tmp_path):
    """model.prompt_attention's online softmax over blocks of keys (1, 2 or 16 pages; a chunk at position 50 of a
    context of 130, some pages on flash) against float64 attention over the float16 keys and values the cache holds."""
    from types import SimpleNamespace
    from flashinfer_lite import model as model_math
    from test_decode_kernels import attention64
    monkeypatch.setattr(model_math, "ATTENTION_KEY_BLOCK", block_pages * PAGE_POSITIONS)
    rng = np.random.default_rng(block_pages)
    H, Hkv, hd, S, pos0 = 6, 2, 16, 130, 50
    cfg = SimpleNamespace(n_layers=1, n_heads=H, n_kv_heads=Hkv, head_dim=hd)
    kv = KVCache(cfg, S, options=KVOptions(dram_pages=1, directory=str(tmp_path)))
    keys = rng.standard_normal((S, Hkv, hd)).astype(np.float32) * 2
    values = rng.standard_normal((S, Hkv, hd)).astype(np.float32)
    kv.write(0, 0, keys, values)
    q = rng.standard_normal((S - pos0, H, hd)).astype(np.float32)
    got = model_math.prompt_attention(q, kv, 0, pos0, window, np.float32(1 / np.sqrt(hd)))
    K, V = (b.view(np.float16).astype(np.float64) for b in kv.rows(0, 0, S))
    want = attention64(q.astype(np.float64), K, V, pos0, window or 0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_the_minimum_budget_does_not_grow_with_the_context_by_more_than_page_metadata():
    """modes.minimum_bytes (the planner's) of a GGUF at -c 512 and -c 8192: the KV pages can go to flash, so the
    minimum grows by the fixed part's per-position bytes (a decode step's scores, the pages' flags and ids), not by
    the KV cache (which grows 16x: 2 x layers x Hkv x hd x 2 bytes a position)."""
    from flashinfer_lite.modes import minimum_bytes
    from flashinfer_lite.runtime import model_facts
    cfg, layout, kinds = model_facts(str(DATA / "gguf" / "qwen2-q4_k_m.gguf"))
    small, large = (minimum_bytes(cfg, layout, kinds, "auto", c, 0) for c in (512, 8192))
    whole = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 2 * (8192 - 512)
    per_position = 2 * cfg.n_heads * 4 + (2 * cfg.n_layers + cfg.n_kv_heads + 8) / PAGE_POSITIONS
    assert 0 < large - small <= (8192 - 512) * per_position < whole / 8


def test_the_plan_puts_the_kv_pages_it_has_no_room_for_on_flash_and_says_so():
    """plan_budget between its minimum and the whole KV: the pages that fit (per layer, from the first) in DRAM, the
    rest on flash, and the table's kv line says both; at the minimum none in DRAM; with room, all."""
    from flashinfer_lite.budget import kv_minimum_bytes, plan_budget
    from flashinfer_lite.runtime import model_facts
    cfg, layout, kinds = model_facts(str(DATA / "gguf" / "qwen2-q4_k_m.gguf"))
    ctx, per_page = 4096, kv_pages.dram_page_bytes(cfg, KVOptions())
    low = plan_budget(cfg, layout, 1 << 60, ctx).minimum_bytes
    at_min = plan_budget(cfg, layout, low, ctx)
    half = plan_budget(cfg, layout, low + 50 * per_page + per_page // 2, ctx)
    whole = plan_budget(cfg, layout, 1 << 60, ctx)
    assert (at_min.kv_dram_pages, half.kv_dram_pages, whole.kv_dram_pages) == (0, 50, ctx // PAGE_POSITIONS)
    assert at_min.kv_bytes == kv_minimum_bytes(cfg, ctx) and half.kv_bytes == at_min.kv_bytes + 50 * per_page
    assert half.used_bytes <= half.budget_bytes
    assert "4096 positions, f16/f16: 50 of 128 pages per layer in DRAM, 78 on flash" in half.table()


def test_a_run_at_its_minimum_budget_puts_the_kv_on_flash_and_decodes_the_same_tokens(tmp_path):
    """load_runtime of a GGUF at its plan's minimum: no KV page in DRAM (the plan's and the model's cache agree), the
    file in --kv-dir, and the greedy tokens of a run with no budget (every page in DRAM)."""
    from flashinfer_lite.modes import minimum_bytes
    from flashinfer_lite.runtime import load_runtime, model_facts
    from conftest import greedy_tokens
    gguf = str(DATA / "gguf" / "qwen2-q8_0.gguf")     # not real_ggufs' fixture: a run records its loading peak
    whole, tok, _ = load_runtime(gguf, "auto", ctx=256, base_bytes=0, dram_budget=1 << 40)    # from flash, roomy
    ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 6)
    want = greedy_tokens(whole, ids, 24, ctx=256)
    kv_dir = tmp_path / "kv"
    kv_dir.mkdir()
    minimum = minimum_bytes(*model_facts(gguf), "auto", 256, 0, heap_slack_bytes=0)     # base 0: no heap slack
    tight, _, ffn = load_runtime(gguf, "auto", ctx=256, base_bytes=0, dram_budget=minimum,
                                 kv=KVOptions(directory=str(kv_dir)))
    assert ffn.plan.kv_dram_pages == 0 and tight.kv_options.dram_pages == 0
    assert whole.kv_options.dram_pages == 256 // PAGE_POSITIONS
    assert greedy_tokens(tight, ids, 24, ctx=256) == want
    assert list(kv_dir.iterdir()) == []
    with pytest.raises(UserError, match="--kv-dir .*: not a directory"):
        load_runtime(gguf, "auto", ctx=256, base_bytes=0, kv=KVOptions(directory=str(tmp_path / "missing")))


def test_two_loads_in_one_process_plan_and_keep_their_own_kv_options():
    """The KV options are the load's, carried by its files to its plan and its caches: a load after another with
    other options changes nothing of the first (a process-wide setting once did: the first load's plan then said,
    and its minimum counted, the second's options)."""
    from flashinfer_lite.runtime import load_runtime
    gguf = str(DATA / "gguf" / "qwen2-q8_0.gguf")
    quest = KVOptions(quest_pages=2)
    q, _, q_ffn = load_runtime(gguf, "auto", ctx=256, base_bytes=0, dram_budget=1 << 40, kv=quest)
    exact, _, exact_ffn = load_runtime(gguf, "auto", ctx=256, base_bytes=0, dram_budget=1 << 40)
    assert (q.new_cache(256).options.quest_pages, exact.new_cache(256).options.quest_pages) == (2, 0)
    assert "Quest reads" in q_ffn.plan.table() and "Quest" not in exact_ffn.plan.table()
    # every page in DRAM in both: the plans' KV shares differ by kv_pages' bytes of their own options (Quest's bounds)
    assert q_ffn.plan.kv_bytes - exact_ffn.plan.kv_bytes == \
        kv_pages.all_bytes(q.cfg, 256, quest) - kv_pages.all_bytes(q.cfg, 256, KVOptions()) > 0
    assert q_ffn.plan.minimum_bytes > exact_ffn.plan.minimum_bytes


def test_the_cli_refuses_bad_kv_flags_in_one_line():
    import subprocess
    import sys
    for flags, said in ((["--kv-pages", "0"], "--kv-pages '0'"), (["--cache-type-v", "q4_0"], "invalid choice")):
        r = subprocess.run([sys.executable, "-m", "flashinfer_lite", "generate", "-m", str(STORIES), "-p", "hi",
                            *flags], capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and said in r.stderr and "Traceback" not in r.stderr, r.stderr
    # --kcache: one line "error: ..." and exit 1, before any model loads (eval: before its dense reference; serve:
    # before it listens): a weight out of range, not a number, or with Quest (KCache scores every page's keys)
    missing = str(DATA / "no-such-model.gguf")
    for command, flags, said in (("generate", ["--kcache", "1.5"], "--kcache 1.5: a softmax weight"),
                                 ("chat", ["--kcache", "-0.1"], "--kcache -0.1: a softmax weight"),
                                 ("serve", ["--kcache", "abc"], "--kcache 'abc': a softmax weight"),
                                 ("eval", ["--kcache", "0.01", "--kv-pages", "25%", "--corpus", missing],
                                  "--kcache with --kv-pages")):
        r = subprocess.run([sys.executable, "-m", "flashinfer_lite", command, "-m", missing, *flags],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 1 and r.stderr.strip().splitlines() == [r.stderr.strip()], (command, r.stderr)
        assert r.stderr.startswith("error: ") and said in r.stderr, (command, r.stderr)


@pytest.mark.parametrize("command", ["generate", "chat", "serve", "eval"])
def test_the_kcache_flag_becomes_the_loads_kv_options(command):
    """--kcache W of every command that loads a model is KVOptions(kcache=W), beside the other KV flags; "off" and
    no flag: 0 (every page's values)."""
    from flashinfer_lite.cli import build_parser
    from flashinfer_lite.generate import kv_options_from
    need = ["--corpus", "x.txt"] if command == "eval" else []
    parse = build_parser(command).parse_args
    args = parse([command, "-m", "x.gguf", *need, "--kcache", "0.002", "--cache-type-k", "q8_0"])
    assert kv_options_from(args) == KVOptions(type_k="q8_0", kcache=0.002)
    for off in ([], ["--kcache", "off"], ["--kcache", "0"]):
        assert kv_options_from(parse([command, "-m", "x.gguf", *need, *off])).kcache == 0.0
    with pytest.raises(UserError, match="--kcache with --kv-pages"):
        KVOptions(kcache=0.01, quest_pages=4)       # the API refuses the pair as the flags are refused


def test_generate_with_kcache_reads_fewer_value_pages_than_keys():
    """generate --kcache reaches the model's cache: --json's kv counts every page's keys read and, at a weight
    hardly any position reaches, the values of fewer pages (at least the first and the latest of each layer's);
    without it, as many value pages as key pages."""
    import json
    import subprocess
    import sys

    def kv(*flags):
        r = subprocess.run([sys.executable, "-m", "flashinfer_lite", "generate", "-m", str(STORIES), "-p",
                            "Once upon a time, there was a little girl named Lily. She loved to play outside " * 5,
                            "-n", "12", "--temp", "0", "--json", *flags], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout.strip().splitlines()[-1])["kv"]
    exact, kcache = kv(), kv("--kcache", "0.9")
    assert exact["value_pages_read"] == exact["pages_read"] == kcache["pages_read"] >= 4 * 5   # 4+ pages x 5 layers
    assert 2 * 5 <= kcache["value_pages_read"] < kcache["pages_read"]


def test_without_o_direct_the_file_is_buffered_and_the_bits_are_the_same(tmp_path, monkeypatch):
    """Where O_DIRECT is refused (here: not offered), the file of pages is opened buffered, describe() says so, and
    the logits are the DRAM cache's."""
    import os
    model, tok = load_reference(STORIES)
    ids = stories_prompt(tok)
    want, _ = run(model, ids, 8, KVOptions(), 128)
    monkeypatch.delattr(os, "O_DIRECT")
    got, kv = run(model, ids, 8, KVOptions(dram_pages=0, directory=str(tmp_path)), 128)
    assert kv.file is not None and not kv.file.direct and "buffered" in kv.describe()
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_reads_from_flash_run_a_batch_ahead_and_change_no_byte(tmp_path, monkeypatch):
    """Two decode steps over 3 layers whose pages are on flash (batches of 2 pages): every read of the file but the
    first of all (layer 0's first keys) was in flight before attention asked for it (the values' first batch during
    the keys' last, the next layer's first during this layer's values, the next step's layer 0 during the last
    layer's), and each output equals float64 attention over the float16 keys and values written."""
    from types import SimpleNamespace
    from test_decode_kernels import attention64
    monkeypatch.setattr(kv_pages, "STAGE_PAGES", 2)
    rng = np.random.default_rng(5)
    L, H, Hkv, hd, n = 3, 4, 2, 16, 260          # pages 1..7 on flash (0 in DRAM), page 8 being filled
    cfg = SimpleNamespace(n_layers=L, n_heads=H, n_kv_heads=Hkv, head_dim=hd)
    kv = KVCache(cfg, 9 * PAGE_POSITIONS, options=KVOptions(dram_pages=1, directory=str(tmp_path)))
    keys, values = rng.standard_normal((2, L, n + 2, Hkv, hd)).astype(np.float32)
    for layer in range(L):
        kv.write(layer, 0, keys[layer, :n], values[layer, :n])
    no_rope, scale = np.zeros((1, 0), np.float32), np.float32(1 / np.sqrt(hd))
    for pos in (n, n + 1):
        for layer in range(L):
            q = rng.standard_normal((1, H, hd)).astype(np.float32)
            out = np.empty((1, H, hd), np.float32)
            kv.attend(layer, q, keys[layer, pos:pos + 1].copy(), values[layer, pos:pos + 1].copy(), no_rope, no_rope,
                      pos, 0, scale, out)
            K, V = (x[layer, :pos + 1].astype(np.float16).astype(np.float64) for x in (keys, values))
            want = attention64(q.astype(np.float64), K, V, pos, 0)
            np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert kv.stats.flash_reads == 2 * L * 2 * 7               # steps x layers x (keys, values) x pages 1..7
    assert kv.stats.flash_reads_ahead == kv.stats.flash_reads - 2
    kv.close()
    assert list(tmp_path.iterdir()) == []


def test_a_read_ahead_of_a_page_written_again_is_not_used(tmp_path, monkeypatch):
    """A context cut at the last row of a page on flash (reset) and that row written anew: layer 0's step reads the
    next layer's pages ahead, page 1 as the file held it; layer 1's write then completes page 1 and writes it to the
    file again. The output is attention over the new row, not the old one read ahead."""
    from types import SimpleNamespace
    from test_decode_kernels import attention64
    monkeypatch.setattr(kv_pages, "STAGE_PAGES", 2)
    rng = np.random.default_rng(9)
    L, H, Hkv, hd, P = 2, 2, 1, 16, PAGE_POSITIONS
    cfg = SimpleNamespace(n_layers=L, n_heads=H, n_kv_heads=Hkv, head_dim=hd)
    kv = KVCache(cfg, 4 * P, options=KVOptions(dram_pages=0, directory=str(tmp_path)))
    keys, values = rng.standard_normal((2, L, 3 * P, Hkv, hd)).astype(np.float32) * 3
    for layer in range(L):
        kv.write(layer, 0, keys[layer], values[layer])          # pages 0-2, all in the file
    kv.reset(2 * P - 1)
    no_rope, scale = np.zeros((1, 0), np.float32), np.float32(1 / np.sqrt(hd))
    for layer in range(L):
        k, v = rng.standard_normal((2, 1, Hkv, hd)).astype(np.float32) * 3
        keys[layer, 2 * P - 1], values[layer, 2 * P - 1] = k[0], v[0]
        q = rng.standard_normal((1, H, hd)).astype(np.float32)
        out = np.empty((1, H, hd), np.float32)
        kv.attend(layer, q, k, v, no_rope, no_rope, 2 * P - 1, 0, scale, out)
        K, V = (x[layer, :2 * P].astype(np.float16).astype(np.float64) for x in (keys, values))
        np.testing.assert_allclose(out, attention64(q.astype(np.float64), K, V, 2 * P - 1, 0), rtol=1e-5, atol=1e-5)
    kv.close()


@pytest.mark.parametrize("refuses", ["open", "io"])
def test_the_page_file_falls_back_to_buffered_io_where_o_direct_is_refused(tmp_path, monkeypatch, refuses):
    """The KV pages' file opens as the bundle reader's files do (storage.reader.open_direct): O_DIRECT where the
    filesystem takes it, else buffered, whether the flag itself is refused (EINVAL at open, tmpfs before Linux 6.6) or
    only the I/O is (EINVAL at the probe). Buffered, a page written reads back as written."""
    import errno
    import os
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform")
    real_open, real_pwrite = os.open, os.pwrite
    direct_fds, opened_direct = set(), []

    def open_(p, flags, *a):
        if flags & os.O_DIRECT and refuses == "open":
            raise OSError(errno.EINVAL, "Invalid argument")
        fd = real_open(p, flags, *a)
        (direct_fds.add if flags & os.O_DIRECT else direct_fds.discard)(fd)     # a closed fd's number comes back
        opened_direct.extend([True] if flags & os.O_DIRECT else [])
        return fd

    def pwrite(fd, buf, offset):
        if fd in direct_fds:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, buf, offset)
    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(os, "pwrite", pwrite)
    f = kv_pages.PageFile(tmp_path, (kv_pages.FILE_ALIGN, kv_pages.FILE_ALIGN), 1, 2)
    try:
        assert not f.direct and not list(tmp_path.iterdir())        # buffered, and unlinked: nothing left behind
        assert opened_direct == ([True] if refuses == "io" else [])     # the flag taken, the probe refused
        page = np.arange(kv_pages.FILE_ALIGN, dtype=np.uint8)
        f.write(1, 0, 1, page)
        got = np.zeros((1, kv_pages.FILE_ALIGN), np.uint8)
        f.read(1, 0, np.array([1]), got)
        np.testing.assert_array_equal(got[0], page)
    finally:
        f.close()


def test_kcache_reads_the_values_of_the_heavy_pages_and_moves_attention_by_at_most_the_weight_left_out(tmp_path):
    """KCache: a decode step reads every page's keys and the values only of the pages where a position's softmax
    weight reaches the threshold for some head (and the first and the latest). Against float64 attention over the
    float16 keys and values written: each head's output moves by at most twice the weight left out times the largest
    |value|; threshold 0 is the exact mode, bit for bit."""
    from types import SimpleNamespace
    from test_decode_kernels import attention64
    rng = np.random.default_rng(7)
    H, Hkv, hd, n, P = 4, 2, 16, 300, PAGE_POSITIONS
    cfg = SimpleNamespace(n_layers=1, n_heads=H, n_kv_heads=Hkv, head_dim=hd)
    keys, values = rng.standard_normal((2, n + 1, Hkv, hd)).astype(np.float32)
    q = 2 * rng.standard_normal((1, H, hd)).astype(np.float32)
    no_rope, scale = np.zeros((1, 0), np.float32), np.float32(1 / np.sqrt(hd))

    def step(options):
        kv = KVCache(cfg, 10 * P, options=replace(options, dram_pages=1, directory=str(tmp_path)))
        kv.write(0, 0, keys[:n], values[:n])
        out = np.empty((1, H, hd), np.float32)
        kv.attend(0, q.copy(), keys[n:n + 1].copy(), values[n:n + 1].copy(), no_rope, no_rope, n, 0, scale, out)
        kv.close()
        return out, kv.stats
    exact, _ = step(KVOptions())
    same, _ = step(KVOptions(kcache=0.0))
    assert np.array_equal(same.view(np.uint32), exact.view(np.uint32))
    threshold = 0.065         # the pages' largest weights here: 0.02-0.1
    got, stats = step(KVOptions(kcache=threshold))
    K, V = (x.astype(np.float16).astype(np.float64) for x in (keys, values))
    g = H // Hkv
    w = np.stack([np.exp(s - s.max()) / np.exp(s - s.max()).sum()
                  for s in (K[:, h // g] @ q[0, h].astype(np.float64) / np.sqrt(hd) for h in range(H))])   # [H, n+1]
    peak = np.zeros(10 * P)
    peak[:n + 1] = w.max(axis=0)
    heavy = peak.reshape(10, P).max(axis=1) >= threshold
    heavy[0] = heavy[n // P] = True
    assert stats.pages_read == n // P + 1 and stats.value_pages_read == heavy.sum()
    assert 2 < stats.value_pages_read < stats.pages_read          # some pages' values read, not all
    left_out = np.array([w[h, ~np.repeat(heavy, P)[:n + 1]].sum() for h in range(H)])
    want = attention64(q.astype(np.float64), K, V, n, 0)
    err = np.abs(got - want).max(axis=2)[0]
    assert (left_out > 0).all() and (err <= 2 * left_out * np.abs(V).max() + 1e-5).all(), (err, left_out)
    with pytest.raises(UserError, match="--kcache 1: a softmax weight"):
        KVOptions(kcache=1.0)
