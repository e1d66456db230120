"""Untrusted files and real faults (issue 25): every bad input is one line on stderr and a non-zero exit, nothing the
user owned is deleted, nothing half-written is left behind, nothing corrupt is trusted."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import STORIES
from test_cli import cli

PROGRESS = re.compile(r"^[\w -]+:\s+\d+%\|")   # a tqdm progress bar's line (stderr is not a terminal here)


def assert_one_line_error(r, *fragments):
    """Exit code 1, no traceback, and one line on stderr besides progress bars, holding every fragment."""
    err = r.stderr.decode("utf-8", "replace").strip()
    assert r.returncode == 1, err
    assert "Traceback" not in err, err
    # nor are the status lines of --ffn auto and of first-use training
    lines = [ln for ln in err.splitlines() if ln.strip() and not PROGRESS.match(ln)
             and not ln.startswith(("ffn: ", "predictors: none yet", "converting "))]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for f in fragments:
        assert f in lines[0], err


def leftovers(d: Path) -> list[str]:
    """Names a writer leaves behind when it fails: its temp directories and files. Not the empty .NAME.lock files of
    first use (storage.files.exclusive): removing a lock file others may be waiting on would let two hold it."""
    return sorted(p.name for p in Path(d).rglob("*") if p.name.startswith(".") and not p.name.endswith(".lock")
                  and ("-" in p.name or ".tmp" in p.name))


# ----------------------------------------------------------------------------------------------------------------------
# Data loss: --force replaces only a FLASHDIR this program wrote; two writers: one wins, the other says so

def test_force_never_replaces_a_file(tmp_path):
    f = tmp_path / "important.txt"
    f.write_text("precious\n")
    assert_one_line_error(cli("convert", str(STORIES), "-o", str(f), "--force"), "not a flash directory")
    assert f.read_text() == "precious\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["important.txt"]


def test_force_never_replaces_a_foreign_directory_holding_a_manifest(tmp_path):
    d = tmp_path / "work"
    d.mkdir()
    (d / "manifest.json").write_text('{"name": "my project"}')
    (d / "thesis.tex").write_text("years of work")
    assert_one_line_error(cli("convert", str(STORIES), "-o", str(d), "--force"), "not a flash directory")
    assert (d / "thesis.tex").read_text() == "years of work"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work"]


def test_force_never_replaces_a_flashdir_holding_a_foreign_file(tmp_path):
    out = tmp_path / "flash"
    assert cli("convert", str(STORIES), "-o", str(out)).returncode == 0
    (out / "notes.txt").write_text("mine")
    assert_one_line_error(cli("convert", str(STORIES), "-o", str(out), "--force"), "not a flash directory")
    assert (out / "notes.txt").read_text() == "mine"


def test_force_replaces_a_flashdir_this_program_wrote(tmp_path):
    out = tmp_path / "flash"
    assert cli("convert", str(STORIES), "-o", str(out), "--dtype", "f32").returncode == 0
    r = cli("convert", str(STORIES), "-o", str(out), "--dtype", "f16", "--force")
    assert r.returncode == 0, r.stderr.decode()
    from storage.format import read_layout
    assert read_layout(out).dtype == "f16"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["flash"]


def test_two_writers_to_the_same_output_one_wins_the_other_says_so(tmp_path):
    out = tmp_path / "flash"
    env = dict(os.environ, PYTHONIOENCODING="utf-8")
    procs = [subprocess.Popen([sys.executable, "-m", "flashinfer_lite", "convert", str(STORIES), "-o", str(out)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env) for _ in range(2)]
    results = [(p.wait(timeout=300), p.stderr.read().decode()) for p in procs]
    codes = sorted(c for c, _ in results)
    assert codes == [0, 1], results
    err = next(e for c, e in results if c == 1).strip().splitlines()[-1]   # after the loser's progress bar, if any
    assert err.startswith("error: ") and str(out) in err, results
    from storage.format import verify
    verify(out, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["flash"]


# ----------------------------------------------------------------------------------------------------------------------
# A full disk (ENOSPC) and a read-only one (EROFS): one line naming the path, nothing left behind

def _root_mount(*args) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs or a read-only bind mount needs root")
    r = subprocess.run(["mount", *map(str, args)], capture_output=True)
    if r.returncode:
        pytest.skip(f"cannot mount ({r.stderr.decode().strip()})")


@pytest.fixture
def small_disk(tmp_path):
    """A real 256 KiB tmpfs: far smaller than stories260K's FLASHDIR."""
    d = tmp_path / "small"
    d.mkdir()
    _root_mount("-t", "tmpfs", "-o", "size=256k", "tmpfs", d)
    yield d
    subprocess.run(["umount", d], check=True)


@pytest.fixture
def read_only(tmp_path):
    """A directory seen through a read-only bind mount (writes fail with EROFS)."""
    src, d = tmp_path / "rw", tmp_path / "ro"
    src.mkdir()
    d.mkdir()
    _root_mount("--bind", src, d)
    r = subprocess.run(["mount", "-o", "remount,bind,ro", d], capture_output=True)
    if r.returncode:
        subprocess.run(["umount", d])
        pytest.skip(f"cannot remount read-only ({r.stderr.decode().strip()})")
    yield d
    subprocess.run(["umount", d], check=True)


def test_convert_onto_a_full_disk(small_disk):
    """Refused before anything is written: what the FLASHDIR needs and what the filesystem has, in one line."""
    (small_disk / "keep.txt").write_text("mine")
    r = cli("convert", str(STORIES), "-o", str(small_disk / "flash"))
    assert_one_line_error(r, "need ", f"free in {small_disk} ", ", have ")
    assert sorted(p.name for p in small_disk.iterdir()) == ["keep.txt"]


def test_convert_onto_a_disk_that_fills_up_anyway(small_disk, monkeypatch):
    """The free-space estimate short (another writer took the room meanwhile): ENOSPC is still one line, and nothing
    half-written is left."""
    from storage import convert as convert_mod
    from storage.errors import UserError
    monkeypatch.setattr(convert_mod, "flashdir_bytes", lambda *a, **k: 0)
    with pytest.raises(UserError, match="No space left on device"):
        convert_mod.convert(STORIES, small_disk / "flash", progress=False)
    assert list(small_disk.iterdir()) == []


def test_convert_onto_a_read_only_disk(read_only):
    assert_one_line_error(cli("convert", str(STORIES), "-o", str(read_only / "flash")), "Read-only file system",
                          str(read_only))
    assert list(read_only.iterdir()) == []


# ----------------------------------------------------------------------------------------------------------------------
# Read-only models and caches (container images, NFS, squashfs): a stamp, digest or index that cannot be written
# costs a full check or a re-hash at the next run, never a failure

def read_only_copy(src_tree: Path, read_only: Path, name: str) -> Path:
    """src_tree copied where the read_only fixture shows it (its rw side), seen read-only."""
    import shutil
    shutil.copytree(src_tree, read_only.parent / "rw" / name)
    return read_only / name


def test_a_read_only_flashdir_never_verified_here_runs_and_verifies(flash, read_only):
    """Copied onto a read-only filesystem without its .verified.json: verified in full at every launch."""
    d = read_only_copy(flash, read_only, "flash")
    (read_only.parent / "rw" / "flash" / ".verified.json").unlink()
    before = sorted(p.name for p in (read_only.parent / "rw" / "flash").iterdir())
    r = cli("generate", "-m", str(d), "--ffn", "dense", "-p", "Once", "-n", "4", "--temp", "0")
    assert r.returncode == 0 and r.stdout.decode().startswith("Once"), r.stderr.decode()
    r = cli("verify", str(d))
    assert r.returncode == 0 and "match their checksums" in r.stdout.decode(), r.stderr.decode()
    assert sorted(p.name for p in (read_only.parent / "rw" / "flash").iterdir()) == before


def test_a_read_only_flashdir_without_gate_thresholds_names_the_command_that_writes_them(flash, read_only):
    """--ffn auto on a SiLU model's split layout is the exact gate, whose thresholds are calibrated into gate.json on
    first use: a read-only FLASHDIR cannot hold them, which one line says before any calibration runs."""
    d = read_only_copy(flash, read_only, "flash")
    assert not (d / "gate.json").exists()
    r = cli("generate", "-m", str(d), "-p", "Once", "-n", "4")
    assert_one_line_error(r, str(d), "read-only", f"python -m predictors.calibrate_gate {d}", "--ffn dense")


def test_a_warm_cache_mounted_read_only_elsewhere_runs(tmp_path, read_only, monkeypatch):
    """A cache filled by a first use (conversion, gate calibration), then seen read-only at another path, for a copy
    of the model at another path (its digests are not remembered: source-digests.json cannot take them): the run
    re-hashes the model, finds the conversion by content and answers as the writable cache did."""
    import shutil
    model = shutil.copytree(STORIES, tmp_path / "m")
    monkeypatch.setenv("FLASHINFER_LITE_CACHE", str(read_only.parent / "rw" / "cache"))
    args = ("-p", "Once", "-n", "6", "--temp", "0", "--ffn", "gate")
    first = cli("generate", "-m", str(model), *args)
    assert first.returncode == 0, first.stderr.decode()
    digests = (read_only.parent / "rw" / "cache" / "source-digests.json").read_bytes()
    monkeypatch.setenv("FLASHINFER_LITE_CACHE", str(read_only / "cache"))
    again = cli("generate", "-m", str(shutil.copytree(STORIES, tmp_path / "elsewhere")), *args)
    assert again.returncode == 0 and again.stdout == first.stdout, again.stderr.decode()
    assert (read_only.parent / "rw" / "cache" / "source-digests.json").read_bytes() == digests


def test_a_gguf_on_a_read_only_disk_runs_dense_from_its_mapped_pages(read_only):
    """A GGUF seen through a read-only mount (a squashfs image, NFS): mapped read-only and shared, the dense model's
    weights are views of it, and its greedy tokens are those of the same file on a writable disk."""
    import gc
    import shutil
    from conftest import greedy_tokens
    from flashinfer_lite.runtime import load_runtime
    from storage.checkpoint import file_map_of
    src = Path(__file__).resolve().parent / "data" / "gguf" / "qwen2-q4_k_m.gguf"
    shutil.copyfile(src, read_only.parent / "rw" / src.name)
    path = read_only / src.name
    with pytest.raises(OSError, match="Read-only file system"):
        open(path, "r+b")

    def tokens(p: Path) -> list[int]:
        model = load_runtime(p, "dense")[0]
        assert file_map_of(model.dense_ffn[0].w_down.q) is not None
        return greedy_tokens(model, [1, 2, 3], 12)
    assert tokens(path) == tokens(src)
    gc.collect()        # the map closes with the model's last view, so the mount can go


def test_the_default_gguf_in_a_read_only_cache_is_hashed_not_stamped(smollm2_gguf, read_only, monkeypatch):
    """No stamp beside the default GGUF and none writable: its sha256 is checked in full, and `fetch` succeeds."""
    import shutil
    from flashinfer_lite import default_model
    (read_only.parent / "rw" / "cache" / "models").mkdir(parents=True)
    shutil.copyfile(smollm2_gguf, read_only.parent / "rw" / "cache" / "models" / default_model.FILENAME)
    monkeypatch.setenv("FLASHINFER_LITE_CACHE", str(read_only / "cache"))
    r = cli("fetch")
    assert r.returncode == 0 and r.stdout.decode().strip() == str(read_only / "cache" / "models" /
                                                                  default_model.FILENAME), r.stderr.decode()


def test_every_best_effort_writer_leaves_a_read_only_directory_alone(read_only, tmp_path, monkeypatch):
    """write_best_effort and its callers that the tests above do not reach (the kernels' compiled stamp), aimed at
    a read-only directory: False or nothing, never an exception, nothing written."""
    from flashinfer_lite import warmup
    from storage import cache
    from storage.files import write_best_effort
    assert write_best_effort(read_only / "x.json", "{}") is False
    assert write_best_effort(tmp_path / "x.json", "{}") is True and (tmp_path / "x.json").read_text() == "{}"
    cache._write(read_only / "index.json", {"a": 1})
    monkeypatch.setattr(warmup, "compiled_stamp", lambda layout: read_only / "kernels.stamp")
    monkeypatch.setattr(warmup, "stamp_record", lambda layout: {})
    warmup.remember(None, {"kernels": 1})
    assert list(read_only.iterdir()) == []


# ----------------------------------------------------------------------------------------------------------------------
# The default GGUF: its sha256 checked when it changed, remembered by a stamp (size, mtime, inode) otherwise

def test_default_gguf_changed_in_place_is_refused(tmp_path, monkeypatch, smollm2_gguf):
    import shutil
    from flashinfer_lite import default_model
    cache = tmp_path / "cache"
    (cache / "models").mkdir(parents=True)
    gguf = cache / "models" / default_model.FILENAME
    shutil.copyfile(smollm2_gguf, gguf)
    monkeypatch.setenv("FLASHINFER_LITE_CACHE", str(cache))
    r = cli("fetch")
    assert r.returncode == 0 and r.stdout.decode().strip() == str(gguf), r.stderr.decode()
    # the stamp spares the next launch the hash: a hash now would fail the test
    monkeypatch.setattr(default_model, "sha256_of", lambda p: pytest.fail("hashed again although unchanged"))
    assert default_model.ensure_default_model(quiet=True) == gguf
    with open(gguf, "r+b") as f:              # in place: the size stays, the bytes do not
        f.seek(50 << 20)
        f.write(bytes(4096))
    for args in (("fetch",), ("generate", "-p", "hi", "-n", "2", "--ffn", "dense")):
        assert_one_line_error(cli(*args), str(gguf), "sha256")
    assert gguf.stat().st_size == default_model.SIZE                 # reported, not deleted
    assert not (cache / "flash").exists()                            # and never converted into a cache entry


# ----------------------------------------------------------------------------------------------------------------------
# Layer checksums bound to the layer and its geometry; a manifest whose neuron count disagrees with the config

@pytest.fixture(scope="module")
def flash(tmp_path_factory):
    from storage.convert import convert
    return convert(STORIES, tmp_path_factory.mktemp("untrusted") / "flash", dtype="f32", progress=False)


def copy_flash(flash, tmp_path) -> Path:
    import shutil
    return shutil.copytree(flash, tmp_path / "flash")


def edit_manifest(d: Path, edit) -> None:
    """As a hostile file would: the manifest's own checksum recomputed."""
    import json
    from storage.format import manifest_checksum
    m = json.loads((d / "manifest.json").read_text())
    edit(m)
    m["manifest_checksum"] = manifest_checksum(m)
    (d / "manifest.json").write_text(json.dumps(m))


def test_two_layers_swapped_with_their_checksums_are_refused(flash, tmp_path):
    """The FFN file's regions of layers 0 and 1 swapped, and their checksums with them (a SiLU model: the split
    parts alone hold its FFN; gate_up.bin here)."""
    from storage.format import read_layout
    d = copy_flash(flash, tmp_path)
    P = read_layout(d).parts["gate_up"]
    a, b = (bytearray(P.region_bytes(0)), bytearray(P.region_bytes(1)))
    with open(P.ffn_path, "r+b") as f:
        f.seek(P.offset[0]); f.readinto(a)
        f.seek(P.offset[1]); f.readinto(b)
        f.seek(P.offset[0]); f.write(b)
        f.seek(P.offset[1]); f.write(a)

    def swap(m):
        sums = m["split"]["gate_up"]["checksums"]
        sums[0], sums[1] = sums[1], sums[0]
    edit_manifest(d, swap)
    assert_one_line_error(cli("verify", str(d)), "checksum mismatch in layer 0")
    assert_one_line_error(cli("generate", "-m", str(d), "-p", "Once", "-n", "4", "--ffn", "dense"),
                          "checksum mismatch in layer 0")


def test_a_neuron_count_that_disagrees_with_the_config_is_one_line(flash, tmp_path):
    """n_neurons 171 (stories260K's ffn_dim is 172): refused in one line (an IndexError in generate before). The
    split parts' regions derive from it, so no checksum needs recomputing to get this far."""
    d = copy_flash(flash, tmp_path)
    edit_manifest(d, lambda m: m["layers"][0].__setitem__("n_neurons", 171))
    for args in (("verify", str(d)), ("generate", "-m", str(d), "-p", "Once", "-n", "4", "--ffn", "dense")):
        assert_one_line_error(cli(*args), "layer 0 has 171 neurons but the config's ffn_dim is 172")


# ----------------------------------------------------------------------------------------------------------------------
# Every tensor's shape checked against the config: at convert, at verify and at load (norms included)

def copy_model(tmp_path) -> Path:
    import shutil
    return shutil.copytree(STORIES, tmp_path / "model")


def rewrite_safetensors(path: Path, edit) -> None:
    from safetensors.numpy import load_file, save_file
    t = load_file(str(path))
    edit(t)
    save_file(t, str(path))


@pytest.mark.parametrize("name,shape", [("model.norm.weight", (32,)),
                                        ("model.layers.2.post_attention_layernorm.weight", (63,)),
                                        ("model.embed_tokens.weight", (512, 32)),
                                        ("model.layers.0.self_attn.q_proj.weight", (64, 32))])
def test_a_source_tensor_of_the_wrong_shape_is_refused_at_convert(tmp_path, name, shape):
    import numpy as np
    m = copy_model(tmp_path)
    rewrite_safetensors(m / "model.safetensors", lambda t: t.__setitem__(name, np.ones(shape, np.float32)))
    out = tmp_path / "flash"
    assert_one_line_error(cli("convert", str(m), "-o", str(out)), "has shape", "the config implies")
    assert_one_line_error(cli("generate", "-m", str(m), "-p", "Once", "-n", "2"), "has shape")
    assert not out.exists() and leftovers(tmp_path) == []


@pytest.mark.parametrize("name,shape", [("norm.weight", (32,)), ("layers.1.ffn_norm.weight", (288,)),
                                        ("embed.weight", (511, 64)), ("layers.0.attn.q.weight", (64, 32))])
def test_a_resident_tensor_of_the_wrong_shape_is_refused_at_verify_and_load(flash, tmp_path, name, shape):
    """Its checksum recomputed: a FLASHDIR built so on purpose, not damaged."""
    import numpy as np
    from storage.format import file_checksum
    d = copy_flash(flash, tmp_path)
    res = d / "resident.safetensors"
    rewrite_safetensors(res, lambda t: t.__setitem__(name, np.ones(shape, np.float32)))
    edit_manifest(d, lambda m: m.__setitem__("resident_checksum", file_checksum(res)))
    for args in (("verify", str(d)), ("generate", "-m", str(d), "-p", "Once", "-n", "2", "--ffn", "dense")):
        assert_one_line_error(cli(*args), f"tensor {name} has shape {list(shape)}, but the config implies")


# ----------------------------------------------------------------------------------------------------------------------
# Non-finite weights (a corrupt download: GGUF files carry no checksums): one line naming the tensor, at convert and
# at every load, before a kernel divides by them

@pytest.mark.parametrize("name,at,value", [("model.layers.0.input_layernorm.weight", (0,), "nan"),
                                           ("model.embed_tokens.weight", (7, 3), "inf"),
                                           ("model.layers.1.mlp.down_proj.weight", (5, 9), "-inf")])
def test_a_non_finite_source_weight_is_one_line_naming_it(tmp_path, name, at, value):
    m = copy_model(tmp_path)

    def poison(t):
        t[name] = t[name].copy()
        t[name][at] = float(value)
    rewrite_safetensors(m / "model.safetensors", poison)
    says = f"model.safetensors: tensor {name} holds {value} at {list(at)}"
    out = tmp_path / "flash"
    assert_one_line_error(cli("convert", str(m), "-o", str(out)), says)
    assert not out.exists() and leftovers(tmp_path) == []
    assert_one_line_error(cli("generate", "-m", str(m), "-p", "Once", "-n", "4", "--temp", "0"), says)


class Poisoned:
    """A checkpoint whose tensor `name` holds inf at `at` (what write_llama_gguf reads)."""
    def __init__(self, ckpt, name, at):
        self.ckpt, self.config, self.name, self.at = ckpt, ckpt.config, name, at

    def tensor(self, name):
        t = self.ckpt.tensor(name).copy()
        if name == self.name:
            t[self.at] = float("inf")
        return t


@pytest.mark.parametrize("name,gguf_name,kind,says", [
    ("layers.0.ffn.gate.weight", "blk.0.ffn_gate.weight", "Q8_0", "(q8_0 block scales) holds inf at [3, 0]"),
    ("layers.1.attn.v.weight", "blk.1.attn_v.weight", "Q4_0", "(q4_0 block scales) holds -inf at [3, 0]"),
    ("layers.0.ffn_norm.weight", "blk.0.ffn_norm.weight", None, "holds inf at [3]")])
def test_a_gguf_with_a_non_finite_weight_or_block_scale_is_one_line_naming_it(tmp_path, name, gguf_name, kind, says):
    """An inf weight quantized by gguf.quants (llama.cpp's reference) makes its block's d infinite (q4_0: -inf, its
    d is the largest magnitude over -8): found in the blocks the dense run keeps, and at convert, which copies
    them."""
    from conftest import write_llama_gguf
    from storage.checkpoint import HFCheckpoint
    import numpy as np
    src = Poisoned(HFCheckpoint(STORIES), name, (3, 17) if kind else (3,))
    with np.errstate(invalid="ignore"):       # gguf.quants: inf * 0 as it quantizes the block
        path = write_llama_gguf(src, tmp_path / "m.gguf", types={name: kind} if kind else {})
    says = f"m.gguf: tensor {gguf_name} {says}"
    assert_one_line_error(cli("generate", "-m", str(path), "-p", "Once", "-n", "2", "--ffn", "dense"), says)
    out = tmp_path / "flash"
    assert_one_line_error(cli("convert", str(path), "-o", str(out)), says)
    assert not out.exists() and leftovers(tmp_path) == []


def test_a_non_finite_resident_weight_of_a_flashdir_is_one_line(flash, tmp_path):
    """A FLASHDIR converted before convert checked its source (its checksums match what it holds): refused at
    load by the same check."""
    import numpy as np
    from storage.format import file_checksum
    d = copy_flash(flash, tmp_path)
    res = d / "resident.safetensors"

    def poison(t):
        t["layers.0.attn_norm.weight"] = t["layers.0.attn_norm.weight"].copy()
        t["layers.0.attn_norm.weight"][5] = np.nan
    rewrite_safetensors(res, poison)
    edit_manifest(d, lambda m: m.__setitem__("resident_checksum", file_checksum(res)))
    assert_one_line_error(cli("generate", "-m", str(d), "-p", "Once", "-n", "2", "--ffn", "dense"),
                          "resident.safetensors: tensor layers.0.attn_norm.weight holds nan at [5]")


# ----------------------------------------------------------------------------------------------------------------------
# Unbounded reads and hangs: regular files only, bounded by the bytes read; JSON nesting bounded

MODEL_FILES = ["config.json", "generation_config.json", "tokenizer_config.json", "tokenizer.json",
               "chat_template.jinja", "model.safetensors"]


@pytest.mark.parametrize("special", ["/dev/zero", "fifo"])
@pytest.mark.parametrize("name", MODEL_FILES)
def test_a_model_file_that_is_a_device_or_a_fifo_is_refused(tmp_path, name, special):
    m = copy_model(tmp_path)
    (m / name).unlink(missing_ok=True)
    if special == "fifo":
        os.mkfifo(m / name)                          # nobody ever writes: a reader that opens it blocks forever
    else:
        (m / name).symlink_to(special)               # stat says 0 bytes; reading never ends
    out = tmp_path / "flash"
    r = cli("convert", str(m), "-o", str(out))       # cli's timeout (300 s) would fail a hang
    escape = name == "model.safetensors" and special == "/dev/zero"    # weights are kept inside the model directory
    assert_one_line_error(r, "outside the directory" if escape else "not a regular file", name)
    assert not out.exists() and leftovers(tmp_path) == []


def test_a_flashdir_manifest_that_is_a_fifo_is_refused(flash, tmp_path):
    d = copy_flash(flash, tmp_path)
    (d / "manifest.json").unlink()
    os.mkfifo(d / "manifest.json")
    assert_one_line_error(cli("verify", str(d)), "not a regular file")


DEEP = b"[" * 100_000 + b"]" * 100_000


def safetensors_with_header(header: bytes, data: bytes = b"") -> bytes:
    return len(header).to_bytes(8, "little") + header + data


@pytest.mark.parametrize("name,content,message", [
    ("config.json", DEEP, "nested too deeply"),
    ("tokenizer_config.json", b'{"a": ' + DEEP + b"}", "nested too deeply"),
    ("model.safetensors", safetensors_with_header(DEEP), "nested too deeply"),
    ("model.safetensors", safetensors_with_header(b'[{"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}]',
                                                  bytes(4)), "not a JSON object"),
    # 2**32 * 2**32 wraps int64 to 0, which matched an empty data range before Python integers did the product
    ("model.safetensors", safetensors_with_header(b'{"w": {"dtype": "F32", "shape": [4294967296, 4294967296], '
                                                  b'"data_offsets": [0, 0]}}'), "does not match its shape"),
    ("model.safetensors", safetensors_with_header(b'{"w": {"dtype": "F32", "shape": [-1, -4], '
                                                  b'"data_offsets": [0, 16]}}', bytes(16)), "corrupt tensor entry"),
    ("model.safetensors", safetensors_with_header(b'{"w": {"dtype": "F32", "shape": [4], '
                                                  b'"data_offsets": [0, 16.5]}}', bytes(17)), "corrupt tensor entry"),
])
def test_hostile_json_in_model_files_is_one_line(tmp_path, name, content, message):
    m = copy_model(tmp_path)
    (m / name).write_bytes(content)
    out = tmp_path / "flash"
    assert_one_line_error(cli("convert", str(m), "-o", str(out)), message)
    assert not out.exists() and leftovers(tmp_path) == []


@pytest.mark.parametrize("name", ["manifest.json", "predictors/manifest.json"])
def test_deeply_nested_flashdir_manifests_are_one_line(flash, tmp_path, name):
    d = copy_flash(flash, tmp_path)
    (d / name).parent.mkdir(exist_ok=True)
    (d / name).write_bytes(b'{"a": ' + DEEP + b"}")
    assert_one_line_error(cli("verify", str(d)), "nested too deeply")


# ----------------------------------------------------------------------------------------------------------------------
# Chat templates from the model file: rendered in jinja2's sandbox, every failure one line; chat without stdin

@pytest.mark.parametrize("template,message", [("{{ 1 + 'a' }}", "chat template failed"),
                                              ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "chat template failed"),
                                              ("{% for %}", "chat template failed"),
                                              (5, "not a string"), ({"x": 1}, "not a string")])
def test_chat_templates_that_fail_are_one_line(flash, tmp_path, template, message):
    import json
    d = copy_flash(flash, tmp_path)
    tc = d / "tokenizer" / "tokenizer_config.json"
    cfg = json.loads(tc.read_text())
    cfg["chat_template"] = template
    tc.write_text(json.dumps(cfg))
    assert_one_line_error(cli("chat", "-m", str(d), "-n", "4", stdin=b"hi\n"), message)


@pytest.mark.parametrize("template,message", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}{{ messages[0].content }}",
     "chat template runs over"),                        # hung generate, and would hold a server thread per request
    ("{{ 'a' * 1500000000 }}", "chat template computes 'a' * 1500000000")])      # 20 GB before the OOM killer
def test_a_chat_template_is_bounded_in_work_and_size(tmp_path, template, message):
    import json
    m = copy_model(tmp_path)
    cfg = json.loads((m / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (m / "tokenizer_config.json").write_text(json.dumps(cfg))
    r, peak = run_measured("generate", "-m", str(m), "-p", "Once", "-n", "2")
    assert_one_line_error(r, message, "refusing it")
    assert peak < 400, peak


@pytest.mark.parametrize("template,message", [
    ("{% set s = 'a' * 100000 %}{% for c in s %}{% for d in s %}{% endfor %}{% endfor %}", "runs over"),
    ("{% macro f() %}{% for i in range(100000) %}{% endfor %}{{ f() }}{% endmacro %}{{ f() }}", "runs over"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     "builds a value of over"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
     "builds a value of over"),
    ("{% set ns = namespace(l=[1]) %}{% for i in range(64) %}{% set ns.l = [ns.l, ns.l] %}{% endfor %}{{ ns.l }}",
     "builds a value of over"),
    ("{% set ns = namespace(l=[1]) %}{% for i in range(64) %}{% set ns.l = [ns.l, ns.l] %}{% endfor %}"
     "{{ ns.l|tojson }}", "builds a value of over"),
    ("{{ [messages] * 10**9 }}", "computes"), ("{{ 7 ** (10 ** 9) }}", "computes"),
    ("{{ 'a'|center(10**9) }}", "passes a number over"), ("{{ 'a'.ljust(10**9) }}", "passes a number over"),
    ("{{ '{:>999999999}'.format(1) }}", "field width"), ("{{ '%999999999s' % 1 }}", "field width"),
    ("{{ '%999999999s'|format(1) }}", "field width"),
    ("{% for i in range(50000) %}{{ 'abcdefghij' * 100 }}{% endfor %}", "writes over")])
def test_hostile_chat_templates_are_refused_in_one_line(template, message):
    """The two templates of the issue's report are tested through the CLI above; these are the other ways a template
    can loop or grow (over a string, by recursion, doubling a string or a shared list, repeating, powers, padding,
    field widths, output)."""
    from storage.errors import UserError
    from storage.tokenizer import render_chat_template
    with pytest.raises(UserError, match=message):
        render_chat_template(template, [{"role": "user", "content": "hi"}], True)


def test_a_real_chat_template_still_renders_long_conversations(smollm2_gguf):
    """The bounds leave room: SmolLM2's template (5 steps per message) over 2000 messages of 1000 digits each (long
    numbers are not field widths outside a format string), as transformers' own renderer writes it."""
    from transformers import PreTrainedTokenizerFast
    from flashinfer_lite.model import open_any
    tok = open_any(smollm2_gguf).tokenizer()
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": "1234567890" * 100} for i in range(2000)]
    want = PreTrainedTokenizerFast(tokenizer_object=tok.tok, chat_template=tok.chat_template).apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(msgs) == want


def test_chat_with_stdin_closed_is_one_line(flash, tmp_path):
    d = copy_flash(flash, tmp_path)
    r = subprocess.run([sys.executable, "-m", "flashinfer_lite", "chat", "-m", str(d)], stdin=subprocess.DEVNULL,
                       capture_output=True, timeout=300, preexec_fn=lambda: os.close(0))
    assert_one_line_error(r, "standard input, which is closed")


# ----------------------------------------------------------------------------------------------------------------------
# Hugging Face hub cache snapshots: files symlinked into the same repository's blobs/ are the normal layout

def hub_snapshot(root: Path, repo: str = "models--org--stories") -> Path:
    """stories260K laid out as `huggingface-cli download` leaves it: REPO/snapshots/REV/NAME -> ../../blobs/HASH."""
    import hashlib
    import shutil
    blobs, snap = root / repo / "blobs", root / repo / "snapshots" / "0123abc"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in STORIES.iterdir():
        h = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, blobs / h)
        (snap / f.name).symlink_to(Path("..") / ".." / "blobs" / h)
    return snap


def test_a_hub_cache_snapshot_converts_as_the_plain_directory(flash, tmp_path):
    import json
    snap = hub_snapshot(tmp_path / "hub")
    out = tmp_path / "from_hub"
    r = cli("convert", str(snap), "-o", str(out), "--dtype", "f32")
    assert r.returncode == 0, r.stderr.decode()
    want, got = (json.loads((d / "manifest.json").read_text()) for d in (flash, out))
    assert got["layers"] == want["layers"] and got["resident_checksum"] == want["resident_checksum"]


def test_a_hub_snapshot_symlink_into_another_repository_is_refused(tmp_path):
    snap = hub_snapshot(tmp_path / "hub")
    other = hub_snapshot(tmp_path / "hub", repo="models--org--other")
    (snap / "model.safetensors").unlink()
    (snap / "model.safetensors").symlink_to(other / "model.safetensors")
    assert_one_line_error(cli("convert", str(snap), "-o", str(tmp_path / "out")),
                          "weights file names a path outside the directory")


# ----------------------------------------------------------------------------------------------------------------------
# Flags: every number in its range, one line before anything loads

@pytest.mark.parametrize("flag,value,message", [("-t", "-1", "-t -1 is out of range"), ("-t", "0", "-t 0 is out"),
                                                ("--min-p", "5", "--min-p 5.0 is out of range"),
                                                ("--repeat-penalty", "0", "--repeat-penalty 0.0 is out of range"),
                                                ("--temp", "nan", "--temp nan is out of range"),
                                                ("--temp", "-1", "--temp -1.0 is out of range"),
                                                ("--top-p", "inf", "--top-p inf is out of range"),
                                                ("-c", "-5", "-c -5 is out of range"),
                                                ("-n", "-7", "-n -7 is out of range")])
def test_flags_out_of_range_are_one_line(flag, value, message):
    assert_one_line_error(cli("generate", "-m", str(STORIES), "-p", "hi", flag, value), message)
    assert_one_line_error(cli("chat", "-m", str(STORIES), flag, value, stdin=b""), message)
    assert_one_line_error(cli("serve", "-m", str(STORIES), "--port", "0", flag, value), message)


def test_a_tiny_temperature_is_greedy():
    """--temp 1e-310 passed the range check and the sampler divided the logits into inf - inf = NaN: a traceback."""
    import json
    runs = [cli("generate", "-m", str(STORIES), "-p", "Once", "-n", "12", "--ignore-eos", "--json", "--temp", t)
            for t in ("1e-310", "0")]
    assert [r.returncode for r in runs] == [0, 0], runs[0].stderr.decode()
    tiny, greedy = (json.loads(r.stdout.decode().splitlines()[-1]) for r in runs)
    assert tiny["tokens"] == greedy["tokens"] and len(tiny["tokens"]) == 12


def test_a_context_larger_than_memory_is_one_line(tmp_path):
    """A config claiming 10^9 positions lets -c 3*10^8 past the model's maximum: its KV cache would be 179 GiB."""
    import json
    m = copy_model(tmp_path)
    cfg = json.loads((m / "config.json").read_text())
    cfg["max_position_embeddings"] = 10**9
    (m / "config.json").write_text(json.dumps(cfg))
    assert_one_line_error(cli("generate", "-m", str(m), "-p", "hi", "-n", "2", "-c", str(3 * 10**8)),
                          "GiB of KV cache, more than this machine's")


# ----------------------------------------------------------------------------------------------------------------------
# Prompts and corpora: read to what a context (or --tokens) can need, never whole

# Between pytest and the CLI: a child forked from pytest itself would start with pytest's RSS as its high-water mark
# (the kernel keeps it across exec), so a small process runs the CLI and writes its RUSAGE_CHILDREN peak (KiB).
MEASURED = ("import resource, subprocess, sys\n"
            "resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))\n"
            "try:\n    code = subprocess.run(sys.argv[2:], timeout=300).returncode\n"
            "except subprocess.TimeoutExpired:\n    code = -9\n"
            "open(sys.argv[1], 'w').write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))\n"
            "sys.exit(code)\n")


def run_measured(*args, stdin=None):
    """(CompletedProcess, peak RSS in MiB) of the CLI: the kernel's high-water mark of its process, run under an
    address-space cap (ulimit -v 4 GiB) so that a reader growing without bound fails, not the machine; a CLI that
    hangs is killed after 300 s."""
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        peak = Path(d) / "peak"
        r = subprocess.run([sys.executable, "-c", MEASURED, str(peak), sys.executable, "-m", "flashinfer_lite", *args],
                           stdin=stdin or subprocess.DEVNULL, capture_output=True, timeout=600)
        return r, int(peak.read_text()) / 1024


def assert_ends_in_one_error(r, *fragments):
    """Exit 1, no traceback, the last line of stderr the error (--dram-budget prints its table before it)."""
    err = r.stderr.decode("utf-8", "replace").strip()
    assert r.returncode == 1 and "Traceback" not in err, err
    assert err.splitlines()[-1].startswith("error: ") and all(f in err.splitlines()[-1] for f in fragments), err


def words_file(path: Path, n_bytes: int) -> Path:
    """Text of short words (as probe 02 writes it): about a token per 4 bytes for stories260K."""
    import random
    w = "the cat sat on a mat and then ran away".split()
    rnd = random.Random(1)
    path.write_text(" ".join(rnd.choice(w) for _ in range(n_bytes // 3))[:n_bytes])
    return path


@pytest.mark.parametrize("n_bytes", [10_000_000, (1 << 20) - 1])
def test_a_long_prompt_file_is_refused_within_the_budget(tmp_path, n_bytes):
    """10 MB (over the cap: refused from its size) and just under 1 MiB (under it: refused by its first pieces'
    tokens) against -c 256 --dram-budget 250M: the whole was read and tokenized first, peaking at 1.3 GiB."""
    r, peak = run_measured("generate", "-m", str(STORIES), "-f", str(words_file(tmp_path / "p.txt", n_bytes)), "-n",
                           "2", "-c", "256", "--dram-budget", "250M")
    assert_ends_in_one_error(r, "raise -c or shorten the prompt")
    assert peak < 250, peak


def test_endless_prompts_are_refused_within_the_budget():
    """-f /dev/zero and -p - from an endless pipe grew until the OOM killer."""
    r, peak = run_measured("generate", "-m", str(STORIES), "-f", "/dev/zero", "-c", "256", "--dram-budget", "250M")
    assert_ends_in_one_error(r, "prompt file /dev/zero is over", "more than a context of 256 tokens can hold")
    assert peak < 250, peak
    yes = subprocess.Popen(["yes", "the cat sat"], stdout=subprocess.PIPE)
    try:
        r, peak = run_measured("generate", "-m", str(STORIES), "-p", "-", "-c", "256", "--dram-budget", "250M",
                               stdin=yes.stdout)
    finally:
        yes.kill()
        yes.wait()
    assert_ends_in_one_error(r, "the prompt on standard input is over")
    assert peak < 250, peak


def test_collect_reads_an_endless_corpus_only_as_far_as_its_tokens(tmp_path):
    """collect --corpus /dev/zero grew until the OOM killer; it needs --tokens' worth of text."""
    r, peak = run_measured("collect", "-m", str(STORIES), "--corpus", "/dev/zero", "--tokens", "512", "-o",
                           str(tmp_path / "acts"))
    assert r.returncode == 0, r.stderr.decode()
    assert peak < 500, peak
    from predictors.acts import Acts
    assert Acts(tmp_path / "acts").tokens == 512


# ----------------------------------------------------------------------------------------------------------------------
# Interruption: Ctrl-C and SIGKILL during first-use training, real signals to real processes

# The parent side of first-use training exactly as `generate` runs it (generate.train_on_first_use), with cli's exits.
PARENT = ("import sys\n"
          "from storage.errors import Reported\n"
          "from flashinfer_lite.runtime import train_on_first_use\n"
          "try:\n    train_on_first_use(sys.argv[1])\n"
          "except KeyboardInterrupt:\n    sys.exit(130)\n"
          "except Reported as e:\n    sys.exit(e.code)\n")


def start_first_use(d: Path) -> subprocess.Popen:
    env = dict(os.environ, FLASHINFER_LITE_CORPUS="builtin")
    import signal
    # its own process group, as a terminal's job; SIGINT as a terminal's job has it, even when this suite runs in the
    # background of a script, which ignores SIGINT (an ignored SIGINT stays ignored through exec)
    return subprocess.Popen([sys.executable, "-c", PARENT, str(d)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=env, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def running(pid: int) -> bool:
    """A process that exists and is not a zombie waiting for a reaper."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def wait_for(cond, timeout: float, what: str):
    import time
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = cond()
        if got:
            return got
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}")


def training_child(d: Path, parent: subprocess.Popen) -> int:
    """The pid of the training child, once its .NAME.calibrate-PID directory exists (training is under way)."""
    def found():
        assert parent.poll() is None, parent.stderr.read().decode()
        hits = [p for p in d.parent.iterdir() if ".calibrate-" in p.name]
        return int(hits[0].name.rsplit("-", 1)[1]) if hits else None
    return wait_for(found, 240, "first-use training to start")


def assert_nothing_left(d: Path, child: int):
    wait_for(lambda: not running(child), 60, "the training child to end")
    assert [p.name for p in d.parent.iterdir() if ".calibrate-" in p.name] == []
    assert sorted(p.name for p in d.iterdir() if p.name.startswith(".") and "-" in p.name) == []
    assert not (d / "predictors").exists()


def stopped_first_use(flash, tmp_path) -> tuple[Path, subprocess.Popen, int]:
    """(FLASHDIR, parent, training child) of a first use whose training child was stopped (SIGSTOP) mid-training,
    started over (up to 3 times) when the child had finished between the poll that found it and the stop."""
    import signal
    for attempt in range(3):
        d = copy_flash(flash, tmp_path / str(attempt))
        parent = start_first_use(d)
        child = training_child(d, parent)
        os.kill(child, signal.SIGSTOP)
        # the stop is delivered asynchronously: only a stopped child cannot write its predictors after the check
        wait_for(lambda: not running(child) or stopped(child), 60, "the training child to stop")
        if not (d / "predictors").exists():
            return d, parent, child
        os.kill(child, signal.SIGCONT)
        parent.communicate(timeout=120)
    pytest.fail("the training child finished before it could be stopped, 3 times")


def signal_pending(pid: int, sig: int) -> bool:
    """sig is pending for process pid (sent to it, not yet delivered: it is stopped)."""
    status = Path(f"/proc/{pid}/status").read_text()
    masks = [int(ln.split()[1], 16) for ln in status.splitlines() if ln.startswith(("SigPnd:", "ShdPnd:"))]
    return any(m >> (sig - 1) & 1 for m in masks)


def interrupted(parent: int, child: int) -> bool:
    """The interrupt waits in the stopped child, and the parent has taken its own: it is no longer blocked in wait4(2)
    (syscall 61) on the child, but in run_child's loop that forwards it (for a terminal's Ctrl-C both got one, and
    the child must not be continued before the parent's forwarded copy is on its way)."""
    return signal_pending(child, 2) and Path(f"/proc/{parent}/syscall").read_text().split()[0] != "61"


def stopped(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t")


@pytest.mark.parametrize("to", ["group", "parent"])
def test_ctrl_c_during_first_use_training_leaves_nothing(flash, tmp_path, to):
    """group: the terminal's Ctrl-C reaches parent and child; parent: `kill -INT` to the parent alone (forwarded).
    The child is stopped before the signal, so that it cannot finish training first (on a busy machine it once did,
    and the parent exited 0), and continued once the interrupt waits in it: markers, not a sleep."""
    import signal
    d, parent, child = stopped_first_use(flash, tmp_path)
    (os.killpg if to == "group" else os.kill)(parent.pid, signal.SIGINT)
    wait_for(lambda: interrupted(parent.pid, child), 60, "the interrupt to reach parent and child")
    os.kill(child, signal.SIGCONT)
    assert parent.wait(timeout=120) == 130, parent.stderr.read().decode()
    assert_nothing_left(d, child)


# A child whose interrupt is raised inside a __del__ (Python prints "Exception ignored" and goes on), then publishes.
SWALLOWED = ("import os, signal, sys\n"
             "import numpy as np\n"
             "from storage.errors import child_exit_code\n"
             "from storage.predictor_files import write_predictor_files\n"
             "class Finalized:\n"
             "    def __del__(self):\n"
             "        os.kill(os.getpid(), signal.SIGINT)\n"
             "        for _ in range(10000):    # a backward jump: the handler runs, and raises, in here\n"
             "            pass\n"
             "def work():\n"
             "    Finalized()\n"
             "    print('went on', file=sys.stderr)\n"
             "    write_predictor_files(sys.argv[1], {}, None, {'f': np.zeros(1, np.float32)}, [])\n"
             "sys.exit(child_exit_code(work))\n")


def test_an_interrupt_swallowed_by_a_finalizer_still_stops_the_commit(tmp_path):
    """CI once saw a Ctrl-C'd first use publish its predictors: the child's KeyboardInterrupt had been raised in a
    library's __del__ and dropped there. The rename that publishes checks whether an interrupt came, not whether it
    unwound."""
    r = subprocess.run([sys.executable, "-c", SWALLOWED, str(tmp_path)], capture_output=True)
    err = r.stderr.decode()
    assert "Exception ignored" in err and "went on" in err, err      # the interrupt was swallowed, as in CI
    assert r.returncode == 130, err
    assert list(tmp_path.iterdir()) == []


def test_sigkill_to_the_parent_ends_the_training_child(flash, tmp_path):
    import signal
    # the child stopped while its parent dies, so that it cannot finish first (it trains stories260K in seconds: a
    # cold suite once saw it write its predictors before the SIGKILL); the signal of its parent's death waits for it
    d, parent, child = stopped_first_use(flash, tmp_path)
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait(timeout=30)
    os.kill(child, signal.SIGCONT)
    assert_nothing_left(d, child)          # the child was told (SIGTERM on its parent's death) and cleaned up


def test_two_concurrent_first_uses_train_once(flash, tmp_path):
    d = copy_flash(flash, tmp_path)
    parents = [start_first_use(d) for _ in range(2)]
    errs = [p.communicate(timeout=600)[1].decode() for p in parents]
    assert [p.returncode for p in parents] == [0, 0], errs
    assert sum(e.count("training them once") for e in errs) == 1, errs
    from storage.format import verify
    verify(d, progress=False)


def test_first_use_training_on_a_read_only_flashdir(flash, tmp_path, read_only):
    import shutil
    src = tmp_path / "rw"                       # what read_only shows, read-only
    shutil.copytree(flash, src / "flash")
    d = read_only / "flash"
    p = start_first_use(d)
    _, err = p.communicate(timeout=300)
    assert_one_line_error(subprocess.CompletedProcess([], p.returncode, b"", err), str(d), "Read-only file system")
    assert sorted(p.name for p in (src / "flash").iterdir()) == sorted(p.name for p in flash.iterdir())


def test_first_use_training_onto_a_full_disk(flash, tmp_path):
    """The FLASHDIR fits; the activations collected to train on do not (a tmpfs 256 KiB larger than it)."""
    import shutil
    from storage.files import disk_bytes
    d = tmp_path / "small"
    d.mkdir()
    _root_mount("-t", "tmpfs", "-o", f"size={disk_bytes(flash) + (256 << 10)}", "tmpfs", d)
    try:
        shutil.copytree(flash, d / "flash")
        p = start_first_use(d / "flash")
        _, err = p.communicate(timeout=300)
        assert_one_line_error(subprocess.CompletedProcess([], p.returncode, b"", err), str(d),
                              "No space left on device")
        assert [p.name for p in d.iterdir()] == ["flash"] and leftovers(d) == []
        assert not (d / "flash" / "predictors").exists()
    finally:
        subprocess.run(["umount", d], check=True)


def test_first_use_conversion_onto_a_full_disk(small_disk, monkeypatch):
    monkeypatch.setenv("FLASHINFER_LITE_CACHE", str(small_disk / "cache"))
    r = cli("generate", "-m", str(STORIES), "-p", "hi", "-n", "2", "--ffn", "predicted")
    assert_one_line_error(r, "need ", f"free in {small_disk / 'cache' / 'flash'} ", ", have ")
    assert "converting " not in r.stderr.decode(), r.stderr.decode()      # refused before it is announced
    assert [p.name for p in (small_disk / "cache" / "flash").iterdir() if not p.name.endswith(".lock")] == []


def test_an_edited_flashdir_manifest_is_refused(flash, tmp_path):
    """norm_eps 1e-5 -> 1e-6 in the manifest's config: a valid model, not this one."""
    d = copy_flash(flash, tmp_path)
    text = (d / "manifest.json").read_text()
    assert '"norm_eps": 1e-05' in text
    (d / "manifest.json").write_text(text.replace('"norm_eps": 1e-05', '"norm_eps": 1e-06'))
    for args in (("verify", str(d)), ("generate", "-m", str(d), "-p", "Once", "-n", "2", "--ffn", "dense")):
        assert_one_line_error(cli(*args), "manifest.json: checksum mismatch")


# ----------------------------------------------------------------------------------------------------------------------
# Header fields bounded before a loop uses them; token ids in the vocabulary; a GGUF's merges (issue 41)

def capped(*args):
    """cli(*args) in at most 4 GiB of address space: an unbounded header field fails fast, not by filling RAM."""
    import resource
    env = dict(os.environ, PYTHONIOENCODING="utf-8")
    return subprocess.run([sys.executable, "-m", "flashinfer_lite", *args], capture_output=True, env=env,
                          timeout=300, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30)))


def _gguf_field(key: str, value, kind: str):
    def edit(w):
        import gguf
        w.add_key_value(key, value, getattr(gguf.GGUFValueType, kind))
    return edit


def _gpt2_merges(merges):
    def edit(w):
        w.add_tokenizer_model("gpt2")
        w.add_token_merges(merges)
    return edit


HOSTILE_GGUF = {    # the edit, and what its one line says
    "block_count=2**32-1": (_gguf_field("llama.block_count", 2**32 - 1, "UINT32"),
                            "llama.block_count is 4294967295, more than the file's"),
    "eos=-3 (int32)": (_gguf_field("tokenizer.ggml.eos_token_id", -3, "INT32"), "eos token id -3 outside"),
    "eos=512": (_gguf_field("tokenizer.ggml.eos_token_id", 512, "UINT32"), "eos token id 512 outside"),
    "bos=600": (_gguf_field("tokenizer.ggml.bos_token_id", 600, "UINT32"), "bos token id 600 outside"),
    "eot=-1 (int32)": (_gguf_field("tokenizer.ggml.eot_token_id", -1, "INT32"), "tokenizer.ggml.eot_token_id -1"),
    "merges=['nospace']": (_gpt2_merges(["nospace"]), "tokenizer.ggml.merges entry 0 is not two tokens"),
}


@pytest.mark.parametrize("case", list(HOSTILE_GGUF))
def test_a_gguf_with_a_hostile_header_field_is_one_line(case, tmp_path):
    from conftest import write_llama_gguf
    from storage.checkpoint import HFCheckpoint
    edit, says = HOSTILE_GGUF[case]
    path = write_llama_gguf(HFCheckpoint(STORIES), tmp_path / "m.gguf", edit=edit)
    assert_one_line_error(capped("generate", "-m", str(path), "-p", "Once", "-n", "2", "--ffn", "dense"), says)


@pytest.mark.parametrize("eos_ids, says", [([-3], "eos token id -3 outside"), ([2, 512], "eos token id 512 outside"),
                                           (7, "eos_ids must be a list")])
def test_a_manifest_eos_id_outside_the_vocabulary_is_one_line(flash, tmp_path, eos_ids, says):
    d = copy_flash(flash, tmp_path)
    edit_manifest(d, lambda m: m["config"].update(eos_ids=eos_ids))
    for args in (("verify", str(d)), ("generate", "-m", str(d), "-p", "Once", "-n", "2", "--ffn", "dense")):
        assert_one_line_error(cli(*args), says)


@pytest.mark.parametrize("field, value, says", [
    ("n_layers", 2**32 - 1, "disagrees with the 5 layers"),
    ("vocab_size", 2**40, "tensor embed.weight has shape [512, 64]"),
    ("n_experts", 2**31, "config has 2147483648 experts, the manifest none")])
def test_a_manifest_count_the_files_do_not_hold_is_one_line(flash, tmp_path, field, value, says):
    d = copy_flash(flash, tmp_path)
    edit_manifest(d, lambda m: m["config"].update({field: value, "n_experts_used": 1} if field == "n_experts"
                                                  else {field: value}))
    assert_one_line_error(capped("generate", "-m", str(d), "-p", "Once", "-n", "2", "--ffn", "dense"), says)
