"""What every bench shares: a row runs as its own worker process under a memory cap, writes one JSON result, and the
driver prints one JSON document (stdout) and a markdown table (stderr, and --md FILE). Models are built here only,
through the library's loading path (load_model). The other bench modules import this one and no other bench module.

Standard library and numpy at the top: llama.cpp's worker imports this module and must not load numba and LLVM.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import flashinfer_lite  # noqa: E402,F401  (first: it sets the thread pools' variables before numpy loads)
import numpy as np  # noqa: E402

from flashinfer_lite.process import peak_rss_bytes, read_bytes  # noqa: E402  (standard library and numpy only)

MEMCAP = REPO / "tools" / "memcap.py"
CORPUS = REPO / "tests" / "data" / "corpus"
STORIES = REPO / "tests" / "data" / "stories260K"
MIN_MARGIN = 4 << 20     # a row's process measures its own process base: a little more or less RSS than the probe's


# ----------------------------------------------------------------------------------------------------------------------
# Long prompts: the passkey test and a token's log-probability

PASSKEY = ("There is a pass key hidden inside a lot of irrelevant text. Find it and remember it.\n\n",
           "\n\nThe pass key is {key}. Remember it. {key} is the pass key.\n\n",
           "\n\nWhat is the pass key? The pass key is")


def passkey_ids(tok, filler: list[int], n: int, depth: float, ctx: int) -> tuple[list[int], int]:
    """(about n tokens: the head, filler with the key's sentence at `depth` of it, the question; the key). The key comes
    from ctx and the depth's value: runs of one depth each hide different keys."""
    import zlib
    key = 10000 + zlib.crc32(f"{ctx} {depth:g}".encode()) % 90000
    head, mid, tail = (tok.encode(t.format(key=key)) for t in PASSKEY)
    room = n - len(head) - len(mid) - len(tail)
    return head + filler[:int(room * depth)] + mid + filler[int(room * depth):room] + tail, key


def logp(x: np.ndarray, t: int) -> float:      # log softmax(x)[t], in float64
    x = x.astype(np.float64)
    return float(x[t] - x.max() - np.log(np.exp(x - x.max()).sum()))


# ----------------------------------------------------------------------------------------------------------------------
# Building a model: the one place a bench loads one

def load_model(path, ffn="dense", threads: int | None = None, **kw):
    """(model, tokenizer, runtime or None) of `path`. `ffn` is an --ffn mode, built by the library's loading path
    (runtime.load_runtime, its keywords in kw); "float32", every weight dequantized to float32 (model.load_reference: the
    reference whose activations the placement and cache benches record); or a function (checkpoint, resident weights) -> FFN for a bench's own
    FFN source (bundles memmapped, streamed by layer, replayed sets): the resident weights are then loaded as the
    runtime keeps them (matrices float16 unless the FLASHDIR is f32). threads: Numba's compute threads."""
    from flashinfer_lite.threads import set_threads
    set_threads(threads)
    if ffn == "float32":
        from flashinfer_lite.model import load_reference
        return (*load_reference(path), None)
    if not callable(ffn):
        from flashinfer_lite.runtime import load_runtime
        return load_runtime(path, ffn, **kw)
    from storage.half import half_matrix
    from flashinfer_lite.model import load_weights
    from flashinfer_lite.model import Transformer
    from storage.format import FlashCheckpoint, ffn_tensor_names
    ck = FlashCheckpoint(path)
    L = ck.layout
    bundled = {n for i in range(L.n_layers) for n in ffn_tensor_names(L, i)}
    weights = load_weights(ck, skip=lambda n: n in bundled, convert=half_matrix if L.dtype != "f32" else None)
    return Transformer(ck.config, weights, ffn=ffn(ck, weights)), ck.tokenizer(), None


class BundleFFN:
    """The dense FFN over a FLASHDIR's bundle rows: the runtime's sparse kernel (act and threshold of the config) on
    every row of the layer `rows(layer)` returns ([n, stride]: ffn.bin in RAM, memmapped, or read per token). The
    modes differ only in where the rows come from. `record(layer, active [n])` sees each token's active neurons."""

    def __init__(self, layout, rows, down_bias=None, record=None):
        from flashinfer_lite.ffn.quant import sparse_ffn
        self.layout, self.rows, self.record = layout, rows, record
        self.kernel = sparse_ffn(layout, max_active=max(layout.n_neurons))
        self.ids = np.arange(max(layout.n_neurons), dtype=np.int32)
        self.down_bias = down_bias or [None] * layout.n_layers
        self.y = np.empty(layout.d, np.float32)
        self.compute_s = 0.0

    def warm_up(self):
        """Compile (or load from Numba's cache) the kernel before a clock starts."""
        x = np.zeros(self.layout.d, np.float32)
        self.kernel(np.zeros((2, self.layout.stride), np.uint8), self.ids[:2], x, self.y)

    def __call__(self, layer: int, x: np.ndarray) -> np.ndarray:
        B = self.rows(layer)
        n = B.shape[0]
        y = np.empty((x.shape[0], self.layout.d), np.float32)
        for t in range(x.shape[0]):
            t0 = time.perf_counter()
            self.kernel(B, self.ids[:n], np.ascontiguousarray(x[t], np.float32), self.y)
            self.compute_s += time.perf_counter() - t0
            y[t] = self.y
            if self.record:
                self.record(layer, self.kernel.coef[:n] != 0)
        if self.down_bias[layer] is not None:
            y += self.down_bias[layer]
        return y


def region(ffn_bytes: np.ndarray, layout, layer: int) -> np.ndarray:
    """Layer `layer`'s bundle rows [n, stride] of the whole ffn.bin's bytes (in RAM or memmapped)."""
    off, n = layout.offset[layer], layout.n_neurons[layer]
    return ffn_bytes[off:off + n * layout.stride].reshape(n, layout.stride)


def trained_flashdir(source, work: Path, dtype: str, corpus: list[Path], tokens: int, collect_kw: dict,
                     **train_kw) -> tuple[Path, Path]:
    """(FLASHDIR, ACTS) of a --quick run: `source` converted, activations collected on the corpus, predictors trained
    (the pipeline of convert, collect and train-predictor, small)."""
    from predictors.collect import collect
    from predictors.train import train
    from storage.convert import convert
    flash = convert(source, work / "quick.flash", dtype=dtype, force=True, progress=False, ffn_layout="bundles")
    acts = collect(source, corpus, tokens, work / "acts", force=True, progress=False, **collect_kw)
    train(acts, flash, progress=False, **train_kw)
    return Path(flash), Path(acts)


def compile_kernels(path, budget: int) -> None:
    """A first use's work before the rows' cgroups: the conversion, and the kernels' compile in children
    (warmup.compile_in_child) that take more than a small row's cgroup leaves. One token generated, uncapped."""
    subprocess.run([sys.executable, "-m", "flashinfer_lite", "generate", "-m", str(path), "-p", "a", "-n", "1",
                    "--dram-budget", f"{-(-budget // 2**20)}M", "-c", "256"],
                   env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True)


def probe_minimum(path, ffn: str, ctx: int, window: int = 5) -> dict:
    """The runtime's own minimum DRAM budget for this FFN mode and context (modes.ModelFiles.minimum_bytes: the
    planner's, floored at the loading's peak), with the process base measured in this fresh process by the library's
    loading path (runtime.open_model_files), as a row's process will measure its own; minimum_bytes adds MIN_MARGIN
    for the difference."""
    from flashinfer_lite.runtime import context_size, open_model_files
    files = open_model_files(path, ffn)
    base = files.base_bytes
    minimum = files.minimum_bytes(ffn, context_size(ctx, files.ckpt.config), window)
    return {"minimum_bytes": minimum + MIN_MARGIN,
            "message": f"--ffn {ffn} -c {ctx}: minimum {minimum / 2**20:.1f} MiB, process base {base / 2**20:.1f} MiB"}


def retry_bytes(row: dict) -> int:
    """Bytes to ask for at the minimum a row's refusal named (budget.BelowMinimum's), plus the margin."""
    return row["refused_minimum_bytes"] + MIN_MARGIN


class Counters:
    """Bytes fetched from storage and neuron-cache counters between two points of this process."""

    def __init__(self, runtime):
        self.rt = runtime
        self.start = self.now()

    def now(self) -> dict:
        s = self.rt.stats if self.rt is not None else None
        return {"io": read_bytes(), "hits": s.hits if s else 0, "misses": s.misses if s else 0,
                "reader": s.read_bytes + s.prefill_bytes_read if s else 0, "pred_s": s.predictor_s if s else 0.0}

    def since(self, n: int) -> dict:
        """Per-step figures over n steps since `start`."""
        e = self.now()
        d = {k: e[k] - self.start[k] for k in e}
        looked = d["hits"] + d["misses"]
        return {"MB_per_token": round(d["io"] / max(n, 1) / 1e6, 3),
                "reader_MB_per_token": round(d["reader"] / max(n, 1) / 1e6, 3) if self.rt else None,
                "hit_rate": round(d["hits"] / looked, 4) if looked else None,
                "predictor_ms_per_token": round(1e3 * d["pred_s"] / max(n, 1), 3) if self.rt else None}


# ----------------------------------------------------------------------------------------------------------------------
# llama.cpp itself (llama-cpp-python, the optional `bench` extra)

def llama_model(gguf, n_ctx: int, threads: int, extra_bufts: bool = False):
    """llama_cpp.Llama on the GGUF, mmap'ed, greedy-ready. Llama() takes no flag for extra buffer types, so with
    extra_bufts False the model params it starts from (llama_model_default_params) are patched for the call."""
    import llama_cpp
    import llama_cpp.llama_cpp as C
    default = C.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = extra_bufts
        return p
    C.llama_model_default_params = params
    try:
        return llama_cpp.Llama(str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, use_mmap=True,
                               logits_all=False, verbose=False)
    finally:
        C.llama_model_default_params = default


def step_stats(prompt_ms: float, n_prompt: int, step_ms: list[float], io_bytes: int) -> dict:
    steps = len(step_ms)
    q = (lambda p: round(float(np.percentile(step_ms, p)), 3)) if steps else (lambda p: None)
    return {"prompt_tokens": n_prompt, "prompt_ms": round(prompt_ms, 3),
            "prompt_ms_per_token": round(prompt_ms / n_prompt, 3), "decode_steps": steps, "p50_ms": q(50),
            "p99_ms": q(99), "tokens_per_s": round(steps / sum(step_ms) * 1e3, 3) if steps else None,
            "decode_MB_per_token": round(io_bytes / max(steps, 1) / 1e6, 3)}


def measure_llama(job: dict) -> dict:
    """eval(prompt ids), then one eval per generated token; argmax of the last logits row (llama_get_logits_ith)."""
    import llama_cpp
    t0 = time.perf_counter()
    llm = llama_model(job["gguf"], job["ctx"], job["threads"], job["llama_extra_bufts"])
    load_s = time.perf_counter() - t0
    n_vocab = llm.n_vocab()

    def argmax() -> int:
        return int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))))
    ids = job["prompt_ids"]
    t0 = time.perf_counter()
    llm.eval(ids)
    prompt_ms = 1e3 * (time.perf_counter() - t0)
    out, step_ms, io0 = [argmax()], [], read_bytes()
    while len(out) < job["n_gen"]:
        t0 = time.perf_counter()
        llm.eval([out[-1]])
        step_ms.append(1e3 * (time.perf_counter() - t0))
        out.append(argmax())
    return {"engine": "llama.cpp", "load_s": round(load_s, 3), "gen_tokens": out,
            **step_stats(prompt_ms, len(ids), step_ms, read_bytes() - io0),
            "llama_cpp": llama_cpp.__version__, "system_info": llama_cpp.llama_print_system_info().decode().strip(),
            # llama.cpp's own tokenizer on the text of the ids: the same ids, or the prompts would differ
            "same_ids_by_llama_tokenizer": llm.tokenize(llm.detokenize(ids, special=True), add_bos=False,
                                                        special=True) == ids}


# ----------------------------------------------------------------------------------------------------------------------
# Worker and driver

def add_arguments(ap: argparse.ArgumentParser, *hidden: str) -> None:
    """--keep and --md, and the worker's hidden arguments (--worker, --out and `hidden`)."""
    ap.add_argument("--keep", type=Path, help="keep the work directory (worker outputs) here")
    ap.add_argument("--md", type=Path, help="also write the markdown table here")
    for name in ("--worker", "--out", *hidden):
        ap.add_argument(name, help=argparse.SUPPRESS)


def work_dir(a, prefix: str) -> Path:
    work = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    return work


def worker(out: str, mode: str, measure) -> int:
    """Run one row in this process: measure() -> dict, written to `out` with the peak RSS (VmHWM: ru_maxrss inherits
    the parent's peak across exec). A failure is the row's result (below_minimum when the runtime refused the
    budget, with the minimum it named: budget.BelowMinimum; else error): the other rows go on."""
    res = {"mode": mode}
    try:
        res.update(measure())
    except Exception as e:
        refused = getattr(e, "minimum_bytes", None)     # BelowMinimum (not imported here: numba stays unloaded)
        res["below_minimum" if refused is not None else "error"] = (str(e) or type(e).__name__)[:2000]
        if refused is not None:
            res["refused_minimum_bytes"] = int(refused)
    res["peak_rss_bytes"] = peak_rss_bytes()
    tmp = Path(out + ".tmp")
    tmp.write_text(json.dumps(res))
    tmp.rename(out)
    return 0


def run_row(script: str, mode: str, name: str, cap: int | None, work: Path, args: list[str],
            env: dict | None = None) -> dict:
    """One row: `script --worker mode args` as its own process under tools/memcap.py (page cache dropped first, the
    cap covers it; None: physical RAM). Adds the memcap summary, cap_bytes, wall_s and the load average."""
    out, capjson = work / f"{name}.json", work / f"{name}.memcap.json"
    cmd = [sys.executable, script, "--worker", mode, "--out", str(out), *map(str, args)]
    limit = cap or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    full = [sys.executable, str(MEMCAP), "--limit", str(limit), "--drop-caches", "--json", str(capjson), "--", *cmd]
    t0, load = time.perf_counter(), os.getloadavg()
    p = subprocess.run(full, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})}, stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, text=True)
    res = json.loads(out.read_text()) if out.exists() else {
        "mode": mode, "error": f"worker exited {p.returncode} without a result: {p.stderr.strip()[-2000:]}"}
    if capjson.exists():
        res["memcap"] = json.loads(capjson.read_text())
        if res["memcap"]["oom_kills"]:
            res["error"] = f"OOM-killed under the {limit / 2**20:.0f} MiB cap ({res.get('error', '')})"
    elif p.returncode == 3:
        res["error"] = "memory cgroup unavailable (tools/memcap.py exit 3)"
    res.update(cap_bytes=cap, wall_s=round(time.perf_counter() - t0, 1), loadavg=load)
    what = (f"P50 {res['p50_ms']} ms" if "p50_ms" in res else
            f"minimum {res['minimum_bytes'] / 2**20:.1f} MiB" if "minimum_bytes" in res else
            res.get("below_minimum") or res.get("error") or "done")
    print(f"  {name}: {what} ({res['wall_s']} s)", file=sys.stderr)
    return res


def machine() -> dict:
    return {"cpus": os.cpu_count(), "ram_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
            "load_avg_start": os.getloadavg()}


def command(script: str, argv) -> str:
    return " ".join(["python", f"bench/{script}", *map(str, argv if argv is not None else sys.argv[1:])])


def emit(doc: dict, markdown, md_path: Path | None, remove: Path | None) -> int:
    """The bench's output: the JSON document on stdout, its markdown(doc) on stderr (and md_path); `remove` the work
    dir."""
    doc.setdefault("machine", {})["load_avg_end"] = os.getloadavg()
    md = markdown(doc)
    print(json.dumps(doc, indent=1))
    print(md, file=sys.stderr)
    if md_path:
        tmp = md_path.with_name(md_path.name + ".tmp")
        tmp.write_text(md + "\n")
        tmp.rename(md_path)
    if remove:
        shutil.rmtree(remove, ignore_errors=True)
    return 0


def fmt(v, nd: int = 1) -> str:
    return "-" if v is None else (f"{v:.{nd}f}" if isinstance(v, float) else str(v))


def table(header: list[str], rows: list[list]) -> list[str]:
    """Markdown table lines."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(map(str, r)) + " |" for r in rows)]


def failed(r: dict) -> str:
    """Why a row has no measurement, on one line."""
    return (r.get("below_minimum") or r.get("error") or "?").splitlines()[0][:300]
