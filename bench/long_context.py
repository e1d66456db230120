#!/usr/bin/env python3
"""Long context inside the budget (issue #45): per context length, a passkey prompt (a 5-digit key at a few depths of
WikiText filler) run in a DRAM budget of a -c 2048 run's minimum plus 64 MiB, under a memory cgroup of that size: the
KV pages beyond the budget's share go to flash. Per row: peak RSS, prompt time, and per decode mode (exact: every page;
Quest: --quest-share of the pages, at least --quest-min-pages, + the first and the latest) decode ms/token, pages read
per token and the answers.
Depths run deepest first, each prompt reusing the deeper one's cached part; the modes decode from the cache cut back
to the prompt (KVCache.reset). --dram-row: exact with every KV page in DRAM; --llama: llama.cpp in the same cgroup.

    PYTHONPATH=. python bench/long_context.py -m GGUF [--contexts 2048,4096,8192] [--depths 0.1,0.5,0.9]
        [--prompt-tokens N] [--quest-share 0.25] [--quest-min-pages 40] [--budget-mib N | --budget-ctx 2048]
        [--dram-row] [--llama] [--md FILE]
"""
import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import harness as h

MIB = 2**20


def decode(model, kv, logits, n: int) -> tuple[list[int], list[float]]:
    import numpy as np
    out, ms = [int(np.argmax(logits))], []
    while len(out) < n:
        t0 = time.perf_counter()
        logits = model.forward([out[-1]], kv)
        ms.append(1e3 * (time.perf_counter() - t0))
        out.append(int(np.argmax(logits)))
    return out, ms


def measure_dram(job: dict) -> dict:
    """Decode ms/token, exact, every KV page in DRAM, the weights as the row's budget plans them (the cgroup raised by
    the row's pages on flash), over random rows of the prompt's length: only the time is asked of this row."""
    import numpy as np
    from flashinfer_lite.kv_pages import KVCache
    model, _ = load(job)
    kv = KVCache(model.cfg, job["ctx"], options=replace(model.kv_options, quest_share=0.0, dram_pages=None))
    rng, n, shape = np.random.default_rng(0), job["prompt_tokens"], (model.cfg.n_kv_heads, model.cfg.head_dim)
    for layer in range(model.cfg.n_layers):
        for at in range(0, n, 1024):
            k, v = rng.standard_normal((2, min(1024, n - at), *shape), dtype=np.float32)
            kv.write(layer, at, k, v)
    kv.length = n
    _, ms = decode(model, kv, np.zeros(1), job["n_gen"])
    return {"ms_per_token": round(sum(ms) / len(ms), 1), "dram_pages": kv.dram_pages, "pages": kv.pages,
            "planned_dram_pages": model.kv_options.dram_pages}    # the row's plan (None: every page)


def modes(job: dict, options) -> list:
    """(name, KV options) of each decode mode: exact (every page), Quest, and KCache if --kcache W is given."""
    exact = replace(options, quest_share=0.0)
    return [("exact", exact), ("quest", options)] + [("kcache", replace(exact, kcache=job["kcache"]))] * (
        job.get("kcache", 0) > 0)


def load(job: dict):
    """(model, tokenizer) as every row loads them: the job's budget, Quest's share in the KV options."""
    from flashinfer_lite.kv_pages import KVOptions
    return h.load_model(job["gguf"], "auto", threads=job["threads"], ctx=job["ctx"], dram_budget=job["budget"],
                        kv=KVOptions(quest_share=job["quest_share"], quest_min_pages=job["quest_min_pages"]))[:2]


def measure_llama(job: dict) -> dict:
    """harness.measure_llama on the prompt's ids, and the text of its greedy tokens (llama.cpp's own vocabulary)."""
    import llama_cpp
    r = h.measure_llama(job)
    text = llama_cpp.Llama(job["gguf"], vocab_only=True, verbose=False).detokenize(r["gen_tokens"]).decode(
        errors="replace")
    return dict(r, answer=text.strip()[:20], found=str(job["key"]) in text)


def measure_ppl(job: dict) -> dict:
    """Perplexity of the last job["ppl"] tokens of a passage of the prompt's length (the filler from its start), exact
    (prompt chunks of 16) and Quest (a decode step each: it selects pages only when decoding), from one prompt of the
    passage before them. Log-probabilities in float64, a row at a time (1,000 rows' logits: 600 MB on Qwen's vocab)."""
    import numpy as np
    from flashinfer_lite.kv_pages import KVCache, PageStats

    model, tok = load(job)
    ids = tok.encode(Path(job["filler"]).read_text()[:job["prompt_tokens"] * 6])[:job["prompt_tokens"]]
    head, kv = len(ids) - job["ppl"], KVCache(model.cfg, job["ctx"], options=model.kv_options)
    t0 = time.perf_counter()
    last = model.forward(ids[:head], kv)
    row = {"tokens": len(ids), "scored": len(ids) - head, "prompt_s": round(time.perf_counter() - t0, 1)}
    for mode, kv.options in modes(job, model.kv_options):
        kv.reset(head)
        kv.stats, total = PageStats(), h.logp(last, ids[head])
        step = 16 if mode == "exact" else 1
        for at in range(head, len(ids) - 1, step):
            x = model.forward(ids[at:min(at + step, len(ids) - 1)], kv, all_logits=True)
            total += sum(h.logp(r, ids[at + 1 + i]) for i, r in enumerate(x))
        row[mode] = round(float(np.exp(-total / row["scored"])), 4)
        p = kv.stats.per_token()       # decode steps' (exact's chunks of 16 count none); the pages held: the same
        row.update({f"{mode}_pages_read": round(p["value_pages_read"], 1), "pages": round(p["pages"], 1)})
        Path(job["partial"]).with_suffix(".ppl.json").write_text(json.dumps(row))    # the modes so far
    return row


def measure_row(job: dict) -> dict:
    from flashinfer_lite.kv_pages import KVCache, PageStats, dram_page_bytes
    t0 = time.perf_counter()
    model, tok = load(job)
    row = {"load_s": round(time.perf_counter() - t0, 3), "depths": []}
    filler = tok.encode(Path(job["filler"]).read_text()[:job["prompt_tokens"] * 6])
    filler *= -(-job["prompt_tokens"] // len(filler))        # a short file's text again, as often as it takes
    options = model.kv_options
    kv = KVCache(model.cfg, job["ctx"], options=options)
    row.update(dram_pages=kv.dram_pages, pages=kv.pages, page_bytes=dram_page_bytes(model.cfg, options))
    before: list[int] = []      # the prompt in the cache: deepest first, a shallower one starts as it, up to its key
    for i, depth in sorted(enumerate(job["depths"]), key=lambda d: -d[1]):
        ids, key = h.passkey_ids(tok, filler, job["prompt_tokens"], depth, job["ctx"])
        kept = next((n for n, (a, b) in enumerate(zip(before, ids[:-1])) if a != b), min(len(before), len(ids) - 1))
        kv.reset(kept)
        t0 = time.perf_counter()
        logits = model.forward(ids[kept:], kv)
        d = {"depth": depth, "key": key, "prompt_tokens": len(ids), "prefilled": len(ids) - kept,
             "prompt_s": round(time.perf_counter() - t0, 1), "ids": ids if i == 0 else None}
        before = ids
        for mode, o in modes(job, options):
            kv.options, kv.stats = o, PageStats()
            kv.reset(len(ids))
            out, ms = decode(model, kv, logits, job["n_gen"])
            text, p = tok.decode(out), kv.stats.per_token()
            d[mode] = {"answer": text.strip()[:20], "found": str(key) in text, "read_ahead": round(p["read_ahead"], 3),
                       "ms_per_token": round(sum(ms) / max(len(ms), 1), 1),
                       **{k: round(p[k], 1) for k in ("pages_read", "flash_pages_read", "pages", "value_pages_read")}}
        row["depths"].append(d)
        Path(job["partial"]).write_text(json.dumps(row))      # the depths so far, should a long run be stopped
    row["depths"].sort(key=lambda d: job["depths"].index(d["depth"]))
    return row


def minimum_at(gguf: Path, ctx: int) -> int:
    """The minimum budget `generate -m GGUF -c ctx` refuses a smaller one with (runtime.refuse_below_minimum)."""
    from flashinfer_lite import budget, runtime
    try:
        runtime.refuse_below_minimum(str(gguf), "auto", 1, ctx)
    except budget.BelowMinimum as e:
        return e.minimum_bytes
    raise AssertionError("no model runs in 1 byte")


def markdown(doc: dict) -> str:
    why = f" (the -c {doc['budget_ctx']} minimum + 64 MiB)" if doc["budget_ctx"] else ""
    lines = [f"`{doc['command']}`", "", f"budget {doc['budget_mib']:.0f} MiB{why}, memory cgroup of that size; "
             f"Quest reads {doc['quest_share']:.0%} of the pages (at least {doc['quest_min_pages']}) + first + latest",
             ""]
    rows = []
    for r in doc["rows"]:
        if "depths" not in r:
            rows.append([r["ctx"], h.failed(r)] + ["-"] * 9)
            continue
        for d in r["depths"]:
            e, q = d["exact"], d["quest"]
            rows.append([r["ctx"], f"{r['peak_rss_bytes'] / MIB:.0f}", f"{r['dram_pages']}/{r['pages']}",
                         d["depth"], f"{d['prompt_s']} ({d.get('prefilled', d['prompt_tokens'])})",
                         f"{e['ms_per_token']} / {q['ms_per_token']}",
                         f"{e['pages_read']:.0f} ({e['flash_pages_read']:.0f}) / {q['pages_read']:.0f} "
                         f"({q['flash_pages_read']:.0f})", f"{e['found']} / {q['found']}",
                         f"{e['answer']!r} / {q['answer']!r}", r["oom"]])
    lines += h.table(["-c", "peak RSS MiB", "pages in DRAM / layer", "depth", "prompt s (tokens prefilled)",
                      "ms/token exact / Quest", "pages read per token (flash) exact / Quest", "passkey found",
                      "answers", "OOM kills"], rows)
    more = [[r["ctx"], ms(r.get("dram"), "ms_per_token"), mib(r.get("llama")), ms(r.get("llama"), "p50_ms", "-"),
             ms(r.get("llama"), "prompt_ms", "-"), ms(r.get("llama"), "found", "-")] for r in doc["rows"]
            if "dram" in r or "llama" in r]
    for r in doc["rows"]:
        if "ppl" in r:
            p = r["ppl"]
            lines.append(f"\n-c {r['ctx']}: perplexity of the last {p['scored']} of {p['tokens']} tokens, exact "
                         f"{p['exact']} / Quest {p['quest']} ({p['quest_pages_read']} pages read per token)"
                         + (f" / KCache {p['kcache']} ({p['kcache_pages_read']} value pages read per token of "
                            f"{p['pages']})" if "kcache" in p else "") + ", peak RSS "
                         f"{p['peak_rss_bytes'] / MIB:.0f} MiB" if "exact" in p else f"\nperplexity: {h.failed(p)}")
    lines += [f"\nKCache {doc['kcache']:g}, -c {r['ctx']} depth {d['depth']}: found {d['kcache']['found']} "
              f"{d['kcache']['answer']!r}, {d['kcache']['ms_per_token']} ms/token, value pages read per token "
              f"{d['kcache']['value_pages_read']:.0f} of {d['kcache']['pages_read']:.0f}" for r in doc["rows"]
              for d in r.get("depths", []) if "kcache" in d]
    if more:
        lines += ["", *h.table(["-c", "ms/token exact, every KV page in DRAM (same weight plan)",
                                "llama.cpp peak RSS MiB", "llama.cpp ms/token (P50)", "llama.cpp prompt ms",
                                "llama.cpp passkey found"], more)]
    return "\n".join(lines)


def ms(r: dict | None, key: str, why: str | None = None) -> str:
    """A figure of an extra row, or why it has none (OOM-killed, refused, not run; `why` instead, if given)."""
    return "not run" if r is None else str(r[key]) if key in r else why or h.failed(r)


def mib(r: dict | None) -> str:
    return "not run" if r is None else h.failed(r) if "error" in r else f"{r['peak_rss_bytes'] / MIB:.0f}"


def main(argv=None) -> int:
    from flashinfer_lite.kv_pages import QUEST_MIN_PAGES
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", type=Path, help="GGUF (required)")
    ap.add_argument("--contexts", default="2048,4096,8192")
    ap.add_argument("--depths", default="0.1,0.5,0.9")
    ap.add_argument("--quest-share", type=float, default=0.25)
    ap.add_argument("--quest-min-pages", type=int, default=QUEST_MIN_PAGES,
                    help=f"Quest's fewest pages besides the first and the latest ({QUEST_MIN_PAGES})")
    ap.add_argument("--budget-mib", type=float, help="default: the --budget-ctx minimum + 64 MiB")
    ap.add_argument("--budget-ctx", type=int, default=2048, help="the context whose minimum sets the budget (2048)")
    ap.add_argument("-n", "--n-gen", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, help="prompt length (default: the context less -n)")
    ap.add_argument("--filler", type=Path, default=h.CORPUS / "wikitext2_test.txt", help="the text the key hides in")
    ap.add_argument("--dram-row", action="store_true",
                    help="also decode exact with every KV page in DRAM, the weights as planned in the budget")
    ap.add_argument("--llama", action="store_true", help="also llama.cpp on the first depth's prompt, same cgroup")
    ap.add_argument("--kcache", type=float, default=0.0, help="also KCache with this softmax weight (0: not run)")
    ap.add_argument("--ppl", type=int, default=0, help="also the perplexity of the filler's last N tokens of a "
                    "--prompt-tokens passage, exact, Quest (and --kcache's), same cgroup")
    h.add_arguments(ap, "--job")
    a = ap.parse_args(argv)
    if a.worker:
        measure = dict(row=measure_row, dram=measure_dram, ppl=measure_ppl, **{"llama.cpp": measure_llama})[a.worker]
        return h.worker(a.out, a.worker, lambda: measure(json.loads(Path(a.job).read_text())))
    if a.model is None:
        ap.error("-m GGUF is required")
    work = h.work_dir(a, "long-context-")
    budget = int(a.budget_mib * MIB) if a.budget_mib else minimum_at(a.model, a.budget_ctx) + (64 << 20)
    h.compile_kernels(a.model, budget)
    doc = {"command": h.command("long_context.py", argv), "machine": h.machine(), "budget_mib": budget / MIB,
           "budget_ctx": None if a.budget_mib else a.budget_ctx, "quest_share": a.quest_share,
           "quest_min_pages": a.quest_min_pages, "rows": [], "kcache": a.kcache}
    for ctx in map(int, a.contexts.split(",")):
        job = work / f"job-{ctx}.json"
        spec = {"gguf": str(a.model), "ctx": ctx, "budget": budget, "threads": a.threads, "n_gen": a.n_gen,
                "ppl": a.ppl, "kcache": a.kcache, "quest_share": a.quest_share,
                "quest_min_pages": a.quest_min_pages, "depths": [float(x) for x in a.depths.split(",") if x],
                "prompt_tokens": a.prompt_tokens or ctx - a.n_gen, "filler": str(a.filler.resolve()),
                "partial": str(work / f"ctx-{ctx}.partial.json")}
        job.write_text(json.dumps(spec))
        r = {"depths": []} if not spec["depths"] else h.run_row(__file__, "row", f"ctx-{ctx}", budget, work,
                                                                   ["--job", job])
        r = dict(r, ctx=ctx, oom=r.get("memcap", {}).get("oom_kills"))
        if a.ppl:
            r["ppl"] = h.run_row(__file__, "ppl", f"ppl-{ctx}", budget, work, ["--job", job])
        ids = [d.pop("ids") for d in r.get("depths", [])][:1]
        if a.dram_row:
            cap = budget + (r["pages"] - r["dram_pages"]) * r["page_bytes"] if "page_bytes" in r else None
            r["dram"] = h.run_row(__file__, "dram", f"dram-{ctx}", cap, work, ["--job", job])
        if a.llama and ids:
            job.write_text(json.dumps(dict(spec, prompt_ids=ids[0], key=r["depths"][0]["key"],
                                           llama_extra_bufts=False)))
            r["llama"] = h.run_row(__file__, "llama.cpp", f"llama-{ctx}", budget, work, ["--job", job])
        doc["rows"].append(r)
    return h.emit(doc, markdown, a.md, None if a.keep else work)


if __name__ == "__main__":
    raise SystemExit(main())
