"""flash-bench: the profile it derives follows the cost model, the run cleans up, and BundleReader picks it up."""
from __future__ import annotations

import argparse
import csv
import json

import pytest

from flash_fixtures import write_random_flashdir
from storage.errors import UserError
from storage import flash_bench
from storage.profile import (DEFAULT_DEPTH, DEFAULT_ENGINE, DEFAULT_GAP_BYTES, DEFAULT_THREADS, reader_defaults,
                             stream_defaults)
from storage.reader import BundleReader

CHUNKS = [4096, 16384, 65536, 262144, 1 << 20]


def rows_from(iops_of, threads=(1, 4, 16)):
    return [{"chunk": c, "threads": t, "IOPS": iops_of(c, t), "MBps": iops_of(c, t) * c / 1e6} for c in CHUNKS
            for t in threads]


def test_latency_bound_device_reads_through_wide_gaps():
    # Every request up to the largest measured chunk costs the same: reading through is free up to there.
    prof = flash_bench.derive_profile(rows_from(lambda c, t: 1000.0 * min(t, 4)))
    assert all(e["gap_bytes"] >= 64 * e["chunk"] for e in prof if e["chunk"] <= 16384)
    assert all(e["threads"] == 4 for e in prof)           # fewest threads within 5% of the best


def test_bandwidth_bound_device_never_reads_through():
    # Time is proportional to bytes: reading a gap only adds time, so no gap pays off.
    prof = flash_bench.derive_profile(rows_from(lambda c, t: 1e9 / c))
    assert [e["gap_bytes"] for e in prof] == [0] * len(CHUNKS)


def test_mixed_device_gap_matches_the_cost_model():
    # time(s) = 100 us + s / 1 GB/s: merging pays while 100us + (2c+g)/1e9 <= 2 (100us + c/1e9), i.e. g <= 100 KB.
    # Between measured chunks the profile interpolates in log2(size), so check the rule at the measured points only.
    prof = flash_bench.derive_profile(rows_from(lambda c, t: 1.0 / (100e-6 + c / 1e9)))
    e4k = next(e for e in prof if e["chunk"] == 4096)
    assert 0 < e4k["gap_bytes"] <= 100_000 and e4k["gap_bytes"] % 4096 == 0
    assert next(e for e in prof if e["chunk"] == 1 << 20)["gap_bytes"] == 0


def test_profile_picks_the_engine_and_depth_that_reach_the_rate_at_least_cpu():
    # Threads top out at 4 in flight; the ring reaches 1.5x that from depth 32 on, at a fifth of the CPU per byte.
    threads = [{"chunk": c, "engine": "threads", "threads": t, "depth": 0, "IOPS": 1000.0 * min(t, 4),
                "cpu_s_per_GB": 5.0} for c in CHUNKS for t in (1, 4, 16)]
    ring = [{"chunk": c, "engine": "io_uring", "threads": 0, "depth": d, "IOPS": 6000.0 * min(d, 32) / 32,
             "cpu_s_per_GB": 1.0 + d / 1000} for c in CHUNKS for d in (8, 32, 128)]
    for r in threads + ring:
        r["MBps"] = r["IOPS"] * r["chunk"] / 1e6
    prof = flash_bench.derive_profile(threads + ring)
    assert {(e["engine"], e["depth"], e["threads"]) for e in prof} == {("io_uring", 32, 4)}
    # Old rows (no engine, no CPU) still give the thread engine's profile.
    assert {e["engine"] for e in flash_bench.derive_profile(rows_from(lambda c, t: 1000.0 * t))} == {"threads"}


def run_bench(argv: list[str]) -> None:
    """flash-bench with these arguments, to a zero exit; skipped where the filesystem refuses O_DIRECT."""
    p = argparse.ArgumentParser()
    flash_bench.add_arguments(p)
    try:
        assert flash_bench.run(p.parse_args(argv)) == 0
    except UserError as e:
        if "O_DIRECT is refused" in str(e):
            pytest.skip(str(e))
        raise


def test_tiny_run_writes_results_and_a_profile_the_reader_uses(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FLASHINFER_LITE_CACHE", str(tmp_path / "cache"))
    flashdir = tmp_path / "model"
    write_random_flashdir(flashdir, "f16", d=200, n=64, n_layers=2)   # stride 1536 bytes
    work = tmp_path / "work"
    work.mkdir()
    run_bench(["--dir", str(work), "--size", "2MiB", "--chunks", "1K,64K", "--threads", "1,2", "--depths", "4",
               "--seconds", "0.05", "-m", str(flashdir), "--out", str(tmp_path / "out")])
    assert list(work.iterdir()) == []                                   # scratch file removed
    rows = list(csv.DictReader(open(tmp_path / "out" / "flash_bench.csv")))
    ring = flash_bench.ring_refused() == ""
    assert {(int(r["chunk"]), r["engine"], int(r["threads"]), int(r["depth"])) for r in rows} == \
        {(c, "threads", t, 0) for c in (1024, 65536) for t in (1, 2)} | \
        ({(c, "io_uring", 0, 4) for c in (1024, 65536)} if ring else set())
    assert all(float(r["cpu_s_per_GB"]) > 0 for r in rows)
    result = json.loads((tmp_path / "out" / "flash_bench.json").read_text())
    assert len(result["model"]["reads"]) == 8
    entry = next(e for e in result["profile"] if e["chunk"] == 1024)
    # The reader on the same device now defaults to the profile of the nearest chunk size (1 KiB for 1.5 KiB bundles).
    assert reader_defaults(flashdir / "ffn.bin", 1536)[:2] == (entry["threads"], entry["gap_bytes"])
    with BundleReader(flashdir) as r:
        assert (r.threads, r.coalesce_gap, r.engine) == (entry["threads"], entry["gap_bytes"] // 1536, entry["engine"])
        assert entry["engine"] == "threads" or r.describe().startswith(f"reader: io_uring, {entry['depth']} reads")
    # the streams measured sequential reads of the scratch file, and the exact gate's streams now use their pick
    assert {(r["chunk"], r["depth"]) for r in result["streams"]} == {(c, d) for c in (1 << 20, 2 << 20)
                                                                     for d in (1, 2, 4, 8)}
    assert all(r["MBps"] > 0 for r in result["streams"])
    st = stream_defaults(flashdir / "ffn.bin")
    assert (st.chunk_bytes, st.depth) == (result["stream"]["chunk"], result["stream"]["depth"])
    assert st.source.startswith("flash-bench profile")
    assert "device profile saved" in capsys.readouterr().out
    assert r.settings_source.startswith(f"flash-bench profile of {work.resolve()} from ")
    # a --quick smoke run afterwards leaves that profile alone (it once moved the reader from 8 threads to 4)
    saved = (tmp_path / "cache" / "device_profile.json").read_bytes()
    run_bench(["--dir", str(work), "--quick", "--out", str(tmp_path / "out_quick")])
    assert "the device profile is left as it was" in capsys.readouterr().out
    assert (tmp_path / "cache" / "device_profile.json").read_bytes() == saved
    assert reader_defaults(flashdir / "ffn.bin", 1536)[:2] == (entry["threads"], entry["gap_bytes"])


def test_scratch_file_removed_on_interrupt(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHINFER_LITE_CACHE", str(tmp_path / "cache"))

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(flash_bench, "bench_grid", interrupted)
    p = argparse.ArgumentParser()
    flash_bench.add_arguments(p)
    with pytest.raises(KeyboardInterrupt):
        flash_bench.run(p.parse_args(["--dir", str(tmp_path), "--size", "1MiB", "--chunks", "4K", "--threads", "1",
                                      "--out", str(tmp_path / "out")]))
    assert not list(tmp_path.glob(".flashinfer-lite-bench-*"))


def test_without_profile_reader_uses_builtin_defaults(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHINFER_LITE_CACHE", str(tmp_path / "empty"))
    assert reader_defaults(tmp_path, 4096) == (DEFAULT_THREADS, DEFAULT_GAP_BYTES, DEFAULT_ENGINE, DEFAULT_DEPTH,
                                             "built-in defaults (no flash-bench profile of this device)")
    assert stream_defaults(tmp_path).source == "built-in defaults"


@pytest.mark.parametrize("argv, message", [
    (["--chunks", "1000"], "multiples of 512"),
    (["--threads", "a"], "comma-separated"),
    (["--size", "lots"], "cannot parse size"),
])
def test_bad_arguments(tmp_path, argv, message):
    p = argparse.ArgumentParser()
    flash_bench.add_arguments(p)
    with pytest.raises(UserError, match=message):
        flash_bench.run(p.parse_args(["--dir", str(tmp_path)] + argv))


def test_a_profile_from_before_queue_depth_keeps_its_threads_for_the_fallback(tmp_path, monkeypatch):
    from storage.profile import save_profile
    monkeypatch.setenv("FLASHINFER_LITE_CACHE", str(tmp_path / "cache"))
    save_profile(tmp_path, {"dir": str(tmp_path), "created": "2026-11-01T00:00:00",
                            "entries": [{"chunk": 4096, "threads": 16, "gap_bytes": 8192}]})
    s = reader_defaults(tmp_path, 4096)
    assert (s.threads, s.gap_bytes, s.engine, s.depth) == (16, 8192, DEFAULT_ENGINE, DEFAULT_DEPTH)


def test_a_mixture_of_experts_model_reads_its_expert_chunks(tmp_path, monkeypatch, tiny_model):
    """-m with a mixture of experts' FLASHDIR (no neuron bundles): random whole expert chunks, every probe of
    expert_rate, rather than a stop on an empty neuron list."""
    from storage.convert import convert
    from storage.format import read_layout
    monkeypatch.setenv("FLASHINFER_LITE_CACHE", str(tmp_path / "cache"))
    flash = convert(tiny_model("qwen3moe"), tmp_path / "moe", progress=False)
    run_bench(["--dir", str(tmp_path), "--quick", "-m", str(flash), "--out", str(tmp_path / "out")])
    experts = json.loads((tmp_path / "out" / "flash_bench.json").read_text())["model"]["experts"]
    assert experts["chunk_bytes"] == read_layout(flash).experts.chunk
    assert [(q["chunks"], q["calls"]) for q in experts["probes"]] == list(flash_bench.EXPERT_PROBES)
    assert all(q["MBps"] > 0 for q in experts["probes"])
