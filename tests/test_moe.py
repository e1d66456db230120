"""Mixtures of experts from flash (issue 30): experts converted into checksummed chunks, read whole through the
expert cache; the same bits at every --dram-budget, thread count and overlap setting, equal to every expert in DRAM,
and transformers' logits and greedy tokens."""
import json

import numba
import numpy as np
import pytest

from conftest import TINY_MOE, transformers_model
from flashinfer_lite.runtime import load_runtime
from storage.convert import convert
from storage.errors import UserError
from storage.format import read_layout, verify


@pytest.fixture(scope="module")
def flashdirs(tiny_model, tmp_path_factory):
    """flashdirs(kind, dtype) -> a FLASHDIR of the tiny mixture of experts `kind` (converted once)."""
    made = {}

    def make(kind, dtype):
        if (kind, dtype) not in made:
            out = tmp_path_factory.mktemp(f"{kind}_{dtype}") / "flash"
            made[kind, dtype] = convert(tiny_model(kind), out, dtype=dtype, progress=False)
        return made[kind, dtype]
    return make


def greedy(model, prompt, n, ctx=64):
    """(logits of the prompt and of each decoded token [len(prompt) + n, V], the decoded tokens)."""
    kv = model.new_cache(ctx)
    out = [model.forward(prompt, kv, all_logits=True)]
    tokens = []
    for _ in range(n):
        tokens.append(int(np.argmax(out[-1][-1])))
        out.append(model.forward([tokens[-1]], kv)[None, :])
    return np.concatenate(out), tokens


PROMPT = np.random.default_rng(5).integers(3, 512, size=11).tolist()


@pytest.mark.parametrize("kind", sorted(TINY_MOE))
def test_experts_from_flash_match_transformers(flashdirs, tiny_model, kind):
    import torch
    flash = flashdirs(kind, "f32")
    L = read_layout(flash)
    assert L.experts is not None and L.experts.chunk % 4096 == 0 and not L.n_layers
    model, _, rt = load_runtime(flash, "auto", dram_budget=None, base_bytes=0)
    got, tokens = greedy(model, PROMPT, 8)
    hf = transformers_model(tiny_model(kind))
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT + tokens])).logits[0].numpy()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
    ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=8, min_new_tokens=8, do_sample=False)[0].tolist()
    assert PROMPT + tokens == ref
    E = L.experts            # no budget: every expert pinned, each read once before the first token
    assert rt.stats.misses == 0 and rt.stats.read_bytes == E.n_layers * E.n_experts * E.chunk


@pytest.mark.parametrize("kind,dtype", [("qwen2moe", "f16"), ("qwen3moe", "q8_0"), ("mixtral", "q4_0")])
def test_same_bits_at_every_budget_thread_count_and_overlap(flashdirs, kind, dtype):
    """Every expert in DRAM (--ffn dense) is the reference; from flash at no budget, at the minimum (2 slots a layer:
    experts evicted and read again within a token's prompt) and between, on 1 and 2 threads, overlap on and off, and
    with the next layer's reads started early on a guess, the logits are the same bits."""
    flash = flashdirs(kind, dtype)
    want, _ = greedy(load_runtime(flash, "dense")[0], PROMPT, 6)
    _, _, rt = load_runtime(flash, "auto", dram_budget=None, base_bytes=0)
    plan = rt.plan
    per_slot = plan.n_layers * plan.chunk
    most = max(1, numba.config.NUMBA_NUM_THREADS)
    seen = set()
    for budget in (None, plan.minimum_bytes, plan.minimum_bytes + per_slot):
        for threads in sorted({1, most}):
            for overlap in (True, False):
                model, _, rt = load_runtime(flash, "auto", dram_budget=budget, base_bytes=0)
                rt.overlap = overlap
                before = numba.get_num_threads()
                numba.set_num_threads(threads)
                try:
                    got, _ = greedy(model, PROMPT, 6)
                finally:
                    numba.set_num_threads(before)
                assert np.array_equal(got, want), (budget, threads, overlap)
                seen.add((rt.plan.slots, rt.stats.misses))
    for budget in (plan.minimum_bytes, plan.minimum_bytes + per_slot):    # reads started a layer early on a guess
        model, _, rt = load_runtime(flash, "auto", dram_budget=budget, base_bytes=0, lookahead=True)
        got, _ = greedy(model, PROMPT, 6)
        assert np.array_equal(got, want) and rt.stats.prefetched > 0, budget
    slots = sorted(s for s, _ in seen)
    assert slots[0] == 2 and slots[-1] == plan.n_experts          # the budgets did make different caches
    assert len({m for _, m in seen}) > 1                           # and different reads


def test_a_budget_below_the_minimum_is_refused(flashdirs):
    flash = flashdirs("mixtral", "f16")
    _, _, rt = load_runtime(flash, "auto", dram_budget=None, base_bytes=0)
    with pytest.raises(UserError, match="below the minimum"):
        load_runtime(flash, "auto", dram_budget=rt.plan.minimum_bytes - 1, base_bytes=0)
    with pytest.raises(UserError, match="mixture of experts runs --ffn auto"):
        load_runtime(flash, "predicted", base_bytes=0)


def test_a_damaged_expert_is_named(flashdirs, tmp_path):
    import shutil
    flash = shutil.copytree(flashdirs("olmoe", "f16"), tmp_path / "damaged")
    L = read_layout(flash)
    with open(L.ffn_path, "r+b") as f:
        f.seek(L.experts.chunk_offset(1, 2) + 100)
        f.write(b"\x55")
    with pytest.raises(UserError, match="layer 1's expert 2"):
        verify(flash, progress=False)


def test_the_most_routed_experts_are_pinned_from_calibration_counts(flashdirs, tmp_path):
    """count-experts counts the router's choices on calibration text into the FLASHDIR; the expert cache then pins the
    most routed of each layer: read once, never a miss, and the bits stay those of every expert in DRAM."""
    import shutil
    from conftest import CORPUS
    from predictors.expert_freq import count_routes
    from flashinfer_lite.budget import kv_minimum_bytes
    from flashinfer_lite.predictor_set import load_expert_freq, save_expert_freq
    flash = shutil.copytree(flashdirs("qwen2moe", "f16"), tmp_path / "flash")
    counts = count_routes(flash, [CORPUS / "tinystories_cased_197KB.txt"], 96, ctx=32, progress=False)
    assert counts.shape == (2, 6) and (counts.sum(axis=1) == 96 * 2).all()    # 96 tokens, 2 experts each
    save_expert_freq(flash, counts)
    assert np.array_equal(load_expert_freq(flash), counts)
    want, _ = greedy(load_runtime(flash, "dense")[0], PROMPT, 6)
    whole, _, rt = load_runtime(flash, "auto", dram_budget=None, base_bytes=0)
    pages = rt.plan.kv_bytes - kv_minimum_bytes(whole.cfg, rt.plan.ctx)        # every KV page in DRAM (they come first)
    budget = rt.plan.minimum_bytes + pages + 2 * rt.plan.n_layers * rt.plan.chunk      # 4 slots a layer: 2 pinned
    model, _, rt = load_runtime(flash, "auto", dram_budget=budget, base_bytes=0)
    assert rt.plan.slots == 4 and rt.plan.pinned == 2
    for layer in range(2):
        top = set(np.argsort(-counts[layer], kind="stable")[:2].tolist())
        assert rt.cache.pinned[layer] == top
    got, _ = greedy(model, PROMPT, 6)
    assert np.array_equal(got, want)
    assert all(rt.cache.pinned[i] <= set(rt.cache.slot_of[i]) for i in range(2))   # never evicted
    m = tmp_path / "flash" / "predictors" / "expert_frequencies.json"
    doc = json.loads(m.read_text())
    doc["counts"][0][0] += 1                                                   # an edited count
    m.write_text(json.dumps(doc))
    with pytest.raises(UserError, match="checksum mismatch"):
        load_expert_freq(flash)


GGUF_ARCH = {"mixtral": "llama", "qwen2moe": "qwen2moe", "qwen3moe": "qwen3moe"}


@pytest.mark.parametrize("kind", sorted(GGUF_ARCH))
def test_gguf_mixtures_of_experts_match_transformers(tiny_model, kind, tmp_path):
    """GGUF `llama` with llama.expert_count (Mixtral), `qwen2moe` and `qwen3moe`, their experts in 3-D
    ffn_{gate,up,down}_exps tensors: float32, the logits of transformers on the HF model they were written from."""
    import torch
    from flashinfer_lite.model import load_reference
    from moe_gguf import write_moe_gguf
    src = tiny_model(kind)
    path = write_moe_gguf(src, tmp_path / "m.gguf", GGUF_ARCH[kind])
    model, _ = load_reference(path)
    got = model.forward(PROMPT, model.new_cache(32), all_logits=True)
    with torch.no_grad():
        want = transformers_model(src)(torch.tensor([PROMPT])).logits[0].numpy()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)


def test_a_quantized_gguf_keeps_its_expert_blocks_on_flash(tiny_model, tmp_path):
    """Q8_0 experts are copied into the chunks as they are (no second rounding); from flash at the minimum budget the
    bits are those of the FLASHDIR with every weight in DRAM, and its prompt's logits near the GGUF's own (the FLASHDIR
    keeps the GGUF's float32 attention matrices in q8_0 blocks: convert --dtype auto's rule for resident matrices)."""
    import gguf
    from moe_gguf import write_moe_gguf
    path = write_moe_gguf(tiny_model("qwen3moe"), tmp_path / "m.gguf", "qwen3moe", expert_type="Q8_0")
    flash = convert(path, tmp_path / "flash", progress=False)
    L = read_layout(flash)
    assert L.experts.dtypes == ("q8_0",) * 3
    t = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == "blk.1.ffn_down_exps.weight")
    with open(L.ffn_path, "rb") as f:
        f.seek(L.experts.chunk_offset(1, 3))
        chunk = np.frombuffer(f.read(L.experts.chunk), np.uint8)
    assert np.array_equal(chunk[L.experts.span("down")], np.asarray(t.data[3]).reshape(-1))
    want, _ = greedy(load_runtime(flash, "dense")[0], PROMPT, 5)
    gguf_model = load_runtime(path, "dense")[0]
    gguf_run = gguf_model.forward(PROMPT, gguf_model.new_cache(32), all_logits=True)
    assert np.abs(gguf_run - want[:len(PROMPT)]).max() < 0.05
    _, _, rt = load_runtime(flash, "auto", base_bytes=0, dram_budget=None)
    model, _, rt = load_runtime(flash, "auto", base_bytes=0, dram_budget=rt.plan.minimum_bytes)
    got, _ = greedy(model, PROMPT, 5)
    assert np.array_equal(got, want) and rt.stats.misses > 0


def test_the_expert_reads_are_counted_with_the_time_they_were_in_flight(flashdirs):
    """At the minimum budget every miss is one whole-chunk read (no lookahead): the bytes the busy time covers are the
    misses times the chunk, the busy time is positive and at most the reads' times summed, and
    flash_bench.expert_reads reports them (bytes over busy time, the mean in flight: at least one)."""
    from storage.flash_bench import expert_reads, reads_mark
    flash = flashdirs("qwen3moe", "q8_0")
    _, _, rt = load_runtime(flash, "auto", dram_budget=None, base_bytes=0)
    model, _, rt = load_runtime(flash, "auto", dram_budget=rt.plan.minimum_bytes, base_bytes=0)
    mark, misses = reads_mark(rt.stats, flash), rt.stats.misses
    greedy(model, PROMPT, 4)
    st = rt.stats
    assert st.misses > misses and st.read_busy_bytes == (st.misses - misses) * rt.plan.chunk
    assert 0 < st.read_busy_s <= st.read_op_s * (1 + 1e-9)
    r = expert_reads(st, mark)
    assert r["expert_read_MBps"] == round(st.read_busy_bytes / st.read_busy_s / 1e6, 1)
    assert r["expert_reads_in_flight"] >= 1


def test_slots_used_for_the_first_time_are_faulted_in_before_their_reads(flashdirs, monkeypatch):
    """A miss that takes a free slot (never used) faults its pages in first, so the read's time is the read's: one
    populate per slot taken from the free lists, of that slot's row, and its time in first_touch_s."""
    import flashinfer_lite.ffn.experts as experts
    from storage.flash_bench import expert_reads, reads_mark
    flash = flashdirs("qwen3moe", "q8_0")
    _, _, rt = load_runtime(flash, "auto", dram_budget=None, base_bytes=0)
    minimum = rt.plan.minimum_bytes
    touched = []
    real = experts.populate
    monkeypatch.setattr(experts, "populate", lambda a: touched.append(a) or real(a))
    model, _, rt = load_runtime(flash, "auto", dram_budget=minimum, base_bytes=0)
    free = [len(f) for f in rt.cache.free]
    mark = reads_mark(rt.stats, flash)
    greedy(model, PROMPT, 3)
    taken = sum(a - len(f) for a, f in zip(free, rt.cache.free))
    assert taken > 0 and len(touched) == taken
    assert all(a.shape == (rt.plan.chunk,) and np.shares_memory(a, rt.cache.buf) for a in touched)
    assert rt.stats.first_touch_s > 0 and expert_reads(rt.stats, mark)["first_touch_ms_per_token"] > 0
