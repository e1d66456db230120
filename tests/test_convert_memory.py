"""convert in memory bounded by one layer (issue 11): resident tensors are streamed into resident.safetensors one at a
time, matrices in float16 for f16/int8 FLASHDIRs, and the runtime loads exactly the weights it loaded before."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from conftest import transformers_model
from flash_fixtures import RandomCheckpoint
from flashinfer_lite.budget import resident_bytes_for
from storage.half import half_matrix
from flashinfer_lite.model import load_weights
from flashinfer_lite.model import Transformer
from flashinfer_lite.runtime import load_runtime
from storage.checkpoint import SafetensorsFile, open_checkpoint
from storage.convert import convert, layout_for, write_flashdir
from storage.format import FlashCheckpoint, verify
from storage.safetensors_out import SafetensorsWriter
from test_model_oracle import incremental_logits

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
from make_large_model import main as make_large_model  # noqa: E402
from memcap import available as memcap_unavailable  # noqa: E402

DIM, FFN = 512, 1376
LAYER_F32_FFN = 3 * DIM * FFN * 4          # what _layer_vectors holds of one layer
SHAPE = ["--dim", str(DIM), "--ffn", str(FFN), "--heads", "8", "--check-tokens", "0"]   # MHA: 4 MiB/layer of f32 attention


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """{layers: HF directory} of float16 Llama-shaped models of the same width, 2 and 8 layers."""
    root = tmp_path_factory.mktemp("hf")
    for n in (2, 8):
        assert make_large_model([str(root / f"l{n}"), "--layers", str(n), *SHAPE]) == 0
    yield {n: root / f"l{n}" for n in (2, 8)}
    shutil.rmtree(root, ignore_errors=True)


def test_writer_output_reads_back_with_the_safetensors_package(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {"wide": rng.standard_normal((1000, 300), np.float32),        # float32 offsets have more digits
               "narrow": rng.standard_normal((1000, 300), np.float32).astype(np.float16),
               "empty": np.zeros((0, 5), np.float16),
               "strided": rng.standard_normal((9, 14), np.float32)[:, ::2]}
    path = tmp_path / "t.safetensors"
    with open(path, "wb") as f:
        out = SafetensorsWriter(f, [(n, a.shape) for n, a in tensors.items()], metadata={"made": "here"})
        with pytest.raises(ValueError, match="expected tensor wide"):
            out.write("narrow", tensors["narrow"])
        for n, a in tensors.items():
            out.write(n, a)
        out.finish()
    with safe_open(str(path), "np") as f:
        assert f.metadata() == {"made": "here"} and list(f.keys()) == sorted(tensors)
        for n, a in tensors.items():
            b = f.get_tensor(n)
            assert b.dtype == a.dtype and np.array_equal(a, b), n
    ours = SafetensorsFile(path)
    for n, a in tensors.items():
        assert np.array_equal(ours.read(n), a.astype(np.float32)), n
    assert int.from_bytes(path.read_bytes()[:8], "little") % 8 == 0   # the tensors start 8-aligned

    with open(tmp_path / "u.safetensors", "wb") as f:
        out = SafetensorsWriter(f, [("a", (2,)), ("b", (3,))])
        out.write("a", np.zeros(2, np.float32))
        with pytest.raises(ValueError, match="1 tensors not written, e.g. b"):
            out.finish()


@pytest.mark.parametrize("dtype", ["f32", "f16", "int8"])
def test_resident_tensors_in_the_flashdirs_dtype(hf_models, tmp_path, dtype):
    src_path = hf_models[2]
    out = convert(src_path, tmp_path / "flash", dtype=dtype, progress=False)
    verify(out, progress=False)                                       # resident_checksum is over the file written
    res = out / "resident.safetensors"
    umask = os.umask(0)
    os.umask(umask)
    assert res.stat().st_mode & 0o777 == 0o666 & ~umask
    src, flash = open_checkpoint(src_path), FlashCheckpoint(out)
    nbytes = 0
    with safe_open(str(res), "np") as f:
        assert sorted(f.keys()) == sorted(flash._resident_names)
        for name in f.keys():
            a = f.get_tensor(name)
            assert a.dtype == (np.float32 if dtype == "f32" or a.ndim == 1 else np.float16), name
            want = src.tensor(name)                                   # float16 source: exact in either dtype
            assert np.array_equal(a.astype(np.float32), want) and np.array_equal(flash.tensor(name), want), name
            nbytes += a.nbytes
    assert nbytes == resident_bytes_for(src.config, half=dtype != "f32")   # what the budget plans for


def test_a_matrix_beyond_float16_stays_float32(tmp_path):
    ckpt = RandomCheckpoint()
    ckpt.tensors["embed.weight"][3, 4] = 1e5
    ckpt.tensors["lm_head.weight"] = np.random.default_rng(1).standard_normal((16, 40), np.float32)
    (tmp_path / "f").mkdir()
    write_flashdir(ckpt, layout_for(ckpt, "f16"), tmp_path / "f", progress=False)
    with safe_open(str(tmp_path / "f" / "resident.safetensors"), "np") as f:
        assert f.get_tensor("embed.weight").dtype == np.float32
        assert f.get_tensor("lm_head.weight").dtype == np.float16
    flash = FlashCheckpoint(tmp_path / "f")
    assert np.array_equal(flash.tensor("embed.weight"), ckpt.tensors["embed.weight"])
    assert np.array_equal(flash.tensor("lm_head.weight"), ckpt.tensors["lm_head.weight"].astype(np.float16))


@pytest.mark.parametrize("kind", ["llama-bias-untied", "opt"])
def test_runtime_loads_the_same_weights_and_logits_as_before(tiny_model, tmp_path, kind):
    """Before, resident.safetensors held the source's float32 and the runtime halved the matrices at load; now the
    file holds them halved. A float32 source, so the rounding is real."""
    import torch
    src_path = tiny_model(kind)
    out = convert(src_path, tmp_path / "flash", dtype="f16", progress=False)
    src, flash = open_checkpoint(src_path), FlashCheckpoint(out)
    before = {n: half_matrix(src.tensor(n) if n in flash._resident_names else flash.tensor(n)) for n in flash.names()}
    now = load_weights(flash, convert=half_matrix)                    # as load_runtime(..., "dense") loads them
    assert sorted(now) == sorted(before)
    for n, a in before.items():
        assert now[n].dtype == a.dtype and np.array_equal(now[n], a), n
    model, _, _ = load_runtime(out, "dense")
    ids = np.random.default_rng(2).integers(3, 512, size=20).tolist()
    got = incremental_logits(model, ids, prefill=6)
    assert np.array_equal(got, incremental_logits(Transformer(src.config, before), ids, prefill=6))
    with torch.no_grad():
        want = transformers_model(src_path)(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(want).max() > 0.1
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-2 * np.abs(want).max())   # float16 weights
    assert np.array_equal(got.argmax(-1), want.argmax(-1))


# convert in a fresh process that reports how far its RSS rose above what the imports left (VmHWM: the kernel's own
# high-water mark of this process, not inherited from pytest).
PEAK = """
import json, sys
from flashinfer_lite.process import peak_rss_bytes, rss_bytes
from storage.convert import convert
base = rss_bytes()
convert(sys.argv[1], sys.argv[2], dtype="f16", progress=False)
print(json.dumps({"growth": peak_rss_bytes() - base}))
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from /proc")
def test_convert_peak_does_not_grow_with_layers(hf_models, tmp_path):
    growth = {}
    for n, path in hf_models.items():
        r = subprocess.run([sys.executable, "-c", PEAK, str(path), str(tmp_path / f"flash{n}")], capture_output=True,
                           timeout=300, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert r.returncode == 0, r.stderr.decode()[-2000:]
        growth[n] = json.loads(r.stdout.decode().splitlines()[-1])["growth"]
    # Six more layers: 24 MiB more float32 attention, which convert held all at once before (twice, with save_file's
    # copy). Now nothing grows with the layers; within one: its float32 FFN, a chunk of packed bundles, read buffers.
    assert abs(growth[8] - growth[2]) < LAYER_F32_FFN, growth
    assert growth[8] < 5 * LAYER_F32_FFN, growth


@pytest.mark.skipif(memcap_unavailable() is not None, reason=f"no memory cgroup: {memcap_unavailable()}")
def test_convert_runs_under_a_cap_of_half_the_model(tmp_path):
    # 24 layers x dim 1024 x 2816 neurons, MHA: 620 MB of float16 files, 400 MB of float32 resident weights.
    hf = tmp_path / "hf"
    assert make_large_model([str(hf), "--layers", "24", "--dim", "1024", "--ffn", "2816", "--heads", "8",
                             "--check-tokens", "0"]) == 0
    cap = (hf / "model.safetensors").stat().st_size // 2
    summary = tmp_path / "cap.json"
    r = subprocess.run([sys.executable, str(REPO / "tools" / "memcap.py"), "--limit", str(cap), "--json", str(summary),
                        "--", sys.executable, "-m", "flashinfer_lite", "convert", str(hf), "-o", str(tmp_path / "flash")],
                       capture_output=True, timeout=600, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    s = json.loads(summary.read_text())
    assert r.returncode == 0 and s["oom_kills"] == 0, (s, r.stderr.decode()[-2000:])
    assert s["peak_bytes"] <= cap
    verify(tmp_path / "flash", progress=False)
