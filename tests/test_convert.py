"""convert: the flash directory, read back through FlashCheckpoint and BundleReader, equals the source checkpoint."""
from __future__ import annotations

import numpy as np
import pytest

from flash_fixtures import STORIES, RandomCheckpoint, bundle_vectors, int8_bound, write_random_flashdir
from storage.checkpoint import open_checkpoint
from storage.errors import UserError
from storage import convert as convert_mod
from storage.convert import convert
from storage.format import FlashCheckpoint, read_layout, unpack_bundles, verify
from storage.reader import aligned_empty
from storage.reader import BundleReader



def quantized(a: np.ndarray, kind: str) -> np.ndarray:
    """Rows of a in a GGUF block format and back, by the gguf package (llama.cpp's reference)."""
    from gguf import GGMLQuantizationType, quants
    t = GGMLQuantizationType[kind.upper()]
    return quants.dequantize(quants.quantize(np.ascontiguousarray(a, np.float32), t), t)


def assert_same_tensors(src, flash, dtype):
    assert sorted(flash.names()) == sorted(src.names())
    L = flash.layout
    for name in src.names():
        a, b = src.tensor(name), flash.tensor(name)
        assert b.dtype == np.float32 and b.shape == a.shape, name
        in_bundles = ".ffn." in name and not name.endswith("down.bias")
        if L.quantized and a.ndim == 2 and (in_bundles or name in flash.resident_kinds):
            # blocks along d: a bundle vector is a row, or a column of down (in its own kind, if the layout has one)
            down = name.endswith("down.weight")
            kind = (L.down_dtype or L.dtype) if down else flash.resident_kinds.get(name, L.dtype)
            assert np.array_equal(b, quantized(a.T, kind).T if down else quantized(a, kind)), name
        elif dtype == "f32" or a.ndim == 1:
            assert np.array_equal(a, b), name                      # f32 FLASHDIRs, norms and biases: float32
        elif dtype == "f16" or not in_bundles:                     # f16 bundles; resident matrices of f16/int8
            assert np.array_equal(b, a.astype(np.float16).astype(np.float32)), name
        else:
            vec_axis = 0 if name.endswith("down.weight") else 1    # a bundle vector is a row, or a column of down
            assert (np.abs(a - b) <= int8_bound(np.moveaxis(a, vec_axis, -1)).swapaxes(-1, vec_axis)).all(), name


@pytest.mark.parametrize("dtype", ["f32", "f16", "int8", "q8_0", "auto"])
def test_stories260k_round_trip(tmp_path, dtype):
    out = convert(STORIES, tmp_path / "flash", dtype=dtype, progress=False)
    verify(out, progress=False)
    src, flash = open_checkpoint(STORIES), FlashCheckpoint(out)
    assert flash.config == src.config
    dtype = "f16" if dtype == "auto" else dtype          # an HF checkpoint's precision class
    assert flash.layout.dtype == dtype
    assert_same_tensors(src, flash, dtype)
    text = "Once upon a time, a little dog"
    assert flash.tokenizer().encode(text) == src.tokenizer().encode(text)


@pytest.mark.parametrize("kind, dtype, vectors, biases", [
    ("opt", "f32", ("up", "down"), ("bias.up",)),                  # [fc1_i, b1_i | fc2_i]
    ("opt-postnorm", "int8", ("up", "down"), ("bias.up",)),
    ("llama-bias-untied", "f16", ("gate", "up", "down"), ("bias.gate", "bias.up")),
    ("llama-bias-untied", "q4_1", ("gate", "up", "down"), ("bias.gate", "bias.up")),
    ("opt", "q4_0", ("up", "down"), ("bias.up",)),                 # its learned positions stay float16
])
def test_transformers_models_round_trip(tmp_path, tiny_model, kind, dtype, vectors, biases):
    pytest.importorskip("transformers")
    src_path = tiny_model(kind)
    out = convert(src_path, tmp_path / "flash", dtype=dtype, progress=False)
    L = read_layout(out)
    assert (L.vectors, L.biases) == (vectors, biases)
    flash = FlashCheckpoint(out)
    assert "layers.0.ffn.down.bias" in flash._resident_names         # per output, not per neuron: stays resident
    assert_same_tensors(open_checkpoint(src_path), flash, dtype)


def test_permuted_neuron_order(tmp_path):
    """Bundle b holds neuron order[b]: FlashCheckpoint undoes the permutation, BundleReader reads file positions."""
    rng = np.random.default_rng(3)
    orders = [rng.permutation(300), rng.permutation(300)]
    ckpt = write_random_flashdir(tmp_path / "f", "f32", orders=orders)
    flash = FlashCheckpoint(tmp_path / "f")
    assert [list(o) for o in flash.layout.order] == [list(o) for o in orders]
    for name in ckpt.names():
        assert np.array_equal(flash.tensor(name), ckpt.tensor(name)), name
    with BundleReader(tmp_path / "f", threads=2) as r:
        dest = aligned_empty((3, r.layout.stride), np.uint8)
        r.read(1, [0, 1, 299], dest, [0, 1, 2])
        vecs, _ = unpack_bundles(r.layout, dest)
    assert np.array_equal(vecs, np.stack([bundle_vectors(ckpt, 1, orders[1][b]) for b in (0, 1, 299)]))


def test_refuses_to_overwrite_without_force(tmp_path):
    out = tmp_path / "flash"
    convert("model", out, dtype="f16", progress=False)
    with pytest.raises(UserError, match="already exists .*--force"):
        convert("model", out, dtype="f16", progress=False)
    convert("model", out, dtype="int8", force=True, progress=False)
    assert read_layout(out).dtype == "int8"
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "thesis.tex").write_text("years of work")
    with pytest.raises(UserError, match="not a flash directory"):
        convert("model", tmp_path / "precious", force=True, progress=False)
    assert (tmp_path / "precious" / "thesis.tex").exists()


@pytest.fixture(autouse=True)
def _random_checkpoint(monkeypatch):
    """convert() on the path "model" opens a random in-memory checkpoint (keeps these tests off the loader)."""
    import storage.convert as conv
    real_open = conv.open_checkpoint
    monkeypatch.setattr(conv, "open_checkpoint", lambda p: RandomCheckpoint() if str(p) == "model" else real_open(p))


@pytest.mark.parametrize("existing", [False, True])
def test_interrupted_convert_leaves_no_accepted_directory(tmp_path, monkeypatch, existing):
    out = tmp_path / "flash"
    if existing:
        convert("model", out, dtype="f16", progress=False)
    real_pack, calls = convert_mod.pack_bundles, {"n": 0}

    def pack_then_interrupt(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:                                   # mid-way: layer 0 written, layer 1 not
            raise KeyboardInterrupt
        return real_pack(*a, **k)

    monkeypatch.setattr(convert_mod, "pack_bundles", pack_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        convert("model", out, dtype="int8", force=True, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == (["flash"] if existing else [])
    if existing:   # the previous directory is intact, not half-replaced
        assert verify(out, progress=False).dtype == "f16"
    else:
        with pytest.raises(UserError):
            FlashCheckpoint(out)


# ----------------------------------------------------------------------------------------------------------------------
# Free space: what a conversion will write, known before it writes

GGUFS = STORIES.parent / "gguf"


@pytest.mark.parametrize("model, dtype", [(STORIES, "f16"), (STORIES, "q8_0"), (STORIES, "f32"),
                                          (GGUFS / "qwen2-q4_k_m.gguf", "auto"), (GGUFS / "gemma3-q8_0.gguf", "auto"),
                                          ("model", "int8")])
def test_flashdir_bytes_bounds_what_convert_writes(tmp_path, model, dtype):
    """The estimate, from the header alone, against the bytes the written directory holds: never fewer, and over by at
    most the tokenizer's allowance and the headers'."""
    from storage.files import disk_bytes
    ckpt = open_checkpoint(model) if model != "model" else convert_mod.open_checkpoint(model)
    est = convert_mod.flashdir_bytes(ckpt, convert_mod.layout_for(ckpt, dtype))
    out = convert(model, tmp_path / "flash", dtype=dtype, progress=False)
    got = disk_bytes(out)
    slack = convert_mod.TOKENIZER_BYTES_PER_TOKEN * ckpt.config.vocab_size + (64 << 10)
    assert got <= est <= got + slack, (got, est)


def test_refused_before_writing_when_the_disk_has_no_room(tmp_path, monkeypatch):
    """disk_usage says one byte less than the estimate: one line naming both and the directory, nothing created; at
    the estimate exactly it converts."""
    import collections
    import shutil
    ckpt = open_checkpoint(STORIES)
    need = convert_mod.flashdir_bytes(ckpt, convert_mod.layout_for(ckpt, "f16"))
    usage = collections.namedtuple("usage", "total used free")
    seen = []

    def disk_usage(path, free):
        seen.append(path)
        return usage(1 << 40, 0, free)
    out = tmp_path / "cache" / "flash"                # its parent does not exist yet: its nearest one is asked
    monkeypatch.setattr(shutil, "disk_usage", lambda p: disk_usage(p, need - 1))
    with pytest.raises(UserError) as e:
        convert(STORIES, out, dtype="f16", progress=False)
    assert seen == [tmp_path]
    msg = str(e.value)
    assert msg.startswith("need ") and f"free in {tmp_path} " in msg and "have " in msg and "\n" not in msg, msg
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(shutil, "disk_usage", lambda p: disk_usage(p, need))
    verify(convert(STORIES, out, dtype="f16", progress=False), progress=False)


def test_gigabytes_reads_as_df_prints():
    assert convert_mod.gigabytes(1_100_000_000) == "1.1 GB"
    assert convert_mod.gigabytes(400_000_000) == "0.4 GB"
    assert convert_mod.gigabytes(1_500_000) == "1.5 MB"


@pytest.mark.parametrize("kind, dtype", [("mixtral", "auto"), ("qwen2moe", "q8_0")])
def test_flashdir_bytes_bounds_what_convert_writes_for_experts(tmp_path, tiny_model, kind, dtype):
    """The same bound for a mixture of experts' chunks (and a shared expert resident)."""
    from storage.files import disk_bytes
    src = tiny_model(kind)
    ckpt = open_checkpoint(src)
    est = convert_mod.flashdir_bytes(ckpt, convert_mod.layout_for(ckpt, dtype))
    got = disk_bytes(convert(src, tmp_path / "flash", dtype=dtype, progress=False))
    assert got <= est <= got + convert_mod.TOKENIZER_BYTES_PER_TOKEN * ckpt.config.vocab_size + (64 << 10), (got, est)
