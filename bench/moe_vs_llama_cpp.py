#!/usr/bin/env python3
"""A mixture of experts at Qwen3-30B-A3B's shape from flash, against llama.cpp itself, under the same memory caps
(issue 30).

    PYTHONPATH=. python bench/moe_vs_llama_cpp.py [--layers 48] [-n 16] [--caps none,50%,25%] [--lookahead]
                                                  [--sparse] [--md FILE] [--keep DIR]

The model: Qwen3-30B-A3B's shape (d 2048, 32 query and 4 KV heads of 128, 128 experts of 768 neurons, 8 routed per
token, renormalised; per-head q/k RMSNorm), --layers of its 48, stories260K's 512-token vocabulary, random weights,
written directly as a `qwen3moe` GGUF in Q4_0 (scales set so each matrix's weights have std 1/sqrt(cols); router and
norms float32), converted to a FLASHDIR (the GGUF's blocks copied into the expert chunks). Random weights route about
uniformly: the worst case for any expert cache. Rows, each its own process under tools/memcap.py with the page cache
dropped: llama.cpp (mmap of the GGUF) and flashinfer-lite (--dram-budget = the cap less --slack) per cap, from the same
prompt ids, then -n decode steps over the same fixed random tokens (a random model's greedy output repeats one token,
and its experts: a cache's best case); "same argmax" compares the argmax after every step. Caps: none, a size or P%
of the GGUF. In RAM llama.cpp decodes the same tokens once first, warm as flash is. Expert reads: bench/README.md."""
from __future__ import annotations

# Only the standard library and numpy at the top: the llama.cpp worker must not load numba and LLVM into its memory.
import argparse
import json
import sys
import time
from pathlib import Path

import harness as h
from storage.sizes import parse_size  # noqa: E402

SLACK = "48M"
SHAPE = dict(dim=2048, heads=32, kv_heads=4, head_dim=128, experts=128, expert_dim=768, used=8, vocab=512)


def q4_0_random(rng, rows: int, cols: int, std: float) -> "np.ndarray":
    """uint8 [rows, cols / 32 * 18]: random Q4_0 blocks of weights d * (q - 8) with std about std; q - 8 has mean -1/2,
    so each block's scale gets a random sign (one for all: every token the same hidden direction, the same experts)."""
    import numpy as np
    n = rows * cols // 32
    blocks = np.empty((n, 18), np.uint8)
    scale = np.float16(std / 4.61) * rng.choice(np.array([-1, 1], np.float16), n)
    blocks[:, :2] = scale.astype("<f2").view(np.uint8).reshape(n, 2)
    blocks[:, 2:] = rng.integers(0, 256, (n, 16), dtype=np.uint8)
    return blocks.reshape(rows, cols // 32 * 18)


def write_gguf(path: Path, layers: int, seed: int = 0) -> int:
    """The bench model as a qwen3moe GGUF, one tensor in memory at a time; returns its size."""
    import gguf
    import numpy as np
    sys.path.insert(0, str(h.REPO / "tools"))
    from make_large_model import add_llama_metadata
    s = SHAPE
    d, q, kv, n, E = s["dim"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"], s["expert_dim"], s["experts"]
    Q4, F32 = gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.F32
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    add_llama_metadata(w, layers, 4096, d, n, s["heads"], s["kv_heads"], 1e-6, 1e6)
    for add, v in ((w.add_key_length, s["head_dim"]), (w.add_value_length, s["head_dim"]), (w.add_expert_count, E),
                   (w.add_expert_used_count, s["used"]), (w.add_expert_feed_forward_length, n)):
        add(v)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    # (name, shape [rows, cols] or [experts, rows, cols], kind, std); std 0: ones
    plan = [("token_embd.weight", (s["vocab"], d), Q4, 1.0)]
    for i in range(layers):
        b = f"blk.{i}."
        plan += [(b + "attn_norm.weight", (d,), F32, 0), (b + "attn_q.weight", (q, d), Q4, d ** -0.5),
                 (b + "attn_k.weight", (kv, d), Q4, d ** -0.5), (b + "attn_v.weight", (kv, d), Q4, d ** -0.5),
                 (b + "attn_output.weight", (d, q), Q4, q ** -0.5), (b + "attn_q_norm.weight", (s["head_dim"],), F32, 0),
                 (b + "attn_k_norm.weight", (s["head_dim"],), F32, 0), (b + "ffn_norm.weight", (d,), F32, 0),
                 (b + "ffn_gate_inp.weight", (E, d), F32, d ** -0.5), (b + "ffn_gate_exps.weight", (E, n, d), Q4, d ** -0.5),
                 (b + "ffn_up_exps.weight", (E, n, d), Q4, d ** -0.5), (b + "ffn_down_exps.weight", (E, d, n), Q4, n ** -0.5)]
    plan += [("output_norm.weight", (d,), F32, 0), ("output.weight", (s["vocab"], d), Q4, d ** -0.5)]
    for name, shape, kind, _ in plan:
        nbytes = int(np.prod(gguf.quant_shape_to_byte_shape(shape, kind)))
        w.add_tensor_info(name, shape, np.float32 if kind == F32 else np.float16, nbytes, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shape, kind, std in plan:
        w.write_tensor_data(q4_0_random(rng, int(np.prod(shape[:-1])), shape[-1], std) if kind != F32 else
                            np.ones(shape, np.float32) if std == 0 else rng.standard_normal(shape, np.float32) * std)
    w.close()
    return path.stat().st_size


def measure_llama(job: dict, warm: bool = False) -> dict:
    """llama.cpp: eval(prompt ids), then one eval per token of job["steps"]; the argmax after each. warm (in RAM): the
    same tokens once before, so that decode does not fault the mmap'ed experts in (flash reads them all at load)."""
    import llama_cpp
    import numpy as np
    t0 = time.perf_counter()
    llm = h.llama_model(job["gguf"], job["ctx"], job["threads"], job["llama_extra_bufts"])
    load_s = time.perf_counter() - t0
    if warm:
        llm.eval(job["prompt_ids"] + job["steps"])
        llm.reset()
    n_vocab = llm.n_vocab()

    def argmax() -> int:
        return int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))))
    t0 = time.perf_counter()
    llm.eval(job["prompt_ids"])
    prompt_ms = 1e3 * (time.perf_counter() - t0)
    out, step_ms, io0 = [argmax()], [], h.read_bytes()
    for tok in job["steps"]:
        t0 = time.perf_counter()
        llm.eval([tok])
        step_ms.append(1e3 * (time.perf_counter() - t0))
        out.append(argmax())
    return {"engine": "llama.cpp", "load_s": round(load_s, 3), "gen_tokens": out, "llama_cpp": llama_cpp.__version__,
            **h.step_stats(prompt_ms, len(job["prompt_ids"]), step_ms, h.read_bytes() - io0)}


def measure_flash(budget: int | None, job: dict, mode: str = "flash") -> dict:
    """flashinfer-lite: the prompt, then one forward per token of job["steps"]; the argmax after each."""
    import numpy as np
    from storage.flash_bench import expert_reads, reads_mark
    t0 = time.perf_counter()
    gate = mode == "flash-gate"          # the exact gate inside split expert chunks
    model, _, runtime = h.load_model(job["split" if gate else "flash"], "gate" if gate else "auto", ctx=job["ctx"],
                                     threads=job["threads"], dram_budget=budget, lookahead=mode == "flash-lookahead")
    load_s = time.perf_counter() - t0
    kv = model.new_cache(job["ctx"])
    t0 = time.perf_counter()
    logits = model.forward(job["prompt_ids"], kv)
    prompt_ms = 1e3 * (time.perf_counter() - t0)
    out, step_ms, c, s0 = [int(np.argmax(logits))], [], h.Counters(runtime), reads_mark(runtime.stats, job["flash"])
    for tok in job["steps"]:
        t0 = time.perf_counter()
        logits = model.forward([tok], kv)
        step_ms.append(1e3 * (time.perf_counter() - t0))
        out.append(int(np.argmax(logits)))
    d, st = c.since(len(step_ms)), runtime.stats.as_dict()
    return {"engine": "flashinfer-lite", "load_s": round(load_s, 3), "gen_tokens": out,
            **h.step_stats(prompt_ms, len(job["prompt_ids"]), step_ms, 0),
            "decode_MB_per_token": d["reader_MB_per_token"], "hit_rate": d["hit_rate"],
            **(expert_reads(runtime.stats, s0) if mode == "flash" else {}),
            "fired": round(runtime.cache.fired / runtime.stats.active.sum() / runtime.cfg.ffn_dim, 4) if gate else None,
            "overlapped_share": st["overlapped_share"], "read_wait_ms_per_token": st["read_wait_ms_per_token"],
            "budget_bytes": runtime.plan.budget_bytes, "slots": runtime.plan.slots, "plan": runtime.plan.table(),
            "prefetched": runtime.stats.prefetched, "prefetch_used": runtime.stats.prefetch_used}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=48, help="layers of Qwen3-30B-A3B's 48 to build")
    ap.add_argument("-n", type=int, default=16, help="tokens to generate")
    ap.add_argument("--caps", default="none,50%,25%")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lookahead", action="store_true", help="also rows with layer l+1's reads started on a guess")
    ap.add_argument("--sparse", action="store_true", help="also rows from split expert chunks (see above)")
    ap.add_argument("--slack", default=SLACK, help="under a cap, the flash row's DRAM budget is the cap less this")
    ap.add_argument("--job")
    ap.add_argument("--budget")
    h.add_arguments(ap)
    a = ap.parse_args(argv)
    if a.worker:
        job = json.loads(Path(a.job).read_text())
        budget = None if a.budget in (None, "none") else int(a.budget)
        return h.worker(a.out, a.worker, lambda: measure_llama(job, budget is None) if a.worker == "llama.cpp"
                        else measure_flash(budget, job, a.worker))
    work = h.work_dir(a, "moe-bench-")
    from storage.convert import convert
    from storage.checkpoint import open_checkpoint
    from storage.flash_bench import device_share, expert_rate
    gguf, t0 = work / "qwen3moe-shape.q4_0.gguf", time.perf_counter()
    gguf_bytes = gguf.stat().st_size if gguf.exists() else write_gguf(gguf, a.layers)
    flash = work / "flash"
    if not flash.exists():
        convert(gguf, flash, progress=sys.stderr.isatty())
    split = work / "flash_split"
    if a.sparse and not split.exists():
        convert(gguf, split, progress=sys.stderr.isatty(), expert_chunks="split")
    if a.sparse and not (split / "gate.json").exists():      # its thresholds once, outside the rows' timing and caps
        h.load_model(split, "gate", threads=a.threads, dram_budget=max(gguf_bytes // 2, 1 << 30))
    build_s = time.perf_counter() - t0
    tok = open_checkpoint(gguf).tokenizer()
    steps = __import__("numpy").random.default_rng(1).integers(3, SHAPE["vocab"], a.n).tolist()
    job = {"gguf": str(gguf), "flash": str(flash), "split": str(split), "ctx": 256, "threads": a.threads,
           "steps": steps, "prompt_ids": tok.encode("Once upon a time there was a robot who"),
           "llama_extra_bufts": False}
    (work / "job.json").write_text(json.dumps(job))
    rows = []
    for spec in a.caps.split(","):
        cap = None if spec == "none" else int(gguf_bytes * float(spec[:-1]) / 100) if spec.endswith("%") \
            else parse_size(spec)
        budget = "none" if cap is None else str(cap - parse_size(a.slack))
        for mode in ("llama.cpp", "flash", *("flash-lookahead",) * a.lookahead, *("flash-gate",) * a.sparse):
            r = h.run_row(__file__, mode, f"{mode}@{spec}", cap, work, ["--job", work / "job.json", "--budget", budget])
            rows.append(dict(r, cap=spec))
    doc = {"bench": "moe_vs_llama_cpp", "command": h.command("moe_vs_llama_cpp.py", argv), "machine": h.machine(),
           "model": {**SHAPE, "layers": a.layers, "gguf_bytes": gguf_bytes, "build_s": round(build_s, 1)},
           "device": (device := expert_rate(flash, 5.0)), "rows": [dict(r, **device_share(r, device)) for r in rows]}
    return h.emit(doc, markdown, a.md, None if a.keep else work)


def markdown(doc: dict) -> str:
    m = doc["model"]
    ref = {r["cap"]: r for r in doc["rows"] if r["mode"] == "llama.cpp" and "p50_ms" in r}
    out = []
    for r in doc["rows"]:
        if "p50_ms" not in r:
            out.append([r["mode"], r["cap"], h.failed(r), "", "", "", "", "", "", "", ""])
            continue
        base = ref.get(r["cap"])
        x = f"{base['p50_ms'] / r['p50_ms']:.2f}x" if base and r["mode"] != "llama.cpp" else "1x"
        same = "" if r["mode"] == "llama.cpp" or not base else \
            f"{sum(a == b for a, b in zip(r['gen_tokens'], base['gen_tokens']))}/{len(base['gen_tokens'])}"
        out.append([r["mode"], r["cap"], h.fmt(r["load_s"], 2), h.fmt(r["p50_ms"]), h.fmt(r["p99_ms"]),
                    h.fmt(r.get("decode_MB_per_token")), h.fmt(r.get("hit_rate"), 3), h.fmt(r.get("fired"), 3),
                    r.get("expert_reads", ""), x, same])
    head = (f"{m['layers']} of 48 layers at Qwen3-30B-A3B's shape ({m['experts']} experts of {m['expert_dim']}, "
            f"{m['used']} routed, d {m['dim']}), Q4_0 GGUF {m['gguf_bytes'] / 2**30:.2f} GiB; "
            f"load average {doc['machine']['load_avg_start']}; the device: {doc['device']['summary']}")
    return "\n".join([head, ""] + h.table(["row", "cap", "load s", "ms/token P50", "P99", "flash MB/token", "hit rate",
                                           "fired", "expert reads", "vs llama.cpp", "same argmax"], out))


if __name__ == "__main__":
    sys.exit(main())
