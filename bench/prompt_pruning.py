"""LazyLLM's prompt pruning (--prompt-pruning, issue #47), a GGUF in RAM: time to first token, passkey and perplexity.

    PYTHONPATH=. python bench/prompt_pruning.py -m GGUF [--ratios 0.5,0.7] [--prompt-tokens 4000] [--depths 10] [--md F]

One worker, the model loaded once (dense FFN). Per passkey depth (harness.passkey_ids), ratio 0 (off) and each of
--ratios: the prompt's pass and argmax (wall, CPU time), whether -n greedy tokens hold the key. Per ratio, the
perplexity of --ppl tokens after --prompt-tokens of WikiText-2 test (a pruned prompt, then 16 at a time)."""
import argparse, json, math, statistics, time  # noqa: E401
from pathlib import Path

import harness as h



def measure(job: dict) -> dict:
    import numpy as np
    from flashinfer_lite.kv_pages import KVCache, KVOptions
    model, tok, _ = h.load_model(job["gguf"], "dense", threads=job["threads"], ctx=job["ctx"])
    n, rows, ppl = job["prompt_tokens"], [], []
    filler = tok.encode((h.CORPUS / "wikitext2_test.txt").read_text()[:(n + job["ppl"]) * 8])
    cache = lambda r: KVCache(model.cfg, job["ctx"], options=KVOptions(prompt_pruning=r))  # noqa: E731
    [model.forward(part, kv) for kv in [cache(0.0)] for part in (filler[:64], filler[64:65])]   # kernels compile here
    for depth in job["depths"]:
        ids, key = h.passkey_ids(tok, filler, n, depth, job["ctx"])
        for r in job["ratios"]:
            kv = cache(r)
            t0, c0 = time.perf_counter(), time.process_time()
            out = [int(np.argmax(model.forward(ids, kv)))]
            ttft, cpu = time.perf_counter() - t0, time.process_time() - c0
            while len(out) < job["n_gen"]:
                out.append(int(np.argmax(model.forward([out[-1]], kv))))
            rows.append(dict(depth=depth, ratio=r, key=key, ttft_ms=round(ttft * 1e3), prompt_cpu_ms=round(cpu * 1e3),
                             answer=(said := tok.decode(out).strip()[:20]), found=str(key) in said))
    ids = filler[:n + job["ppl"]]
    for r in job["ratios"]:
        kv = cache(r)
        nll = -h.logp(model.forward(ids[:n], kv), ids[n])
        for at in range(n, len(ids) - 1, 16):
            x = model.forward(ids[at:min(at + 16, len(ids) - 1)], kv, all_logits=True)
            nll -= sum(h.logp(row, ids[at + 1 + i]) for i, row in enumerate(x))
        ppl.append({"ratio": r, "perplexity": round(math.exp(nll / (len(ids) - n)), 4), "pruned": kv.pruned.tolist()})
    return {"passkey": rows, "ppl": ppl}


def markdown(doc: dict) -> str:
    r, lines = doc["row"], []
    for p in r.get("ppl", []):
        d = [x for x in r["passkey"] if x["ratio"] == p["ratio"]]
        found, vs = sum(x["found"] for x in d), p["perplexity"] / r["ppl"][0]["perplexity"] - 1
        lines.append([p["ratio"], *(statistics.median(x[k] for x in d) for k in ("ttft_ms", "prompt_cpu_ms")),
                      f"{found}/{len(d)}", p["perplexity"], f"{vs:+.2%}"])
    return "\n".join([f"`{doc['command']}`", "", *h.table(["ratio", "TTFT ms (median)", "prompt CPU ms (median)",
                      "passkey found", "perplexity", "vs off"], lines)] if lines else [h.failed(r)])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", type=Path, required=True, help="GGUF")
    ap.add_argument("--ratios", default="0.5,0.7", help="pruning ratios besides 0 (off)")
    for flag, v in (("--prompt-tokens", 4000), ("--depths", 10), ("--ppl", 256), ("--n-gen", 8), ("--threads", 2)):
        ap.add_argument(flag, type=int, default=v)
    h.add_arguments(ap, "--job")
    a = ap.parse_args(argv)
    if a.worker:
        return h.worker(a.out, a.worker, lambda: measure(json.loads(a.job)))
    work = h.work_dir(a, "prompt-pruning-")
    job = dict(gguf=str(a.model.resolve()), prompt_tokens=a.prompt_tokens, ppl=a.ppl, n_gen=a.n_gen, threads=a.threads,
               ratios=[0.0] + [float(x) for x in a.ratios.split(",") if x], ctx=a.prompt_tokens + a.ppl + a.n_gen + 8,
               depths=[round((i + .5) / a.depths, 3) for i in range(a.depths)])    # 0.05 .. 0.95 for 10
    doc = {"command": h.command("prompt_pruning.py", argv), "machine": h.machine(),
           "row": h.run_row(__file__, "pruning", "pruning", None, work, ["-m", a.model, "--job", json.dumps(job)])}
    return h.emit(doc, markdown, a.md, None if a.keep else work)


if __name__ == "__main__":
    raise SystemExit(main())
