"""The on-flash format: bundle packing against numpy oracles, and damaged or hostile directories refused clearly."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from flash_fixtures import assert_stored_equal, write_random_flashdir
from storage.errors import UserError
from storage import format as fmt
from storage import verify as verify_cmd
from storage.format import FlashCheckpoint, FlashLayout, pack_bundles, read_layout, unpack_bundles, verify
from storage.reader import aligned_empty
from storage.reader import BundleReader


@given(shape=st.tuples(st.integers(1, 5), st.integers(1, 4)), align=st.sampled_from([512, 4096]),
       dtype=st.sampled_from([np.uint8, np.float32]))
def test_aligned_empty(shape, align, dtype):
    a = aligned_empty(shape, dtype, align)
    assert a.ctypes.data % align == 0 and a.shape == shape and a.dtype == dtype and a.flags.c_contiguous


@settings(max_examples=60, deadline=None)
@given(d=st.integers(1, 70), glu=st.booleans(), dtype=st.sampled_from(["f32", "f16", "int8"]),
       biases=st.sampled_from([(), ("bias.up",), ("bias.gate", "bias.up")]), data=st.data())
def test_pack_unpack_round_trip(d, glu, dtype, biases, data):
    if not glu:
        biases = tuple(b for b in biases if b == "bias.up")
    L = FlashLayout.create(d, [1], dtype, glu, biases)
    assert L.stride % 512 == 0 and L.stride >= L.scalars_offset + 4 * len(L.scalars)
    n = data.draw(st.integers(1, 6))
    finite = st.floats(-1e4, 1e4, width=32)
    vecs = data.draw(hnp.arrays(np.float32, (n, L.n_vec, d), elements=finite))
    b = data.draw(hnp.arrays(np.float32, (n, len(L.biases)), elements=finite)) if L.biases else None
    packed = pack_bundles(L, vecs, b)
    assert packed.shape == (n, L.stride) and not packed[:, L.scalars_offset + 4 * len(L.scalars):].any()
    out, out_b = unpack_bundles(L, packed)
    assert_stored_equal(out, vecs, dtype)
    if dtype == "int8":
        # The scale the kernels read from the documented place is max|v| / 127.
        f = packed.view(np.float32)
        for k, v in enumerate(L.vectors):
            np.testing.assert_allclose(f[:, L.scalars_offset // 4 + L.scalar_index(f"scale.{v}")],
                                       np.abs(vecs[:, k]).max(axis=1) / 127, rtol=1e-6)
    if L.biases:
        assert np.array_equal(out_b, b)
        f = packed.view(np.float32)
        for j, name in enumerate(L.biases):
            assert np.array_equal(f[:, L.scalars_offset // 4 + L.scalar_index(name)], b[:, j])


@pytest.mark.parametrize("dtype, down_dtype", [("q8_0", None), ("q4_0", None), ("q4_1", "q8_0"), ("q4_0", "q4_1")])
@pytest.mark.parametrize("glu", [True, False])
def test_quantized_pack_unpack_round_trip(dtype, down_dtype, glu):
    """Vectors in GGUF blocks along d (the down vector in its own kind, if given), as gguf.quants makes them; rows
    given already in blocks are stored verbatim."""
    from gguf import GGMLQuantizationType, quants
    d, n = 96, 5
    rng = np.random.default_rng(len(dtype) + glu)
    biases = ("bias.up",)
    L = FlashLayout.create(d, [n], dtype, glu, biases, down_dtype=down_dtype)
    kinds = L.vector_dtypes
    assert kinds[-1] == (down_dtype or dtype) and set(kinds[:-1]) == {dtype}
    vecs = rng.standard_normal((n, L.n_vec, d)).astype(np.float32)
    b = rng.standard_normal((n, 1)).astype(np.float32)
    ggml = [GGMLQuantizationType[k.upper()] for k in kinds]
    blocks = [quants.quantize(vecs[:, k], t) for k, t in enumerate(ggml)]
    packed = pack_bundles(L, vecs, b)
    assert np.array_equal(pack_bundles(L, [blocks[0]] + [vecs[:, k] for k in range(1, L.n_vec)], b), packed)
    at = L.vector_offsets
    for k in range(L.n_vec):
        assert np.array_equal(packed[:, at[k]:at[k + 1]], blocks[k])
    assert at[-1] <= L.scalars_offset and not packed[:, L.scalars_offset + 4:].any()
    out, out_b = unpack_bundles(L, packed)
    for k, t in enumerate(ggml):
        assert np.array_equal(out[:, k], quants.dequantize(blocks[k], t))
    assert np.array_equal(out_b, b)
    with pytest.raises(UserError, match="positive multiple of 32"):
        FlashLayout.create(40, [n], dtype, glu)
    with pytest.raises(UserError, match="needs quantized bundles"):
        FlashLayout.create(d, [n], "f16", glu, down_dtype="q8_0")


def test_f16_overflow_is_refused():
    L = FlashLayout.create(4, [1], "f16", True)
    with pytest.raises(UserError, match="do not fit in f16"):
        pack_bundles(L, np.full((1, 3, 4), 1e6, np.float32))


def test_layer_regions_are_page_aligned(tmp_path):
    write_random_flashdir(tmp_path / "f", "f16", d=40, n=301, n_layers=3)
    L = read_layout(tmp_path / "f")
    assert all(o % 4096 == 0 for o in L.offset) and L.ffn_size == os.path.getsize(tmp_path / "f" / "ffn.bin")
    assert L.offset[1] >= L.offset[0] + 301 * L.stride


@pytest.mark.parametrize("dtype", ["f32", "f16", "int8", "q4_1"])
def test_vector_norms_read_in_chunks_equal_the_whole_tensors(tmp_path, dtype):
    """train-predictor's |down_i|: from bundles read a few at a time, in original neuron order (a shuffled order)."""
    n = 301
    orders = [np.random.default_rng(i).permutation(n) for i in range(2)]
    write_random_flashdir(tmp_path / "f", dtype, orders=orders, d=64, n=n, n_layers=2)
    ck = FlashCheckpoint(tmp_path / "f")
    for i in range(2):
        for vector, axis in (("down", 0), ("up", 1)):
            want = np.linalg.norm(ck.tensor(f"layers.{i}.ffn.{vector}.weight").astype(np.float64), axis=axis)
            got = ck.vector_norms(i, vector, chunk_bytes=7 * ck.layout.stride)
            np.testing.assert_allclose(got, want, rtol=1e-6)


# ----------------------------------------------------------------------------------------------------------------------
# Damaged and hostile directories

@pytest.fixture
def flashdir(tmp_path):
    write_random_flashdir(tmp_path / "f", "int8", n=200, n_layers=3)
    return tmp_path / "f"


def edit_manifest(flashdir, change):
    """Change the manifest as a hostile file would, its own checksum recomputed: what the checks below must catch."""
    m = json.loads((flashdir / "manifest.json").read_text())
    change(m)
    if "manifest_checksum" in m:
        m["manifest_checksum"] = fmt.manifest_checksum(m)
    (flashdir / "manifest.json").write_text(json.dumps(m))


def test_intact_directory_verifies(flashdir):
    class Args:
        pass
    a = Args()
    a.flashdir = str(flashdir)
    assert verify_cmd.run(a) == 0


def test_flipped_byte_is_caught_by_verify_and_by_the_checkpoint(flashdir):
    L = read_layout(flashdir)
    pos = L.offset[2] + 37 * L.stride + 5
    with open(flashdir / "ffn.bin", "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x10]))
    with pytest.raises(UserError, match="checksum mismatch in layer 2"):
        verify(flashdir, progress=False)
    ck = FlashCheckpoint(flashdir)
    ck.tensor("layers.0.ffn.up.weight")                             # other layers are still readable
    with pytest.raises(UserError, match="checksum mismatch in layer 2"):
        ck.tensor("layers.2.ffn.down.weight")
    with pytest.raises(UserError, match="checksum mismatch in layer 2"):
        ck.vector_norms(2, chunk_bytes=10 * L.stride)               # read in chunks, checked all the same


def test_flipped_byte_in_resident_weights_is_caught(flashdir):
    p = flashdir / "resident.safetensors"
    data = bytearray(p.read_bytes())
    data[-3] ^= 1
    p.write_bytes(bytes(data))
    with pytest.raises(UserError, match="resident weights"):
        verify(flashdir, progress=False)


def test_truncated_ffn_file_is_refused_at_open(flashdir):
    os.truncate(flashdir / "ffn.bin", os.path.getsize(flashdir / "ffn.bin") - 512)
    for opener in (read_layout, FlashCheckpoint, BundleReader, lambda p: verify(p, progress=False)):
        with pytest.raises(UserError, match=r"ffn\.bin: size is \d+ bytes but the manifest says \d+ \(truncated\)"):
            opener(flashdir)


@pytest.mark.parametrize("name", ["../outside.bin", "/etc/passwd", "sub/../../x", "."])
def test_manifest_path_outside_flashdir_is_refused(flashdir, name):
    edit_manifest(flashdir, lambda m: m["files"].__setitem__("ffn", name))
    with pytest.raises(UserError, match="path outside the directory"):
        read_layout(flashdir)


def test_symlink_out_of_flashdir_is_refused(flashdir, tmp_path):
    (tmp_path / "elsewhere.bin").write_bytes((flashdir / "ffn.bin").read_bytes())
    os.symlink(tmp_path / "elsewhere.bin", flashdir / "link.bin")
    edit_manifest(flashdir, lambda m: m["files"].__setitem__("ffn", "link.bin"))
    with pytest.raises(UserError, match="path outside the directory"):
        read_layout(flashdir)


@pytest.mark.parametrize("version", [0, 6, "1", None])
def test_wrong_version_is_refused(flashdir, version):
    edit_manifest(flashdir, lambda m: m.__setitem__("version", version))
    with pytest.raises(UserError, match="version .* is not supported"):
        FlashCheckpoint(flashdir)


@pytest.mark.parametrize("change, message", [
    (lambda m: m.__setitem__("format", "gguf"), "not a flashinfer-lite-flash manifest"),
    (lambda m: m["bundle"].__setitem__("stride", 1000), "stride"),
    (lambda m: m["bundle"].__setitem__("scalars_offset", 4), "scalars"),
    (lambda m: m["layers"][1].__setitem__("offset", 4096 + 1), "unaligned or overlaps"),
    (lambda m: m["layers"][1].__setitem__("offset", 0), "unaligned or overlaps"),
    (lambda m: m["layers"][2].__setitem__("n_neurons", 10**6), "past ffn_size"),
    (lambda m: m["layers"][0].__setitem__("order", [0] * 200), "not a permutation"),
    (lambda m: m["layers"][0].__setitem__("order", list(range(199))), "not a list of 200"),
    (lambda m: m["layers"][0].__setitem__("n_neurons", -3), "must be an integer >= 1"),
    (lambda m: m.__setitem__("dtype", "q4"), "unknown dtype"),
    (lambda m: m["bundle"].__setitem__("down_dtype", "q8_0"), "needs quantized bundles"),
    (lambda m: m["bundle"].__setitem__("vector_bytes", 7), "scalars"),
    (lambda m: m["config"].__setitem__("n_layers", 7), "disagrees"),
    (lambda m: m.pop("layers"), "lacks field"),
])
def test_inconsistent_manifests_are_refused(flashdir, change, message):
    edit_manifest(flashdir, change)
    with pytest.raises(UserError, match=message):
        read_layout(flashdir)


def as_version_1(m):
    """The manifest as a version 1 build wrote this layout: no bundle.align, no per-layer vector_dtypes."""
    m["version"] = 1
    m["bundle"].pop("align")
    for L in m["layers"]:
        L.pop("vector_dtypes")


@pytest.mark.parametrize("version", [1, 2, 3, 4])
def test_older_versions_are_refused_in_one_line_saying_to_reconvert(flashdir, version):
    """One version is written and read: a FLASHDIR of an older build is refused, naming the fix."""
    m = json.loads((flashdir / "manifest.json").read_text())
    assert m["version"] == fmt.FORMAT_VERSION and m["bundle"]["align"] == 512 and \
        all("vector_dtypes" in L for L in m["layers"])       # every field, whichever layout: one version
    edit_manifest(flashdir, as_version_1 if version == 1 else lambda m: m.__setitem__("version", version))
    with pytest.raises(UserError) as e:
        FlashCheckpoint(flashdir)
    msg = str(e.value)
    assert "\n" not in msg and f"format version {version} is not supported" in msg and "re-convert" in msg, msg
    r = subprocess.run([sys.executable, "-m", "flashinfer_lite", "verify", str(flashdir)],
                       capture_output=True, text=True)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1 and "re-convert" in r.stderr, r.stderr


def test_a_manifest_lacking_the_fields_every_version_writes_is_refused(flashdir):
    for change in (lambda m: m["bundle"].pop("vector_bytes"), lambda m: m["bundle"].pop("align"),
                   lambda m: m["layers"][1].pop("vector_dtypes"), lambda m: m.pop("manifest_checksum")):
        bad = shutil.copytree(flashdir, flashdir.with_name(f"bad{id(change)}"))
        edit_manifest(bad, change)
        with pytest.raises(UserError):
            read_layout(bad)


def test_garbage_and_oversized_manifests_are_refused(flashdir, monkeypatch):
    (flashdir / "manifest.json").write_bytes(b"\xff{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        read_layout(flashdir)
    monkeypatch.setattr(fmt, "MAX_MANIFEST_BYTES", 5)
    with pytest.raises(UserError, match="more than the 5 bytes allowed"):
        read_layout(flashdir)


def test_missing_manifest_is_refused(tmp_path):
    (tmp_path / "half").mkdir()
    with pytest.raises(UserError, match="no manifest.json"):
        FlashCheckpoint(tmp_path / "half")


def test_a_launch_rehashes_only_what_changed_since_the_last_verify(tmp_path, monkeypatch):
    """verify stamps the files it checked; verify_at_load then checks sizes only, until a file changes (issue 13's
    load time: a launch must not read the whole model)."""
    path = tmp_path / "m"
    write_random_flashdir(path, "f16")
    hashed = []
    real = fmt.region_checksum
    monkeypatch.setattr(fmt, "region_checksum", lambda *a, **k: hashed.append(a[2]) or real(*a, **k))
    fmt.verify_at_load(path)                          # no stamp yet: a full verify, which stamps
    full = sum(hashed)
    assert full > 0 and (path / fmt.VERIFIED_STAMP).is_file()
    hashed.clear()
    fmt.verify_at_load(path)
    assert hashed == []                               # unchanged: nothing read
    layout = read_layout(path)
    with open(layout.ffn_path, "r+b") as f:           # one flipped byte: a new mtime, so the next launch re-hashes
        f.seek(layout.offset[1] + 3)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x40]))
    with pytest.raises(UserError, match="checksum mismatch in layer 1"):
        fmt.verify_at_load(path)
    os.truncate(layout.ffn_path, layout.offset[1])   # sizes are checked at every launch, stamp or not
    with pytest.raises(UserError):
        fmt.verify_at_load(path)
