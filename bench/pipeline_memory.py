#!/usr/bin/env python3
"""Peak memory and time of every pipeline stage against the layer count, at Llama-2-7B width: flat lines expected.

    PYTHONPATH=. python bench/pipeline_memory.py --dir $BIG/pipeline [--layers 4,8,16,32] [--tokens 512]
    PYTHONPATH=. python bench/pipeline_memory.py --quick      # 1 and 2 layers of width 512, < 1 minute

For each layer count: tools/make_large_model.py writes an HF checkpoint (dim 4096, ffn 11008, 32 heads of 128,
8 KV heads, f16, FATReLU at ~10% active), then each stage runs as its own process:
  convert            HF -> FLASHDIR (f16)
  collect            --tokens over tests/data/corpus (layer-streamed)
  train-predictor    low-rank predictors (rank 32) from those activations
  eval               --ffn dense: the layer-streamed dense reference perplexity
  generate           --ffn predicted at the smallest DRAM budget it accepts plus a quarter of ffn.bin, -n 8
Peak memory is the process's own high-water mark (os.wait4's ru_maxrss of that child: this script stays small, so
what a child inherits from it is a few tens of MiB). Prints one JSON document on stdout, a markdown table on stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness as h

from storage.files import disk_bytes  # noqa: E402

REPO, CORPUS = h.REPO, h.CORPUS
CLI = [sys.executable, "-m", "flashinfer_lite"]
STAGES = ("convert", "collect", "train-predictor", "eval", "generate")


def peak_of(args: list[str]) -> dict:
    """Run one stage as a child process: its peak RSS (the resource usage of exactly that child) and wall time."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        p = subprocess.Popen(args, stdout=out, stderr=err, env=dict(os.environ, PYTHONPATH=str(REPO)))
        _, status, usage = os.wait4(p.pid, 0)       # not p.wait(): wait4 also gives the child's rusage
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        if p.returncode != 0:
            raise SystemExit(f"{' '.join(str(a) for a in args[3:5])} failed: {err.read().decode()[-1500:]}")
        return {"peak_mib": round(usage.ru_maxrss / 1024, 1), "seconds": round(time.perf_counter() - t0, 1),
                "stdout": out.read().decode()}


def measure(work: Path, layers: int, shape: list[str], tokens: int) -> dict:
    hf, flash, acts = work / f"hf-{layers}", work / f"flash-{layers}", work / f"acts-{layers}"
    for p in (hf, flash, acts):
        shutil.rmtree(p, ignore_errors=True)
    subprocess.run([sys.executable, str(REPO / "tools" / "make_large_model.py"), str(hf), "--layers", str(layers),
                    *shape, "--check-tokens", "0"], check=True, stdout=subprocess.DEVNULL,
                   env=dict(os.environ, PYTHONPATH=str(REPO)))
    row = {"layers": layers, "hf_bytes": disk_bytes(hf)}
    row["convert"] = peak_of([*CLI, "convert", str(hf), "-o", str(flash)])
    row["flash_bytes"] = disk_bytes(flash)
    row["collect"] = peak_of([*CLI, "collect", "-m", str(hf), "--corpus", str(CORPUS / "wikitext2_valid.txt"),
                              "--tokens", str(tokens), "-o", str(acts)])
    row["train-predictor"] = peak_of([*CLI, "train-predictor", str(acts), "-o", str(flash), "--steps", "50",
                                      "--rank", "32", "--max-rank", "32"])
    row["eval"] = peak_of([*CLI, "eval", "-m", str(flash), "--ffn", "dense", "--corpus",
                           str(CORPUS / "wikitext2_test.txt"), "--tokens", "256", "--json"])
    row["eval"]["perplexity"] = json.loads(row["eval"].pop("stdout"))["dense_perplexity"]
    gen = [*CLI, "generate", "-m", str(flash), "--ffn", "predicted", "-c", "256", "-p", "Once upon a time", "-n", "8",
           "--temp", "0", "--json", "--dram-budget"]
    # the smallest budget the runtime accepts (its one-line refusal names it) plus a quarter of the FFN
    refusal = subprocess.run([*gen, "1M"], capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    minimum = float(h.MINIMUM_RE.search(refusal.stderr).group(1))
    budget = int(minimum * 2**20) + (flash / "ffn.bin").stat().st_size // 4
    row["generate"] = peak_of([*gen, str(budget)])
    g = json.loads(row["generate"].pop("stdout").strip().splitlines()[-1])
    row["generate"].update(budget_mib=round(budget / 2**20, 1), mb_read_per_token=g["flash"]["mb_read_per_token"])
    for s in STAGES:
        row[s].pop("stdout", None)
    for p in (hf, flash, acts):
        shutil.rmtree(p, ignore_errors=True)
    print(f"  {layers} layers: " + ", ".join(f"{s} {row[s]['peak_mib']:.0f} MiB" for s in STAGES), file=sys.stderr)
    return row


def markdown(rows: list[dict]) -> str:
    """Peak MiB (seconds) per stage; generate's budget grows with the model (it is the runtime's minimum, which
    holds the resident weights, plus a quarter of ffn.bin), so its peak is shown next to that budget."""
    return "\n".join(h.table(["layers", "files GiB", *(f"{s} peak MiB (s)" for s in STAGES), "generate budget MiB"],
                             [[r["layers"], f"{r['hf_bytes'] / 2**30:.2f}",
                               *(f"{r[s]['peak_mib']:.0f} ({r[s]['seconds']:.0f})" for s in STAGES),
                               f"{r['generate']['budget_mib']:.0f}"] for r in rows]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, help="work directory for the models (large; removed per layer count)")
    ap.add_argument("--layers", default="4,8,16,32")
    ap.add_argument("--tokens", type=int, default=512, help="collect's tokens")
    ap.add_argument("--quick", action="store_true", help="1 and 2 layers of width 512 (smoke test)")
    a = ap.parse_args(argv)
    shape = ["--dim", "4096", "--ffn", "11008", "--heads", "32", "--kv-heads", "8", "--head-dim", "128"]
    if a.quick:
        a.layers, a.tokens = "1,2", 128
        shape = ["--dim", "512", "--ffn", "1376", "--heads", "4", "--kv-heads", "2"]
    if not a.dir and not a.quick:
        ap.error("--dir is required (or --quick)")
    work = a.dir or Path(tempfile.mkdtemp(prefix="pipeline-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rows = [measure(work, int(n), shape, a.tokens) for n in a.layers.split(",")]
    doc = {"shape": shape, "tokens": a.tokens, "load_avg": os.getloadavg(), "rows": rows,
           "seconds": round(time.perf_counter() - t0, 1), "command": h.command("pipeline_memory.py", argv)}
    return h.emit(doc, lambda d: markdown(d["rows"]), None, work if a.quick else None)


if __name__ == "__main__":
    sys.exit(main())
