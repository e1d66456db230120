"""The user cache is keyed by content (issue 15): moving the cache or touching the source finds the same conversion,
a changed byte makes a new one, `flashinfer-lite cache` lists and removes; killed writers' temp dirs are removed by the
next run (real processes, real SIGKILL)."""
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import STORIES
from storage.errors import UserError
from storage import cache
from storage.files import remove_stale_temp_dirs


def run(*args, env=None, **kw):
    return subprocess.run([sys.executable, "-m", "flashinfer_lite", *args], capture_output=True, text=True,
                          timeout=300, env=env, **kw)


@pytest.fixture
def model_and_cache(tmp_path, monkeypatch):
    src = shutil.copytree(STORIES, tmp_path / "stories")
    monkeypatch.setenv("FLASHINFER_LITE_CACHE", str(tmp_path / "cache"))
    return src, tmp_path / "cache"


def test_key_follows_content_not_path_or_time(model_and_cache, tmp_path, monkeypatch):
    src, root = model_and_cache
    first = cache.flashdir_for(src, progress=False)
    manifest = os.path.join(first, "manifest.json")
    made = os.stat(manifest).st_mtime_ns
    os.utime(src / "model.safetensors")                                 # touched: same bytes
    assert cache.flashdir_for(src, progress=False) == first and os.stat(manifest).st_mtime_ns == made
    moved = shutil.move(str(src), tmp_path / "elsewhere")              # the model moved
    assert cache.flashdir_for(moved, progress=False) == first
    shutil.move(str(root), tmp_path / "cache2")                        # the cache moved
    monkeypatch.setenv("FLASHINFER_LITE_CACHE", str(tmp_path / "cache2"))
    again = cache.flashdir_for(moved, progress=False)
    assert os.path.basename(again) == os.path.basename(first) and os.stat(os.path.join(again, "manifest.json")
                                                                          ).st_mtime_ns == made
    cfg = tmp_path / "elsewhere" / "generation_config.json"            # one byte of content changed
    cfg.chmod(0o644)
    cfg.write_text(cfg.read_text() + " ")
    assert os.path.basename(cache.flashdir_for(moved, progress=False)) != os.path.basename(first)


def test_a_conversion_of_another_dtype_is_not_reused(model_and_cache):
    """A cache made when convert's default gave another dtype (first uses before q4_1 made float16 FLASHDIRs, under a
    name without the dtype) is left alone: the first use converts anew, in the dtype convert's default gives now."""
    from storage.convert import convert
    from storage.format import FORMAT_VERSION, read_layout
    src, root = model_and_cache
    stale = root / "flash" / f"stories-{cache.source_key(src)}"
    convert(src, stale, dtype="q8_0", progress=False)
    made = cache.flashdir_for(src, progress=False)
    auto = read_layout(made).dtype
    parts = "-parts" if not read_layout(made).bundled else ""      # SiLU: the split layout alone is in the key
    assert os.path.basename(made) == f"stories-{cache.source_key(src)}-{auto}{parts}-v{FORMAT_VERSION}"
    assert auto != "q8_0"
    assert read_layout(stale).dtype == "q8_0"                          # untouched, listed by `flashinfer-lite cache`


def test_cache_command_lists_and_removes(model_and_cache):
    src, root = model_and_cache
    env = dict(os.environ)
    made = cache.flashdir_for(src, progress=False)
    r = run("cache", env=env)
    assert r.returncode == 0, r.stderr
    name = os.path.basename(made)
    assert name in r.stdout and f"from {src.resolve()}" in r.stdout and "1 entries" in r.stdout
    r = run("cache", "rm", "no-such-entry", env=env)
    assert r.returncode == 1 and r.stderr.startswith("error: nothing named 'no-such-entry'")
    r = run("cache", "rm", name, env=env)
    assert r.returncode == 0 and "removed 1 entries" in r.stdout and not os.path.exists(made)
    assert "0 entries" in run("cache", env=env).stdout
    with pytest.raises(UserError):
        cache.remove(name)


KILLABLE_CONVERT = """
import sys, time
from storage import convert as c
real = c.write_flashdir
def slow(ckpt, layout, tmp, progress):
    real(ckpt, layout, tmp, progress)
    print("written", flush=True)
    time.sleep(600)
c.write_flashdir = slow
c.convert(sys.argv[1], sys.argv[2], progress=False)
"""


def test_sigkill_during_convert_leaves_a_temp_dir_the_next_run_removes(tmp_path):
    out = tmp_path / "out" / "m.flash"
    p = subprocess.Popen([sys.executable, "-c", KILLABLE_CONVERT, str(STORIES), str(out)], stdout=subprocess.PIPE,
                         text=True, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert p.stdout.readline().strip() == "written"
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    left = [x.name for x in out.parent.iterdir()]
    assert left == [f".m.flash.tmp-{p.pid}"] and not out.exists()      # nothing a later run would trust
    r = run("convert", str(STORIES), "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert sorted(x.name for x in out.parent.iterdir()) == ["m.flash"]
    # a live process's temp dir is never touched
    live = out.parent / f".x.tmp-{os.getppid()}"                       # pytest's parent: alive
    live.mkdir()
    assert remove_stale_temp_dirs(out.parent) == [] and live.exists()


def test_cache_lists_and_removes_a_killed_conversion_never_a_running_one(model_and_cache):
    """A conversion into the cache killed by SIGKILL (the OOM killer) leaves .NAME.tmp-PID with its bytes: `cache
    list` shows it with its size, as a leftover, and `cache rm --all` removes it; a conversion whose process still
    runs is listed as being written and removed by neither `cache rm NAME` nor `cache rm --all`."""
    src, root = model_and_cache
    env = dict(os.environ)
    dest = root / "flash" / "stories-0123456789abcdef-f16-parts"
    p = subprocess.Popen([sys.executable, "-c", KILLABLE_CONVERT, str(src), str(dest)], stdout=subprocess.PIPE,
                         text=True, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert p.stdout.readline().strip() == "written"
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    left = root / "flash" / f".{dest.name}.tmp-{p.pid}"
    size = sum(f.stat().st_size for f in left.rglob("*") if f.is_file())
    assert left.is_dir() and size > 100_000
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        busy = root / "flash" / f".other.tmp-{alive.pid}"
        busy.mkdir()
        (busy / "ffn.bin").write_bytes(bytes(8192))
        r = run("cache", "list", env=env)
        assert r.returncode == 0, r.stderr
        lines = {ln.split()[3]: ln for ln in r.stdout.splitlines()[1:-1]}
        assert lines[left.name].split()[:3] == [f"{size / 2**20:.1f}", "MiB", "leftover"], r.stdout
        assert f"process {p.pid}" in lines[left.name] and "writing" in lines[busy.name].split(), r.stdout
        r = run("cache", "rm", busy.name, env=env)
        assert r.returncode == 1 and r.stderr.startswith("error: ") and f"process {alive.pid}" in r.stderr, r.stderr
        r = run("cache", "rm", "--all", env=env)
        assert r.returncode == 0 and "removed 1 entries" in r.stdout and "1 being written" in r.stdout, r.stdout
        assert not left.exists() and (busy / "ffn.bin").stat().st_size == 8192
    finally:
        alive.kill()
        alive.wait()


def test_stale_calibrate_dir_of_a_killed_first_use_is_removed(tmp_path):
    """A first use killed mid-training leaves .NAME.calibrate-PID; the next first use in that directory removes it."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    stale = tmp_path / f".m-abc.calibrate-{p.pid}"
    (stale / "acts").mkdir(parents=True)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    time.sleep(0.1)
    assert remove_stale_temp_dirs(tmp_path) == [stale] and not stale.exists()


def test_first_use_conversion_of_a_corrupt_model_is_one_line_and_leaves_nothing(model_and_cache):
    """A truncated model met by a sparse run's first-use conversion: one line on stderr, exit 1, and no FLASHDIR or
    temp dir stays in the cache."""
    src, root = model_and_cache
    weights = src / "model.safetensors"
    weights.chmod(0o644)
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    r = run("generate", "-m", str(src), "--ffn", "predicted", "-p", "Once", "-n", "2")
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith("error: truncated safetensors file")
    assert not (root / "flash").exists() or [p.name for p in (root / "flash").iterdir()] == []


def test_the_conversion_child_reports_one_line(tmp_path, capfd):
    """`python -m storage.cache` (the child convert_in_child runs) turns a bad source into one line and exit 1."""
    from storage.errors import Reported
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 60)
    with pytest.raises(Reported) as e:
        cache.convert_in_child(bad, tmp_path / "out", progress=False)
    err = capfd.readouterr().err
    assert e.value.code == 1 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf"]


def test_first_use_announces_what_it_writes_what_follows_and_how_long(model_and_cache):
    """Before a first use converts, one line: what it writes where and how many bytes (convert's estimate: the written
    directory holds no more), that the exact gate's calibration follows, and roughly how long both take. The next run
    converts nothing and announces nothing."""
    import re
    from storage.files import disk_bytes
    from storage.gate_file import GATE_FILE
    src, c = model_and_cache
    r = run("generate", "-m", str(src), "-p", "Once", "-n", "2", "--ffn", "gate")
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("converting ")]
    made = next((c / "flash").glob("stories*"))
    assert len(lines) == 1, r.stderr
    m = re.fullmatch(rf"converting stories into the flash layout at {re.escape(str(made))} \((\d+\.\d) MB, first "
                     rf"use\), then calibrating the exact gate's thresholds on 1,024 tokens: under a minute", lines[0])
    assert m, lines[0]
    written = disk_bytes(made) - (made / GATE_FILE).stat().st_size
    assert written <= float(m.group(1)) * 1e6 + 0.05e6, (written, lines[0])
    r = run("generate", "-m", str(src), "-p", "Once", "-n", "2", "--ffn", "gate")
    assert r.returncode == 0 and "converting" not in r.stderr and "calibrating" not in r.stderr, r.stderr


def test_a_warm_load_finds_the_default_models_files_without_its_first_use_steps(model_and_cache, monkeypatch):
    """runtime.located: once a first use fetched and converted the default model (here stories260K), a load finds
    its file and the conversion from the digest the cache remembers with the files' sizes, mtimes and inodes: no
    fetch or sha256 check (runtime.prepare_files); a file touched since is a first use's work again, which finds
    the same conversion (its content did not change)."""
    from flashinfer_lite import runtime
    src, _ = model_and_cache
    prepared = []
    monkeypatch.setattr(runtime, "default_model_path", lambda: src)
    monkeypatch.setattr(runtime, "ensure_default_model", lambda quiet=False: prepared.append(src) or src)
    assert runtime.located(None, True) is None                      # nothing converted yet: a first use
    source, path = runtime.prepare_files(None, "dense", True, progress=False)
    assert prepared == [src] and source == str(src) and cache.is_flashdir(path)
    assert runtime.located(None, True) == (str(src), path)          # warm: nothing fetched, checked or converted
    assert prepared == [src] and runtime.located(None, False) is None   # a dense run of its file: its stamp checked
    config = src / "config.json"
    st = config.stat()
    os.utime(config, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert runtime.located(None, True) is None                      # touched: the digest no longer vouches for it
    assert runtime.prepare_files(None, "dense", True, progress=False) == (str(src), path)
