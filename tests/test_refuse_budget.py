"""A --dram-budget below what the model can ever run in is refused before any work (runtime.refuse_below_minimum):
its model part is the planner's own minimum on the layout conversion will make, read from the source's header
alone (runtime.model_facts), and a cold first run with a too-small budget fetches, converts, compiles and trains
nothing."""
from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import STORIES
from flashinfer_lite.budget import HEAP_SLACK_BYTES, down_scale_bytes, plan_budget, resident_bytes_for, stream_args
from flashinfer_lite.modes import head_sizes_of, minimum_bytes, plan_in_ram
from flashinfer_lite.kernels.blocks import COLUMN_SCALES_F16
from flashinfer_lite.runtime import model_facts
from storage.convert import convert
from storage.errors import UserError
from storage.format import FlashCheckpoint

REPO = Path(__file__).resolve().parents[1]


def planner_minimum(flashdir: Path, ctx: int, ffn: str) -> int:
    """The smallest budget decide() accepts for --ffn predicted (or auto: the in-RAM plan's when smaller), with the
    process base left out (0), computed from the converted FLASHDIR as the predicted and dense modes plan it."""
    ckpt = FlashCheckpoint(flashdir)
    cfg, layout = ckpt.config, ckpt.layout
    # the embeddings on flash, the head streamed when that takes less DRAM (budget.place_head)
    resident = resident_bytes_for(cfg, half=layout.dtype != "f32", kinds=ckpt.resident_kinds, on_flash=True) + \
        down_scale_bytes(layout, COLUMN_SCALES_F16) + head_sizes_of(cfg, layout, ckpt.resident_kinds, ctx).minimum_bytes
    sparse = plan_budget(cfg, layout, 1 << 60, ctx, resident_bytes=resident, **stream_args(layout),
                         heap_slack_bytes=HEAP_SLACK_BYTES).minimum_bytes
    in_ram = plan_in_ram(cfg, layout, ckpt.resident_kinds, None, ctx, 0, HEAP_SLACK_BYTES).minimum_bytes
    return sparse if ffn == "predicted" else min(sparse, in_ram)


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_model, smollm2_gguf):
    """(the paths a user may name, the FLASHDIR they run) for two HF models converted as on first use, a float32
    FLASHDIR (convert --dtype f32: named as itself only) and a q4_1 GGUF."""
    from storage.cache import flashdir_for
    root = tmp_path_factory.mktemp("refuse")
    llama = tiny_model("llama-bias-untied")
    made = [convert(m, root / m.name, progress=False) for m in (STORIES, llama)]
    f32 = convert(llama, root / "llama-f32", dtype="f32", progress=False)
    gguf = Path(flashdir_for(smollm2_gguf, progress=False))
    return [((STORIES, made[0]), made[0]), ((llama, made[1]), made[1]), ((f32,), f32), ((smollm2_gguf, gguf), gguf)]


def test_the_model_part_is_the_planners_minimum_from_the_header_alone(models):
    """model_facts of a source (its header or config.json; the conversion not made) gives the layout and resident
    kinds the conversion makes, so the estimate's model part is the planner's minimum of the converted model."""
    for paths, flashdir in models:
        ckpt = FlashCheckpoint(flashdir)
        for path in paths:
            cfg, layout, kinds = model_facts(str(path))
            assert cfg == ckpt.config and kinds == ckpt.resident_kinds, path
            assert (layout.dtype, layout.down_dtype, layout.stride, layout.n_neurons, layout.offset) == \
                (ckpt.layout.dtype, ckpt.layout.down_dtype, ckpt.layout.stride, ckpt.layout.n_neurons,
                 ckpt.layout.offset), path
            for ctx in (64, 512):
                early, planner = minimum_bytes(cfg, layout, kinds, "predicted", ctx, 0), \
                    planner_minimum(flashdir, ctx, "predicted")
                assert early == planner, (path, ctx)
                # auto: the smallest of its plans (a SiLU model's exact gate among them), never above the planner's
                early, planner = minimum_bytes(cfg, layout, kinds, "auto", ctx, 0), planner_minimum(flashdir, ctx, "auto")
                assert early <= planner, (path, ctx, early, planner)


def test_the_default_models_facts_before_its_fetch_are_its_headers(smollm2_gguf, tmp_path, monkeypatch):
    """default_model's record of the header (used while the file is not fetched) against the file's header."""
    from flashinfer_lite.runtime import model_facts
    want = model_facts(None, cached=False)                      # the file is in the cache: its header read
    monkeypatch.setenv("FLASHINFER_LITE_CACHE", str(tmp_path))  # an empty cache: the record
    got = model_facts(None)
    assert got[0] == want[0] and got[2] == want[2]
    assert (got[1].dtype, got[1].down_dtype, got[1].stride, got[1].n_neurons, got[1].config) == \
        (want[1].dtype, want[1].down_dtype, want[1].stride, want[1].n_neurons, want[1].config)


@pytest.mark.parametrize("model", ["default", "hf"])
def test_a_too_small_budget_is_refused_before_any_work_on_a_cold_cache(tmp_path, model):
    """An empty model cache (the default model not fetched) and an empty Numba cache: the refusal is one line naming
    the minimum, nothing is fetched, converted or compiled, and the child used under 5 s of CPU (user + system:
    fetching, converting, compiling or training take minutes of it; wall time is the machine's load)."""
    cache, numba = tmp_path / "cache", tmp_path / "numba"
    numba.mkdir()
    env = dict(os.environ, FLASHINFER_LITE_CACHE=str(cache), NUMBA_CACHE_DIR=str(numba),
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    args = ["--ffn", "predicted"] + ([] if model == "default" else ["-m", str(STORIES)])
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "flashinfer_lite", "generate", *args, "-c", "512", "--dram-budget", "50M",
                        "-n", "4", "-p", "Hello"], env=env, capture_output=True, text=True, timeout=300)
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert re.match(r"error: DRAM budget 50\.0 MiB is below the minimum [0-9.]+ MiB for this model \(estimated before loading",
                    lines[0]), r.stderr
    made = [p for p in cache.rglob("*") if p.is_file()] if cache.exists() else []
    assert not made, made                                                       # nothing fetched or converted
    # Numba makes its directories on import, and warmup stamps its kernels' sources there (drop_stale_kernels): no
    # other file
    compiled = [p for p in numba.rglob("*") if p.is_file() and not p.name.startswith("flashinfer-lite-sources-")]
    assert not compiled, compiled                                                     # nothing compiled
    assert cpu < 5, (cpu, wall)


def test_first_use_training_says_how_long_the_layers_left_take(capsys):
    from tqdm import tqdm

    from predictors.first_use import say_time_left
    on_layer = say_time_left(n_layers=5)
    with tqdm(range(5), file=sys.stderr) as bar:
        on_layer({"layer": 0, "dense": True}, bar)              # the dense first layer trains nothing: no pace yet
        assert "layers left" not in capsys.readouterr().err
        on_layer({"layer": 1, "seconds": 30.0}, bar)            # 3 layers left at 30 s each
        on_layer({"layer": 2, "seconds": 90.0}, bar)            # said once
        assert "(~2 min)" in bar.desc
    err = capsys.readouterr().err
    assert err.count("layers left") == 1 and "30 s per layer; the 3 layers left take about 2 min" in err, err


def test_the_gguf_header_reads_what_gguf_reader_reads(smollm2_gguf, tmp_path):
    """storage.checkpoint.GGUFHeader (scalars, array lengths, the tensor table; no array read) against gguf.GGUFReader,
    the format's reference reader; a file cut anywhere in its header is refused with one UserError."""
    import gguf
    from storage.checkpoint import GGUFArray, GGUFHeader
    ref, got = gguf.GGUFReader(str(smollm2_gguf)), GGUFHeader(smollm2_gguf)
    assert {t.name: (t.tensor_type.name, tuple(int(s) for s in t.shape)) for t in ref.tensors} == got.tensors
    fields = {k: f for k, f in ref.fields.items() if not k.startswith("GGUF.")}     # the reader's own: version, counts
    assert set(fields) == set(got.fields)
    for key, field in fields.items():
        value = got.fields[key]
        if isinstance(value, GGUFArray):
            assert len(value) == len(field.data), key
        else:
            assert value == pytest.approx(field.contents()), key
    head = smollm2_gguf.read_bytes()[:4 << 20]          # the metadata and tensor table end before 4 MiB
    for cut in (3, 20, 1000, 500_000, len(head)):
        bad = tmp_path / "cut.gguf"
        bad.write_bytes(head[:cut])
        with pytest.raises(UserError, match="not a valid GGUF file"):
            GGUFHeader(bad)


def test_a_mixture_of_experts_minimum_is_the_planners_from_the_header_alone(tiny_model, tmp_path):
    """A mixture of experts (HF directories of the four kinds: shared experts, q/k norms per head and over all heads;
    a GGUF with Q8_0 experts): model_facts of the source, the conversion not made, gives the expert cache's minimum
    that the converted FLASHDIR's plan (budget.plan_experts in decide_experts) has, less only the resident file's
    safetensors header, and the model's part of the early refusal is that minimum."""
    from moe_gguf import write_moe_gguf
    from flashinfer_lite.runtime import load_runtime
    from test_quant_e2e import resident_data_bytes
    sources = [tiny_model(k) for k in ("qwen2moe", "olmoe", "qwen3moe", "mixtral")]
    sources.append(write_moe_gguf(tiny_model("qwen3moe"), tmp_path / "m.gguf", "qwen3moe", expert_type="Q8_0"))
    for src in sources:
        flash = convert(src, tmp_path / f"{src.name}-flash", progress=False)
        header = (flash / "resident.safetensors").stat().st_size - resident_data_bytes(flash)
        cfg, layout, kinds = model_facts(str(src))
        assert layout.experts.geometry() == FlashCheckpoint(flash).layout.experts.geometry(), src
        for ctx in (64, 128):
            planner = load_runtime(flash, "auto", ctx=ctx, base_bytes=0)[2].plan.minimum_bytes
            for ffn in ("auto", "experts"):
                assert minimum_bytes(cfg, layout, kinds, ffn, ctx, 0) == planner - header, (src, ctx, ffn)


def test_a_too_small_budget_for_a_mixture_of_experts_is_refused_before_conversion(tiny_model, tmp_path):
    """An HF mixture of experts with --ffn experts and a budget below its minimum: one line naming the minimum, and
    nothing converted into the empty model cache (the planner alone would refuse only after converting)."""
    cache = tmp_path / "cache"
    env = dict(os.environ, FLASHINFER_LITE_CACHE=str(cache),
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "flashinfer_lite", "generate", "-m", str(tiny_model("qwen2moe")),
                        "--ffn", "experts", "-c", "64", "--dram-budget", "50M", "-n", "2", "-p", "Hello"],
                       env=env, capture_output=True, text=True, timeout=300)
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(lines) == 1, r.stderr
    assert re.match(r"error: DRAM budget 50\.0 MiB is below the minimum [0-9.]+ MiB for this model \(estimated before loading",
                    lines[0]), r.stderr
    made = [p for p in cache.rglob("*") if p.is_file()] if cache.exists() else []
    assert not made, made


def test_load_runtime_refuses_before_converting_and_names_the_planners_minimum(tmp_path, monkeypatch):
    """load_runtime runs load()'s pipeline: given a budget, --ffn auto on a SiLU-gated HF directory is the exact gate
    from a FLASHDIR (it used to be dense, refusing the budget as needing predictors), and a budget below the minimum is
    refused from the header before anything is converted into the cache (it used to convert first). The refusal's
    minimum (budget.BelowMinimum, what the benches retry at) is the converted model's exact-gate plan's smallest
    budget at the same process base, less the early slack; and the planner's own refusal on the FLASHDIR names that
    plan's minimum."""
    import flashinfer_lite.runtime as runtime
    from flashinfer_lite.budget import BelowMinimum
    base = 64 << 20       # the early estimate's process base, fixed: the planner's is given the same
    monkeypatch.setattr(runtime, "base_estimate_bytes", lambda layout, vocab_size: base)
    # and no loading's peak over it (what this installation measured before): the planner is given the base alone
    monkeypatch.setattr(runtime, "loading_excess_bytes", lambda layout: 0)
    cache = tmp_path / "cache"
    monkeypatch.setenv("FLASHINFER_LITE_CACHE", str(cache))
    with pytest.raises(BelowMinimum) as early:
        runtime.load_runtime(STORIES, "auto", dram_budget=32 << 20, ctx=64)
    assert not cache.exists() or not [p for p in cache.rglob("*") if p.is_file()]
    flash = convert(STORIES, tmp_path / "flash", progress=False)          # what first use converts
    _, _, gate = runtime.load_runtime(flash, "auto", ctx=64, base_bytes=base)    # calibrates: first use
    assert type(gate.selector).__name__ == "ExactGate"
    assert early.value.minimum_bytes == gate.plan.floor_bytes - runtime.EARLY_SLACK_BYTES
    assert f"below the minimum {early.value.minimum_bytes / 2**20:.1f} MiB for this model" in str(early.value)
    with pytest.raises(BelowMinimum) as planned:
        runtime.load_runtime(flash, "auto", dram_budget=gate.plan.floor_bytes - 1, ctx=64, base_bytes=base)
    assert planned.value.minimum_bytes == gate.plan.floor_bytes
    assert str(planned.value).startswith(f"DRAM budget {(gate.plan.floor_bytes - 1) / 2**20:.1f} MiB is below the "
                                         f"minimum {gate.plan.floor_bytes / 2**20:.1f} MiB for this model (")


def test_the_loading_peak_floors_the_minimum_of_every_caller(tmp_path, monkeypatch):
    """What the process held while its kernels loaded (the loading's peak) is a floor of the minimum, applied in one
    place (modes.minimum_bytes): the benches' minimum (ModelFiles.minimum_bytes), decide's refusal and the early
    refusal, before loading (from the peak this installation last measured), name it, in one wording."""
    import flashinfer_lite.runtime as runtime
    from flashinfer_lite.budget import BelowMinimum
    from flashinfer_lite.modes import decide
    flash = convert(STORIES, tmp_path / "flash", progress=False)
    base, ctx = 64 << 20, 64
    files = runtime.open_model_files(flash, "auto", base_bytes=base, ctx=ctx)
    planned = files.minimum_bytes("auto", ctx)
    assert planned > base
    peak = files.loading_peak_bytes = planned + (16 << 20)        # a small model's: over its plan's minimum
    assert files.minimum_bytes("auto", ctx) == peak
    with pytest.raises(BelowMinimum) as refused:
        decide(files, "auto", peak - 1, ctx)
    assert refused.value.minimum_bytes == peak
    assert decide(files, "auto", peak, ctx).calibrate_gate      # at the floor: decided (its thresholds come first)
    monkeypatch.setattr(runtime, "base_estimate_bytes", lambda layout, vocab_size: base)
    monkeypatch.setattr(runtime, "loading_excess_bytes", lambda layout: peak - base)
    with pytest.raises(BelowMinimum) as early:
        runtime.refuse_below_minimum(str(flash), "auto", planned, ctx)
    assert early.value.minimum_bytes == peak - runtime.EARLY_SLACK_BYTES
    for e in (refused.value, early.value):
        assert f"below the minimum {e.minimum_bytes / 2**20:.1f} MiB for this model (" in str(e)
        assert f"loading the kernels takes the process to {'about ' if e is early.value else ''}" in str(e), str(e)



def test_the_floor_refusal_names_the_higher_of_the_plan_and_the_loading_peak():
    """modes.floor_refusal, the rule decide and the early refusal share: a budget under the plan's minimum gets the
    plan's refusal, unless the loading's peak is higher (then the peak's, as the budget under it though the plan
    fits); at both floors, none."""
    from flashinfer_lite.budget import BelowMinimum
    from flashinfer_lite.modes import floor_refusal
    MiB = 1 << 20
    plan = BelowMinimum(90 * MiB, 100 * MiB, "the plan's parts")
    assert floor_refusal(120 * MiB, None, 120 * MiB, 50 * MiB) is None
    assert floor_refusal(90 * MiB, plan, 80 * MiB, 50 * MiB) is plan
    for refusal, budget in ((plan, 90 * MiB), (None, 110 * MiB)):
        e = floor_refusal(budget, refusal, 120 * MiB, 50 * MiB)
        assert e.minimum_bytes == 120 * MiB and "loading the kernels takes the process to 120.0 MiB" in str(e)


def test_a_first_use_compiles_before_the_tokenizer_is_built(tmp_path, monkeypatch):
    """A first use's compile children run beside a process that holds no tokenizer yet (Qwen2.5's: 49 MiB of the
    342 MiB memory cgroup its -c 32768 runs in), not beside the whole process base (it used to compile from
    measure_base_bytes, after the tokenizer and the predictors), and once: the load's one compile check is there
    (measure_base_bytes, which checked again, only loads them)."""
    import flashinfer_lite.runtime as runtime
    from flashinfer_lite import warmup
    from flashinfer_lite.process import RSS_MARKS
    flash = convert(STORIES, tmp_path / "flash", progress=False)
    held = []           # the parts this process held at each compile
    for module in (runtime, warmup):
        monkeypatch.setattr(module, "compiled_stamp", lambda layout: tmp_path / "never-compiled.stamp")
        monkeypatch.setattr(module, "compile_in_child", lambda layout: held.append([w for w, _ in RSS_MARKS]))
    runtime.open_model_files(flash, "auto", ctx=64)
    assert len(held) == 1 and not any(w.startswith("tokenizer") for w in held[0]), held


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="Linux: memory cgroups")
def test_a_first_use_in_a_memory_cgroup_too_small_to_compile_is_one_line(tiny_model, tmp_path):
    """A cold first run (empty Numba cache) under a real memory cgroup too small for a compiler beside the run: the
    compile child is the OOM killer's choice, and the run ends with one line that names the limit a first use needs
    and says later runs need less (it used to compile in this process instead, its process base then too large for
    its budget, or be killed)."""
    sys.path.insert(0, str(REPO / "tools"))
    from memcap import available
    if why_not := available():
        pytest.skip(why_not)
    flash = convert(tiny_model("llama-silu-gqa"), tmp_path / "flash", dtype="q8_0", progress=False)
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"), FLASHINFER_LITE_CACHE=str(tmp_path / "cache"),
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    summary = tmp_path / "memcap.json"
    r = subprocess.run([sys.executable, str(REPO / "tools" / "memcap.py"), "--limit", "130M", "--json", str(summary),
                        "--", sys.executable, "-m", "flashinfer_lite", "generate", "-m", str(flash), "-p", "hi", "-n",
                        "2", "-c", "64", "--dram-budget", "170M"], env=env, capture_output=True, text=True,
                       timeout=900)
    lines = [line for line in r.stderr.strip().splitlines() if not line.startswith("memcap: ")]
    assert r.returncode == 1 and len(lines) == 1, r.stderr[-3000:]
    from flashinfer_lite.warmup import COMPILE_CHILD_BYTES
    m = re.match(r"error: a first use compiles the kernels .* give the first use a limit of about (\d+) MiB "
                 r"\(later runs load the compiled kernels and need only their --dram-budget\)$", lines[0])
    assert m and int(m[1]) > 130 and int(m[1]) >= COMPILE_CHILD_BYTES >> 20, lines[0]
    assert json.loads(summary.read_text())["oom_kills"] >= 1


def test_the_early_estimate_is_at_most_the_smallest_base_measured(monkeypatch):
    """The early refusal's base: this process's RSS now plus what the line added when the model last ran, but never
    over the smallest base a run measured: the RSS at the early check moves by megabytes between processes on a busy
    machine (the suite saw the estimate 8 MiB over the planner's minimum: a budget the plan takes, refused)."""
    from flashinfer_lite import warmup
    MiB = 1 << 20
    monkeypatch.setattr(warmup, "model_key", lambda layout: "m")
    monkeypatch.setattr(warmup, "rss_bytes", lambda: 90 * MiB)          # a process that holds 8 MiB more than usual
    monkeypatch.setattr(warmup, "stamp_record", lambda layout: {"m": 40 * MiB})
    assert warmup.base_estimate_bytes(None, 1000) == 130 * MiB          # no base recorded yet: RSS + the line's
    monkeypatch.setattr(warmup, "stamp_record", lambda layout: {"m": 40 * MiB, "m base": 122 * MiB})
    assert warmup.base_estimate_bytes(None, 1000) == 122 * MiB
    monkeypatch.setattr(warmup, "rss_bytes", lambda: 70 * MiB)          # a lighter process: its own, lower
    assert warmup.base_estimate_bytes(None, 1000) == 110 * MiB


def test_a_load_records_no_line_part_from_an_earlier_loads_estimate(tmp_path, monkeypatch):
    """An early estimate a load made and never measured against (refused) is not a later load's start: a test worker
    that had grown by 1 GB since one recorded that as the line's part, and the next run's early refusal named 1.1 GB
    for a 94 MiB model."""
    from flashinfer_lite import runtime, warmup
    flash = convert(STORIES, tmp_path / "flash", progress=False)
    with pytest.raises(Exception, match="below the minimum"):
        runtime.open_model_files(flash, "auto", ctx=64, dram_budget=1 << 20)     # estimates, refuses
    assert warmup._early_rss is not None
    recorded = []
    monkeypatch.setattr(warmup, "remember", lambda layout, figures: recorded.append(figures))
    monkeypatch.setattr(warmup, "compiled_stamp", lambda layout: tmp_path / "flash" / "manifest.json")  # "compiled"
    runtime.open_model_files(flash, "auto", ctx=64)                                 # no budget: no estimate
    # its figures: the kernels', the loading's and the base's, but no "what the line added" (the bare model key)
    assert recorded and all(k == "kernels" or " " in k for f in recorded for k in f), recorded
