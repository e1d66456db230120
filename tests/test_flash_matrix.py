"""Issue 43 (items 1, 2, 6): the token embeddings stay on flash, a step reads its tokens' rows; the head is computed on
its stored blocks, resident when the budget holds it, else streamed from flash chunk by chunk. Fixtures shaped like
the real Q4_K_M GGUFs: a vocabulary much larger than the model's width, K-quant embeddings and head (Qwen2.5-1.5B's
Q4_K and Q6_K), untied and tied.

Oracles: the same model with its embeddings and head in DRAM (model.load_tensor's, what every run used before),
bit for bit; the planner's arithmetic on the fixture's own file sizes; the kernel's and a memory cgroup's accounting
of a real `generate` process under a budget the old plan refused.
"""
import json
import math

import numpy as np
import pytest

from conftest import write_llama_gguf
from flashinfer_lite.budget import BelowMinimum, head_sizes, place_head, plan_budget
from flashinfer_lite.flash_matrix import FlashMatrix, widened_rows
from flashinfer_lite.model import load_weights
from flashinfer_lite.model import Transformer
from flashinfer_lite.modes import convert_of, head_sizes_of, resident_bytes_of
from storage.config import ModelConfig
from storage.convert import convert
from storage.format import FlashCheckpoint

VOCAB = 9000          # 9 chunks of 1024 rows (gemv.matmul_widened's block at dim 256), the last one short


def random_source(vocab: int, dim: int, tied: bool, layers: int = 2, ffn: int = 512, seed: int = 0,
                  live_rows: int | None = None):
    """A SwiGLU llama checkpoint's config and tensors (an object write_llama_gguf takes). live_rows: the head's rows
    past it are zero (a 512-token tokenizer then only ever samples its own ids)."""
    cfg = ModelConfig(arch="llama", vocab_size=vocab, dim=dim, n_layers=layers, n_heads=4, n_kv_heads=2,
                      head_dim=dim // 4, ffn_dim=ffn, max_pos=4096, tie_embeddings=tied, bos_id=1, eos_ids=[2])
    rng = np.random.default_rng(seed)
    t = {"embed.weight": rng.standard_normal((vocab, dim), np.float32), "norm.weight": np.ones(dim, np.float32)}
    if not tied:
        t["lm_head.weight"] = rng.standard_normal((vocab, dim), np.float32) / np.float32(math.sqrt(dim))
    if live_rows is not None:
        t["lm_head.weight" if not tied else "embed.weight"][live_rows:] = 0
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    for i in range(layers):
        shapes = {"attn.q": (q, dim), "attn.k": (kv, dim), "attn.v": (kv, dim), "attn.o": (dim, q),
                  "ffn.gate": (ffn, dim), "ffn.up": (ffn, dim), "ffn.down": (dim, ffn)}
        for n, s in shapes.items():
            t[f"layers.{i}.{n}.weight"] = rng.standard_normal(s, np.float32) / np.float32(math.sqrt(s[1]))
        t[f"layers.{i}.attn_norm.weight"] = t[f"layers.{i}.ffn_norm.weight"] = np.ones(dim, np.float32)

    class Source:
        config = cfg

        def tensor(self, name):
            return t[name]
    return Source()


def gguf_of(path, source, types: dict, layers: str | None = "Q8_0"):
    """source as a GGUF: the embeddings and head in `types`, every layer's matrix in `layers` (None: float32), so
    that convert keeps the blocks as it does a real Q4_K_M's (its resident matrices stay in blocks only when its
    bundles are)."""
    c = source.config
    mats = [f"layers.{i}.{n}.weight" for i in range(c.n_layers) for n in ("attn.q", "attn.k", "attn.v", "attn.o",
                                                                           "ffn.gate", "ffn.up", "ffn.down")]
    types = {**({n: layers for n in mats} if layers else {}), **types}
    return write_llama_gguf(source, path, types, edit=lambda w: w.add_vocab_size(c.vocab_size))


# (tied, the GGUF's block types of the embeddings and head, convert's dtype): Qwen2.5-1.5B's pair, a tied K-quant
# (SmolLM2, Qwen2.5-0.5B: one matrix, both uses), and the float resident matrices of f16 and f32 FLASHDIRs
CASES = {"untied q4_k + q6_k": (False, {"embed.weight": "Q4_K", "lm_head.weight": "Q6_K"}, "auto"),
         "tied q6_k": (True, {"embed.weight": "Q6_K"}, "auto"),
         "tied q8_0": (True, {"embed.weight": "Q8_0"}, "auto"),
         "untied f16": (False, {}, "f16"),
         "tied f32": (True, {}, "f32")}


@pytest.fixture(scope="module", params=list(CASES))
def flashdir(request, tmp_path_factory):
    """A FLASHDIR of the case, checked to hold its embeddings and head as the case says (blocks copied from the GGUF,
    or floats)."""
    tied, types, dtype = CASES[request.param]
    root = tmp_path_factory.mktemp("flash-matrix")
    gguf = gguf_of(root / "model.gguf", random_source(VOCAB, 256, tied), types, "Q8_0" if dtype == "auto" else None)
    flash = convert(gguf, root / "flash", dtype=dtype, progress=False)
    ckpt = FlashCheckpoint(flash)
    for name in ("embed.weight",) + (() if tied else ("lm_head.weight",)):
        assert ckpt.rows_layout(name)[1] == types.get(name, dtype).lower(), name
    return flash


def models(flashdir):
    """(the model with every weight in DRAM as load_weights keeps it, the same model with its embeddings and head
    FlashMatrix streamed in chunks of 1024 rows, the FlashMatrix objects)."""
    ckpt = FlashCheckpoint(flashdir)
    cfg = ckpt.config
    weights = load_weights(ckpt, convert=convert_of(ckpt.layout))
    on_flash = dict(weights)
    names = ["embed.weight"] + ([] if cfg.tie_embeddings else ["lm_head.weight"])
    for n in names:
        on_flash[n] = FlashMatrix(*ckpt.rows_layout(n), chunk_bytes=1, depth=2)    # chunks of one widened block
    return Transformer(cfg, weights), Transformer(cfg, on_flash), [on_flash[n] for n in names]


def test_embeddings_and_head_from_flash_give_the_resident_logits_bit_for_bit(flashdir):
    resident, flash, matrices = models(flashdir)
    cfg = resident.cfg
    assert isinstance(flash.embed, FlashMatrix) and (flash.lm_head is flash.embed) == cfg.tie_embeddings
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, VOCAB, 40)
    prompt[5:9] = prompt[20]                        # a token repeated: one row read, looked up four times
    kv_a, kv_b = resident.new_cache(64), flash.new_cache(64)
    # a prompt's logits at every position (T = 40: the widened blocks' BLAS path), then decode steps (T = 1)
    a, b = resident.forward(prompt, kv_a, all_logits=True), flash.forward(prompt, kv_b, all_logits=True)
    assert a.shape == (40, VOCAB) and np.isfinite(a).all()
    assert np.array_equal(a, b)
    for tok in (VOCAB - 1, 0, int(prompt[3])):      # the last row sits in the short last chunk
        a, b = resident.forward([tok], kv_a), flash.forward([tok], kv_b)
        assert np.array_equal(a, b)
    head = flash.lm_head
    assert head.stats.tokens == 4 and head.stats.read_bytes >= head.layout.stride * VOCAB * 4
    embed = flash.embed
    assert embed.lookups.requested_bytes == embed.layout.stride * (len(set(prompt.tolist())) + 3)
    for m in matrices:
        m.close()


def test_a_damaged_row_on_flash_is_refused_in_one_line(flashdir, tmp_path):
    """A block scale that is not finite (a damaged file) is refused naming the file, as load_tensor refuses it in a
    resident matrix; the other rows read as ever."""
    import dataclasses
    from storage.errors import UserError
    layout, kind = FlashCheckpoint(flashdir).rows_layout("embed.weight")
    if kind not in ("q4_k", "q6_k", "q8_0"):
        pytest.skip("float rows: check_finite, as for every float tensor")
    data = bytearray(layout.ffn_path.read_bytes())
    at = layout.offset[0] + 7 * layout.stride + {"q4_k": 0, "q6_k": 208, "q8_0": 0}[kind]    # row 7's first d
    data[at:at + 2] = np.array([np.nan], np.float16).tobytes()
    (tmp_path / layout.files["ffn"]).write_bytes(bytes(data))
    m = FlashMatrix(dataclasses.replace(layout, flashdir=tmp_path), kind, chunk_bytes=1, depth=1)
    with pytest.raises(UserError, match=r"resident.safetensors: rows of the .* holds nan"):
        m[[3, 7]]
    assert np.isfinite(m[[3, 8]]).all()
    m.close()


# ----------------------------------------------------------------------------------------------------------------------
# The plan


def test_the_head_is_resident_when_the_budget_holds_it_else_streamed():
    """place_head on a predicted plan of Qwen2.5-1.5B's shape: at the minimum the head streams (its stream's buffers
    counted, not its matrix); from the minimum plus what holding it costs more, it is resident and the FFN's rows
    got nothing more; a byte less, it streams and the FFN's rows take the budget."""
    from storage.format import FlashLayout
    cfg = ModelConfig(arch="llama", vocab_size=151936, dim=1536, n_layers=28, n_heads=12, n_kv_heads=2, head_dim=128,
                      ffn_dim=8960)
    layout = FlashLayout.create(cfg.dim, [cfg.ffn_dim] * cfg.n_layers, "q4_k", True, config=cfg.to_dict())
    sizes = head_sizes(cfg, True, {"embed.weight": "q4_k", "lm_head.weight": "q6_k"}, 2048, 8 << 20, 2,
                       widened_rows(cfg.dim))
    assert sizes.stored_bytes == 151936 * 1260                  # Q6_K rows of 1536 as stored: 182.6 MiB
    assert sizes.stream_bytes <= 17 << 20 and sizes.embed_bytes < 1 << 20

    def plan(budget: int, held: int):
        return plan_budget(cfg, layout, budget, 2048, max_active=1000, resident_bytes=held, base_bytes=100 << 20)
    low = place_head(plan, sizes, 1 << 60).floor_bytes
    assert low == plan(1 << 60, sizes.minimum_bytes).minimum_bytes
    p = place_head(plan, sizes, low)
    assert (p.head_bytes, p.head_read_bytes, p.embed_bytes) == (sizes.stream_bytes, sizes.stored_bytes,
                                                                sizes.embed_bytes)
    assert p.used_bytes <= low and "streamed from flash, 182.6 MiB read per token" in p.table()
    with pytest.raises(BelowMinimum):
        place_head(plan, sizes, low - 1)
    held = low + sizes.stored_bytes - sizes.stream_bytes
    p = place_head(plan, sizes, held)
    assert (p.head_bytes, p.head_read_bytes, p.hot_bytes) == (sizes.stored_bytes, 0, 0)
    assert "resident, as stored" in p.table() and f"minimum {low / 2**20:.1f} MiB" in p.table()
    p = place_head(plan, sizes, held - 1)
    assert p.head_read_bytes == sizes.stored_bytes and p.hot_bytes + p.window_bytes > 100 << 20


def test_the_minimum_counts_neither_the_embeddings_nor_a_streamed_head(flashdir):
    """modes' minimum of the predicted plan, against the same plan with both matrices resident (the plan before this
    change): less by their stored bytes, plus a stream's buffers (or the head, when it is no larger: this fixture's
    fits one chunk) and a prompt chunk's rows."""
    from flashinfer_lite.budget import HEAP_SLACK_BYTES, stream_args
    from flashinfer_lite.modes import MODES, Facts
    ckpt = FlashCheckpoint(flashdir)
    cfg, layout, kinds = ckpt.config, ckpt.layout, ckpt.resident_kinds
    sizes = head_sizes_of(cfg, layout, kinds, 512)
    stored = {n: FlashCheckpoint(flashdir).rows_layout(n)[0] for n in ("embed.weight", "lm_head.weight")
              if n in ckpt.names()}
    matrices = sum(L.stride * L.n_neurons[0] for L in stored.values())
    assert resident_bytes_of(cfg, layout, kinds) - resident_bytes_of(cfg, layout, kinds, on_flash=True) == matrices
    predicted = next(m for m in MODES if m.name == "predicted")
    facts = Facts(cfg, layout, kinds)
    new = predicted.minimum(facts, "predicted", 512, 5, 100 << 20, HEAP_SLACK_BYTES)
    old = plan_budget(cfg, layout, 1 << 60, 512, 5, resident_bytes=resident_bytes_of(cfg, layout, kinds),
                      base_bytes=100 << 20, **stream_args(layout), heap_slack_bytes=HEAP_SLACK_BYTES).minimum_bytes
    assert old - new == matrices - sizes.minimum_bytes      # a head of one chunk stays resident: no stream


# ----------------------------------------------------------------------------------------------------------------------
# A real run under a budget the plan with both matrices resident refused


@pytest.fixture(scope="module")
def big_vocab_flashdir(tmp_path_factory):
    """A gated model with 65536 tokens of width 512 (Q4_K embeddings 18 MiB, Q8_0 head 34 MiB: more than a head
    stream's 16 MiB of buffers), its head zero past the 512 ids its tokenizer has; converted with the split layout
    and calibrated, so --ffn auto runs the exact gate as it does a real GGUF."""
    from predictors.calibrate_gate import calibrate
    root = tmp_path_factory.mktemp("big-vocab")
    gguf = gguf_of(root / "model.gguf", random_source(65536, 512, tied=False, ffn=1024, live_rows=512),
                   {"embed.weight": "Q4_K", "lm_head.weight": "Q8_0"})
    flash = convert(gguf, root / "flash", progress=False)
    calibrate(str(flash), n_tokens=128, progress=False)
    return flash


def test_a_budget_below_the_old_minimum_runs_and_keeps_its_peak(big_vocab_flashdir, tmp_path):
    from memcap import available
    from test_budget_promise import generate, minimum_mib
    flashdir = big_vocab_flashdir
    ckpt = FlashCheckpoint(flashdir)
    args = ("-c", "512", "--ffn", "auto")
    # first with no budget: the greedy tokens to compare with; then under a budget it does not constrain: until a
    # budgeted run has measured this model's process base, the early refusal estimates it high (warmup.py)
    rc, out, err, _, _ = generate(flashdir, tmp_path, "-p", "Once upon a time", *args, "-n", "8")
    assert rc == 0, err[-3000:]
    want = json.loads(out.strip().splitlines()[-1])
    assert generate(flashdir, tmp_path, "-p", "x", *args, "-n", "1", "--dram-budget", "2G")[0] == 0
    new = minimum_mib(flashdir, tmp_path, *args)
    sizes = head_sizes_of(ckpt.config, ckpt.layout, ckpt.resident_kinds, 512)
    matrices = sum(L.stride * L.n_neurons[0] for L in (ckpt.rows_layout(n)[0] for n in ("embed.weight",
                                                                                          "lm_head.weight")))
    old = new + (matrices - sizes.stream_bytes - sizes.embed_bytes) / 2**20
    assert old - new > 30, (old, new)
    # just above the new minimum: far below the old one, and short of what the head needs to go resident
    assert (sizes.stored_bytes - sizes.stream_bytes) / 2**20 > 5, sizes
    budget_mib = math.ceil(new) + 2
    assert budget_mib < old
    why_not = available()
    rc, out, err, peak, capped = generate(flashdir, tmp_path, "-p", "Once upon a time", *args, "-n", "8", "-v",
                                          "--dram-budget", f"{budget_mib}M",
                                          cap=None if why_not else budget_mib << 20)
    assert rc == 0, f"exit {rc}, memcap {capped}\n{err[-3000:]}"
    assert "streamed from flash" in err, err          # -v: the plan's table names the head's place
    if capped is not None:
        assert not capped.get("oom_kills"), capped
    assert peak <= budget_mib << 20, f"peak {peak / 2**20:.1f} MiB > {budget_mib} MiB\n{err}"
    got = json.loads(out.strip().splitlines()[-1])
    assert got["tokens"] == want["tokens"] and len(got["tokens"]) == 8
    assert got["head"]["mb_read_per_token"] >= ckpt.rows_layout("lm_head.weight")[0].stride * 65536 / 2**20
    if why_not:
        pytest.skip(f"ran without a cgroup cap: {why_not}")


def test_the_timing_lines_say_what_a_streamed_head_read():
    import io
    from types import SimpleNamespace
    from flashinfer_lite.generate import Timings
    from storage.reader import FlashStats
    head = SimpleNamespace(stats=FlashStats(read_bytes=3 << 20, read_s=0.5, compute_s=0.25, tokens=2))
    out = io.StringIO()
    Timings().report(out, head=head)
    assert ("head reads =       1.50 MB per token, 250.00 ms per token waiting for them, 125.00 ms computing"
            in out.getvalue()), out.getvalue()
    out = io.StringIO()
    Timings().report(out)
    assert "head reads" not in out.getvalue()
