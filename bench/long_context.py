#!/usr/bin/env python3
"""Long context inside the budget (issue #45): per context length, a passkey prompt (a 5-digit key at a few depths of
WikiText filler) run in a DRAM budget that holds a -c 2048 run's minimum plus 64 MiB, under a memory cgroup of that
size: the KV pages beyond the budget's share go to flash. Per row: peak RSS, prompt time, and per decode mode (exact:
every page; Quest: --quest-share of the pages + the first and the latest) decode ms/token, KV pages read per token
(from flash) and the passkey answers.

    PYTHONPATH=. python bench/long_context.py -m GGUF [--contexts 2048,4096,8192] [--depths 0.1,0.5,0.9]
        [--quest-share 0.25] [--budget-mib N | --budget-ctx 2048] [--md FILE]

The prompt runs once per depth; both modes decode from it (the prompt is exact in both): exact first, then the cache
is cut back to the prompt (KVCache.reset) and Quest decodes. Times come from a shared 2-core machine: the load
average is in each row.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import harness as h

HEAD = "There is a pass key hidden inside a lot of irrelevant text. Find it and remember it.\n\n"
KEY = "\n\nThe pass key is {key}. Remember it. {key} is the pass key.\n\n"
QUESTION = "\n\nWhat is the pass key? The pass key is"
MIB = 2**20


def passkey_ids(tok, filler: list[int], n: int, depth: float, key: int) -> list[int]:
    """About n tokens: the head, filler with the key's sentence at `depth` of it, the question."""
    head, mid, tail = (tok.encode(t) for t in (HEAD, KEY.format(key=key), QUESTION))
    room = n - len(head) - len(mid) - len(tail)
    cut = int(room * depth)
    return head + filler[:cut] + mid + filler[cut:room] + tail


def decode(model, kv, logits, n: int) -> tuple[list[int], list[float]]:
    import numpy as np
    out, ms = [int(np.argmax(logits))], []
    while len(out) < n:
        t0 = time.perf_counter()
        logits = model.forward([out[-1]], kv)
        ms.append(1e3 * (time.perf_counter() - t0))
        out.append(int(np.argmax(logits)))
    return out, ms


def measure_row(job: dict) -> dict:
    from flashinfer_lite.kv_pages import KVCache, KVOptions, PageStats
    quest = KVOptions(quest_share=job["quest_share"])
    t0 = time.perf_counter()
    model, tok, _ = h.load_model(job["gguf"], "auto", threads=job["threads"], ctx=job["ctx"],
                                 dram_budget=job["budget"], kv=quest)
    load_s = time.perf_counter() - t0
    filler = tok.encode(Path(h.CORPUS / "wikitext2_test.txt").read_text()[:job["ctx"] * 8])
    options = model.kv_options
    kv = KVCache(model.cfg, job["ctx"], options=options)
    row = {"load_s": round(load_s, 3), "dram_pages": kv.dram_pages, "pages": kv.pages, "depths": []}
    for i, depth in enumerate(job["depths"]):
        key = 10000 + (7919 * (i + 1) * job["ctx"]) % 90000
        ids = passkey_ids(tok, filler, job["ctx"] - job["n_gen"], depth, key)
        kv.reset()
        t0 = time.perf_counter()
        logits = model.forward(ids, kv)
        d = {"depth": depth, "key": key, "prompt_tokens": len(ids), "prompt_s": round(time.perf_counter() - t0, 1)}
        for mode, o in (("exact", replace(options, quest_share=0.0)), ("quest", options)):
            kv.options, kv.stats = o, PageStats()
            kv.reset(len(ids))
            out, ms = decode(model, kv, logits, job["n_gen"])
            p = kv.stats.per_token()
            text = tok.decode(out)
            d[mode] = {"answer": text.strip()[:20], "found": str(key) in text,
                       "ms_per_token": round(sum(ms) / max(len(ms), 1), 1),
                       "pages_read": round(p["pages_read"], 1), "flash_pages_read": round(p["flash_pages_read"], 1),
                       "pages": round(p["pages"], 1)}
        row["depths"].append(d)
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
             f"Quest reads {doc['quest_share']:.0%} of the pages + first + latest", ""]
    rows = []
    for r in doc["rows"]:
        if "depths" not in r:
            rows.append([r["ctx"], h.failed(r)] + ["-"] * 9)
            continue
        for d in r["depths"]:
            e, q = d["exact"], d["quest"]
            rows.append([r["ctx"], f"{r['peak_rss_bytes'] / MIB:.0f}", f"{r['dram_pages']}/{r['pages']}",
                         d["depth"], d["prompt_s"], f"{e['ms_per_token']} / {q['ms_per_token']}",
                         f"{e['pages_read']:.0f} ({e['flash_pages_read']:.0f}) / {q['pages_read']:.0f} "
                         f"({q['flash_pages_read']:.0f})", f"{e['found']} / {q['found']}",
                         f"{e['answer']!r} / {q['answer']!r}", r["oom"]])
    lines += h.table(["-c", "peak RSS MiB", "pages in DRAM / layer", "depth", "prompt s", "ms/token exact / Quest",
                      "pages read per token (flash) exact / Quest", "passkey found", "answers", "OOM kills"], rows)
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", type=Path, help="GGUF (required)")
    ap.add_argument("--contexts", default="2048,4096,8192")
    ap.add_argument("--depths", default="0.1,0.5,0.9")
    ap.add_argument("--quest-share", type=float, default=0.25)
    ap.add_argument("--budget-mib", type=float, help="default: the --budget-ctx minimum + 64 MiB")
    ap.add_argument("--budget-ctx", type=int, default=2048, help="the context whose minimum sets the budget (2048)")
    ap.add_argument("-n", "--n-gen", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    h.add_arguments(ap, "--job")
    a = ap.parse_args(argv)
    if a.worker:
        return h.worker(a.out, a.worker, lambda: measure_row(json.loads(Path(a.job).read_text())))
    if a.model is None:
        ap.error("-m GGUF is required")
    work = h.work_dir(a, "long-context-")
    if a.budget_mib:
        budget = int(a.budget_mib * MIB)
    else:
        budget = minimum_at(a.model, a.budget_ctx) + (64 << 20)
    doc = {"command": h.command("long_context.py", argv), "machine": h.machine(), "budget_mib": budget / MIB,
           "budget_ctx": None if a.budget_mib else a.budget_ctx,
           "quest_share": a.quest_share, "rows": []}
    for ctx in map(int, a.contexts.split(",")):
        job = work / f"job-{ctx}.json"
        job.write_text(json.dumps({"gguf": str(a.model), "ctx": ctx, "budget": budget, "threads": a.threads,
                                   "n_gen": a.n_gen, "quest_share": a.quest_share,
                                   "depths": [float(x) for x in a.depths.split(",")]}))
        r = h.run_row(__file__, "row", f"ctx-{ctx}", budget, work, ["--job", job])
        doc["rows"].append(dict(r, ctx=ctx, oom=r.get("memcap", {}).get("oom_kills")))
    return h.emit(doc, markdown, a.md, None if a.keep else work)


if __name__ == "__main__":
    raise SystemExit(main())
