"""Issue 46: batched decoding. One `flashinfer-lite serve --parallel 4` under a --dram-budget, then rounds of 1, 2 and
4 concurrent clients (loopback, greedy, --ignore-eos: every answer max_tokens long): aggregate tokens per second of
the round (completion tokens / its wall time, prompts included) and the flash MB read per token per sequence (the
server's flash_read_bytes_total over the round / its completion tokens): a batch of B reads each layer's rows once
for the union of the neurons its B tokens need. Times on a shared machine are noisy (the load average is recorded);
the MB per token is the robust figure.
    PYTHONPATH=. python bench/batch_decode.py GGUF --dram-budget 300M [--tokens 32] [--rounds 2] [--md FILE]"""
import argparse
import json
import re
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from harness import REPO, command, emit, fmt, machine, table

PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):", "Water boils at",
           "My favourite book is", "In 1969, the first"]


def start(a) -> tuple[subprocess.Popen, str]:
    """The server, up: (its process, its base URL)."""
    cmd = [sys.executable, "-m", "flashinfer_lite", "serve", "-m", str(a.model), "--parallel", str(max(a.clients)),
           "--dram-budget", a.dram_budget, "--ffn", a.ffn, "-c", str(a.ctx), "--ignore-eos", "--port", "0"]
    p = subprocess.Popen(cmd, cwd=REPO, stderr=subprocess.PIPE, text=True)
    for line in p.stderr:
        print(line, end="", file=sys.stderr)
        m = re.search(r"^serving .* on (http://127\.0\.0\.1:\d+)/v1 ", line)
        if m:    # its request log read on, so the pipe never fills
            threading.Thread(target=lambda: [print(x, end="", file=sys.stderr) for x in p.stderr], daemon=True).start()
            return p, m.group(1)
    raise SystemExit(f"serve exited {p.wait()} before it served")


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=60) as r:
        return r.read().decode()


def metric(url: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^flashinfer_lite_{name}(?:{{.*}})? (\S+)$", get(url + "/metrics"), re.M))


def complete(url: str, prompt: str, n: int) -> int:
    body = json.dumps({"prompt": prompt, "max_tokens": n, "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as r:
        return json.loads(r.read())["usage"]["completion_tokens"]


def round_of(url: str, clients: int, n: int) -> dict:
    """clients requests at once, each a prompt of its own; their completion tokens, wall time and flash bytes."""
    read0 = metric(url, "flash_read_bytes_total")
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        tokens = sum(pool.map(lambda i: complete(url, PROMPTS[i % len(PROMPTS)], n), range(clients)))
    wall = time.perf_counter() - t0
    return {"tokens": tokens, "wall_s": wall, "read_bytes": metric(url, "flash_read_bytes_total") - read0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--dram-budget", required=True)
    ap.add_argument("--ffn", default="gate")
    ap.add_argument("-c", "--ctx", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=32, help="max_tokens of each request")
    ap.add_argument("--rounds", type=int, default=2, help="rounds per client count (the best time is kept)")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--md", type=Path)
    a = ap.parse_args(argv)
    doc = {"command": command("batch_decode.py", argv), "machine": machine(), "model": a.model.name,
           "dram_budget": a.dram_budget, "ffn": a.ffn, "tokens": a.tokens, "rows": []}
    p, url = start(a)
    try:
        complete(url, "Hello", 2)      # the first request's one-time costs stay out of the rows
        for c in a.clients:
            runs = [round_of(url, c, a.tokens) for _ in range(a.rounds)]
            best = min(runs, key=lambda r: r["wall_s"])
            tokens, read = sum(r["tokens"] for r in runs), sum(r["read_bytes"] for r in runs)
            doc["rows"].append({"clients": c, "tokens_per_s": round(best["tokens"] / best["wall_s"], 3),
                                "tokens_per_s_all": [round(r["tokens"] / r["wall_s"], 3) for r in runs],
                                "MB_per_token_per_sequence": round(read / tokens / 1e6, 2)})
            print(f"  {c} clients: {doc['rows'][-1]}", file=sys.stderr)
        steps = dict(re.findall(r'^flashinfer_lite_batch_steps_total{sequences="(\d+)"} (\S+)$', get(url + "/metrics"),
                                re.M))
        doc["batch_steps"] = {k: int(float(v)) for k, v in steps.items()}
        status = Path(f"/proc/{p.pid}/status").read_text()
        doc["server_peak_rss_mib"] = round(int(re.search(r"VmHWM:\s+(\d+)", status).group(1)) / 1024, 1)
    finally:
        p.terminate()
        p.wait(30)
    one = doc["rows"][0]["tokens_per_s"]
    for r in doc["rows"]:
        r["speedup"] = round(r["tokens_per_s"] / one, 2)
    return emit(doc, markdown, a.md, None)


def markdown(doc: dict) -> str:
    m = doc["machine"]
    lines = [f"`{doc['command']}`", "",
             f"{doc['model']}, --ffn {doc['ffn']}, --dram-budget {doc['dram_budget']} (server peak RSS "
             f"{doc['server_peak_rss_mib']} MiB), {doc['tokens']} tokens a request; load average "
             f"{m['load_avg_start'][0]:.2f} at the start, {m['load_avg_end'][0]:.2f} at the end; batched steps by "
             f"sequences: {doc['batch_steps']}", ""]
    rows = [[r["clients"], fmt(r["tokens_per_s"], 2), " / ".join(fmt(v, 2) for v in r["tokens_per_s_all"]),
             fmt(r["speedup"], 2), fmt(r["MB_per_token_per_sequence"], 2)] for r in doc["rows"]]
    return "\n".join(lines + table(["clients", "aggregate tokens/s (best)", "each round", "vs 1 client",
                                    "flash MB / token / sequence"], rows))


if __name__ == "__main__":
    sys.exit(main())
