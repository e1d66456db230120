#!/usr/bin/env python3
"""The default model's GGUF re-quantized by llama.cpp's own quantizer into Q4_K_M, Q5_K_M and Q6_K (issue #27), and
what each file holds: tensor types by matrix, file size. JSON on stdout.

    PYTHONPATH=. python tools/make_kquants.py [-m GGUF] [-o DIR] [--types q4_k_m,q5_k_m,q6_k]

Needs llama-cpp-python (the `bench` extra): llama_model_quantize with allow_requantize, from the Q4_1 file as a user
would (llama.cpp dequantizes and rounds again). The files are written into DIR (default: next to the source, under
the flashinfer-lite cache) and reused when present.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from pathlib import Path

FTYPES = {"q4_k_m": 15, "q5_k_m": 17, "q6_k": 18}     # llama_ftype values (llama.h)


def quantize(src: Path, dest: Path, ftype: int) -> None:
    import llama_cpp
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.allow_requantize = True
    params.nthread = os.cpu_count() or 1
    tmp = dest.with_suffix(".tmp")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), params)
    if rc != 0:
        tmp.unlink(missing_ok=True)
        raise SystemExit(f"llama_model_quantize failed ({rc}) for {dest.name}")
    os.replace(tmp, dest)


def summary(path: Path) -> dict:
    """Tensor types by role (ffn_gate, ffn_down, attn_v, token_embd, ...) and the file size."""
    import gguf
    r = gguf.GGUFReader(str(path), "r")
    roles: dict[str, Counter] = {}
    for t in r.tensors:
        role = t.name.split(".")[-2] if t.name.startswith("blk.") else t.name.rsplit(".", 1)[0]
        roles.setdefault(role, Counter())[t.tensor_type.name] += 1
    return {"path": str(path), "bytes": path.stat().st_size, "types": {k: dict(v) for k, v in sorted(roles.items())}}


def main() -> None:
    from flashinfer_lite.default_model import default_model_path
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", type=Path, default=None, help="source GGUF (default: the default model's)")
    ap.add_argument("-o", "--out", type=Path, default=None, help="directory for the files (default: the source's)")
    ap.add_argument("--types", default=",".join(FTYPES), help=f"comma-separated, of {', '.join(FTYPES)}")
    args = ap.parse_args()
    src = args.model or default_model_path()
    out = args.out or src.parent
    out.mkdir(parents=True, exist_ok=True)
    res = {"source": summary(src), "files": {}}
    for name in args.types.split(","):
        if name not in FTYPES:
            raise SystemExit(f"unknown type {name!r} (choose from {', '.join(FTYPES)})")
        dest = out / f"{src.stem.rsplit('.', 1)[0]}.{name.upper()}.gguf"
        if not dest.exists():
            print(f"quantizing {dest.name}", file=sys.stderr)
            quantize(src, dest, FTYPES[name])
        res["files"][name] = summary(dest)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
