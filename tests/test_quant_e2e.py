"""Quantized FLASHDIRs end to end (issue 12): convert keeps a GGUF's blocks, the runtime computes on them.

Oracles: the gguf package's dequantization of the source tensors (blocks copied verbatim must give the same bits),
float64 numpy math on the dequantized weights (what every mode must compute), transformers on the float32 source
(within the quantization error), and the file itself (what the budget must count).
"""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGUFReader
from gguf import quants as gguf_quants

from conftest import assert_same_bits_at_every_budget, transformers_model, write_llama_gguf
from flashinfer_lite.budget import down_scale_bytes, resident_bytes_for
from storage.errors import UserError
from flashinfer_lite.model import Transformer
from flashinfer_lite.flash_matrix import FlashMatrix
from flashinfer_lite.kernels.blocks import COLUMN_SCALES_F16, QuantMatrix, dequantize
from flashinfer_lite.model import open_any
from flashinfer_lite.ffn.resident import ResidentFFN
from flashinfer_lite.modes import plan_in_ram
from flashinfer_lite.runtime import load_runtime
from storage.checkpoint import open_checkpoint, unpermute_qk
from storage.convert import convert
from storage.files import disk_bytes
from storage.format import FlashCheckpoint, read_layout, verify

pytestmark = pytest.mark.usefixtures("float32_activations")   # oracle: float64 on the dequantized weights

ATTN = ("attn.q", "attn.k", "attn.v", "attn.o")


def gguf_types(kind: str, n_layers: int) -> dict[str, str]:
    """Attention and FFN in `kind`, embeddings and lm_head in Q8_0 (as llama.cpp's Q4 files keep them wider)."""
    t = {"embed.weight": "Q8_0", "lm_head.weight": "Q8_0"}
    for i in range(n_layers):
        t.update({f"layers.{i}.{m}.weight": kind for m in (*ATTN, "ffn.gate", "ffn.up", "ffn.down")})
    return t


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model, tmp_path_factory):
    """tiny_gguf(kind) -> a GGUF of the tiny GQA Llama with attention and FFN in `kind` (Q4_0, Q4_1, Q8_0)."""
    made = {}

    def make(kind: str):
        if kind not in made:
            src = open_checkpoint(tiny_model("llama-silu-gqa"))
            made[kind] = write_llama_gguf(src, tmp_path_factory.mktemp("gguf") / f"tiny-{kind}.gguf",
                                          gguf_types(kind, src.config.n_layers))
        return made[kind]
    return make


def bundles_of(flashdir, layer: int) -> np.ndarray:
    """The layer's bundles as stored, uint8 [n, stride], in original neuron order."""
    L = read_layout(flashdir)
    if L.bundled:
        raw = np.fromfile(L.ffn_path, np.uint8, count=L.region_bytes(layer), offset=L.offset[layer])
        B = raw.reshape(L.n_neurons[layer], L.stride)
    else:       # the split parts alone (a SiLU model's default): each part's rows, put back where a bundle has them
        B = np.zeros((L.n_neurons[layer], L.stride), np.uint8)
        L.geometry_of(layer).assemble([(P.geometry_of(layer), np.fromfile(
            P.ffn_path, np.uint8, count=P.region_bytes(layer), offset=P.offset[layer]).reshape(-1, P.stride))
            for P in L.parts.values()], B)
    inv = np.empty_like(L.order[layer])
    inv[L.order[layer]] = np.arange(len(inv))
    return B[inv]


def resident_data_bytes(flashdir) -> int:
    with open(flashdir / "resident.safetensors", "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        f.seek(0, 2)
        return f.tell() - 8 - n


def scale_table_bytes(layout) -> int:
    """Bytes of the down columns' raw scale tables in resident.safetensors (storage.columns)."""
    from storage.columns import table_bytes
    return sum(table_bytes(layout.down_column(i), layout.d, n) for i, n in enumerate(layout.n_neurons)
               if layout.down_column(i))


def assert_gguf_blocks_verbatim(gguf_path, flashdir, layers) -> None:
    """Gate/up bundle vectors and resident matrices hold the GGUF's blocks byte for byte (q/k rows un-permuted), and
    dequantize, with the runtime's kernel, to the bits gguf gives for the source tensor."""
    by_name = {t.name: t for t in GGUFReader(str(gguf_path)).tensors}
    src, flash = open_checkpoint(gguf_path), FlashCheckpoint(flashdir)
    L, cfg = flash.layout, flash.config
    at = L.vector_offsets
    for i in layers:
        B = bundles_of(flashdir, i)
        for k, v in enumerate(("gate", "up")):
            t = by_name[f"blk.{i}.ffn_{v}.weight"]
            assert t.tensor_type.name.lower() == L.dtype
            stored = np.ascontiguousarray(B[:, at[k]:at[k + 1]])
            assert np.array_equal(stored, t.data), (i, v)
            want = gguf_quants.dequantize(t.data, t.tensor_type)
            assert np.array_equal(dequantize(stored, L.dtype, cfg.dim), want), (i, v)
        for m, gg in zip(ATTN, ("attn_q", "attn_k", "attn_v", "attn_output")):
            t, name = by_name[f"blk.{i}.{gg}.weight"], f"layers.{i}.{m}.weight"
            heads = {"attn.q": cfg.n_heads, "attn.k": cfg.n_kv_heads}.get(m)
            rows = unpermute_qk(np.asarray(t.data), heads) if heads else t.data
            kind, q = flash.quantized(name)
            assert kind == t.tensor_type.name.lower() and np.array_equal(q, rows), name
            # un-permuting rows of blocks = un-permuting the dequantized rows
            assert np.array_equal(QuantMatrix.of((kind, q))[np.arange(q.shape[0])], src.tensor(name)), name
    kind, q = flash.quantized("embed.weight")
    assert kind == "q8_0" and np.array_equal(q, by_name["token_embd.weight"].data)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_are_copied_verbatim(tiny_gguf, tmp_path, kind):
    path = tiny_gguf(kind)
    out = convert(path, tmp_path / "flash", progress=False)              # --dtype auto
    L = verify(out, progress=False)
    assert L.dtype == kind.lower()
    # the down matrix is kept exactly, as columns (storage.columns): the GGUF's values to the bit
    assert all(L.down_column(i) == kind.lower() for i in range(L.n_layers))
    assert_gguf_blocks_verbatim(path, out, range(L.n_layers))
    src, flash = open_checkpoint(path), FlashCheckpoint(out)
    for i in range(L.n_layers):
        want = src.tensor(f"layers.{i}.ffn.down.weight")
        got = flash.tensor(f"layers.{i}.ffn.down.weight")
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert resident_bytes_for(flash.config, half=True, kinds=flash.resident_kinds) + scale_table_bytes(L) == \
        resident_data_bytes(out)


def test_default_model_keeps_its_blocks_and_size(smollm2_gguf, tmp_path):
    """SmolLM2's Q4_1 GGUF converted with the defaults: its gate/up blocks verbatim, its down kept exactly as
    columns, and the FLASHDIR (the split parts, packed) at most 1.05x the GGUF."""
    out = convert(smollm2_gguf, tmp_path / "flash", progress=False)
    L = read_layout(out)
    assert (L.dtype, L.down_column(0)) == ("q4_1", "q4_1")
    assert_gguf_blocks_verbatim(smollm2_gguf, out, [0, L.n_layers - 1])
    # the FFN once: the split parts alone (no ffn.bin), and the resident file, keep the GGUF's size
    assert not L.bundled and not (out / "ffn.bin").exists()
    size = disk_bytes(out)
    assert size <= 1.05 * smollm2_gguf.stat().st_size, size / smollm2_gguf.stat().st_size
    flash = FlashCheckpoint(out)
    assert resident_bytes_for(flash.config, half=True, kinds=flash.resident_kinds) + scale_table_bytes(L) == \
        resident_data_bytes(out)


# ---------------------------------------------------------------------------------------------------------------
# Every mode computes the float64 math on the dequantized weights; the source is within the quantization error


def float64_model(path) -> Transformer:
    ck = open_any(path)
    return Transformer(ck.config, {n: ck.tensor(n).astype(np.float64) for n in ck.names()})


def greedy(model: Transformer, ids: list[int], n: int) -> tuple[list[int], np.ndarray]:
    """n greedy tokens after a batched prompt, and the logits of every step ([len(ids) + n - 1, V])."""
    kv = model.new_cache(64)
    rows = [model.forward(ids, kv, all_logits=True)]
    out = []
    for _ in range(n):
        out.append(int(np.argmax(rows[-1][-1])))
        rows.append(model.forward([out[-1]], kv)[None, :])
    return out, np.concatenate(rows)[:-1]


def rel_rms(a, b) -> float:
    return float(np.sqrt(((a - b) ** 2).sum() / (b ** 2).sum()))


@pytest.mark.parametrize("kind", ["llama-relu", "opt"])
@pytest.mark.parametrize("dtype", ["q8_0", "q4_0"])
def test_quantized_flashdir_computes_the_dequantized_math(tiny_model, tmp_path, kind, dtype):
    import torch
    path = tiny_model(kind)
    out = convert(path, tmp_path / "flash", dtype=dtype, progress=False)
    flash = FlashCheckpoint(out)
    assert set(flash.resident_kinds.values()) == {dtype} and "embed.weight" in flash.resident_kinds
    ids = np.random.default_rng(7).integers(3, 512, size=10).tolist()
    want_tokens, want = greedy(float64_model(out), ids, 12)
    c = flash.config
    for mode in ("dense", "oracle"):
        model, _, rt = load_runtime(out, mode)
        # from flash (oracle) the embeddings' rows are read in their blocks (tied, no budget: the resident head's)
        assert isinstance(model.embed, FlashMatrix if mode == "oracle" and not c.tie_embeddings else QuantMatrix)
        assert model.embed.kind == dtype and isinstance(model.blocks[0].attn.wq, QuantMatrix)
        tokens, got = greedy(model, ids, 12)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
        assert tokens == want_tokens, mode
        if rt is not None:   # the budget counts the blocks (oracle adds its float32 gate/up, kept for the run), the
            # head resident as stored (no budget), the embeddings' table not at all
            oracle_extra = c.n_layers * c.ffn_dim * c.dim * 4 * (2 if c.glu else 1)
            layout = flash.rows_layout("embed.weight")[0]
            table = 0 if c.tie_embeddings else layout.stride * layout.n_neurons[0]
            assert rt.plan.head_read_bytes == 0 and isinstance(model.lm_head, QuantMatrix)
            assert rt.plan.resident_bytes + rt.plan.head_bytes + table - oracle_extra == resident_data_bytes(out)
    # the float32 source through transformers: logits within a few times the weights' quantization error (measured
    # 3.2-3.8x on these models; q4 errs ~15x more than q8, so the bound tells them apart)
    src = open_checkpoint(path)
    mats = [n for n in src.names() if src.tensor(n).ndim == 2 and n != "pos_embed.weight"]
    weight_err = np.sqrt(sum(((flash.tensor(n) - src.tensor(n)) ** 2).sum() for n in mats) /
                         sum((src.tensor(n) ** 2).sum() for n in mats))
    with torch.no_grad():
        hf = transformers_model(path)(torch.tensor([ids])).logits[0].numpy()
    assert weight_err < (0.01 if dtype == "q8_0" else 0.1)
    assert rel_rms(want[:len(ids)], hf) < 5 * weight_err


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_in_ram_modes_compute_on_the_blocks(tiny_gguf, tmp_path, kind):
    """--ffn dense on a GGUF keeps its blocks (QuantMatrix FFN); on its FLASHDIR it runs ResidentFFN over the GGUF's
    blocks put back together (the down columns joined into the GGUF's rows): each the float64 math on its own
    dequantized weights. (--ffn auto on this SiLU model is the exact gate at every budget: tests/test_exact_gate.py;
    auto in RAM for a ReLU-family model: tests/test_auto_budget.py; the two dense paths' bits:
    tests/test_gguf_fixtures.py.)"""
    gguf = tiny_gguf(kind)
    flash = convert(gguf, tmp_path / "flash", progress=False)
    ids = np.random.default_rng(3).integers(3, 512, size=9).tolist()
    for path in (gguf, flash):
        want_tokens, want = greedy(float64_model(path), ids, 6)
        model, _, rt = load_runtime(path, "dense")
        assert rt is None and isinstance(model.embed, QuantMatrix)
        if path == gguf:
            assert isinstance(model.dense_ffn[0].w_down, QuantMatrix)
        else:
            assert isinstance(model.ffn, ResidentFFN) and isinstance(model.ffn.layers[0].w_down, QuantMatrix)
            assert model.ffn.layers[0].w_down.q.tobytes() == open_checkpoint(gguf).quantized(
                "layers.0.ffn.down.weight")[1].tobytes()
        tokens, got = greedy(model, ids, 6)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
        assert tokens == want_tokens, path
    # the in-RAM plan counts what ResidentFFN holds: the bundles' rows and the down scale tables (the resident line)
    # hold the GGUF's matrices and more (the bundles' scalars), so the plan is an upper bound
    ckpt = FlashCheckpoint(flash)
    plan = plan_in_ram(ckpt.config, ckpt.layout, ckpt.resident_kinds, 1 << 30, 64, 0)
    assert model.ffn.nbytes <= plan.ffn_bytes + down_scale_bytes(ckpt.layout, COLUMN_SCALES_F16) < 1.05 * model.ffn.nbytes


@pytest.mark.parametrize("source", ["hf q4_0", "gguf q4_1"])
def test_same_bits_at_every_budget(tiny_model, tiny_gguf, tmp_path, monkeypatch, source):
    """The budget, -t, overlap and prefill streaming move opaque bundle bytes: quantized bundles give the same bits
    everywhere (the GGUF's: gate/up in q4_1, down its q4_1 kept as columns)."""
    if source == "hf q4_0":
        out = convert(tiny_model("llama-relu"), tmp_path / "flash", dtype="q4_0", progress=False)
    else:
        out = convert(tiny_gguf("Q4_1"), tmp_path / "flash", progress=False)
        assert read_layout(out).down_column(0) == "q4_1"
    ids = np.random.default_rng(5).integers(3, 512, size=12).tolist()
    assert_same_bits_at_every_budget(out, "oracle", ids, 8, monkeypatch)


# ---------------------------------------------------------------------------------------------------------------
# Bad input


def test_unsupported_gguf_type_is_one_line(tiny_model, tmp_path):
    src = open_checkpoint(tiny_model("llama-silu-gqa"))
    bad = write_llama_gguf(src, tmp_path / "mxfp4.gguf", {"layers.1.ffn.down.weight": "MXFP4"})
    with pytest.raises(UserError) as e:
        convert(bad, tmp_path / "out", progress=False)
    msg = str(e.value)
    assert "\n" not in msg and "blk.1.ffn_down.weight" in msg and "MXFP4" in msg and "Q4_1" in msg, msg
    assert not (tmp_path / "out").exists()
    r = subprocess.run([sys.executable, "-m", "flashinfer_lite", "convert", str(bad), "-o", str(tmp_path / "o2")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1 and "MXFP4" in r.stderr, r.stderr


def test_damaged_resident_kinds_are_refused(tiny_model, tmp_path):
    out = convert(tiny_model("llama-relu"), tmp_path / "flash", dtype="q8_0", progress=False)
    res = out / "resident.safetensors"
    raw = bytearray(res.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    # a row of d = 64 in q8_0 is 68 bytes: not whole 18-byte q4_0 blocks, so refused rather than misread
    header["__metadata__"]["embed.weight"] = "q4_0"
    js = json.dumps(header).encode()
    res.write_bytes(len(js).to_bytes(8, "little") + js + bytes(raw[8 + n:]))
    with pytest.raises(UserError, match="is not a 'q4_0' matrix"):
        FlashCheckpoint(out)
