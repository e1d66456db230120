"""A GGUF of a tiny transformers mixture of experts, written as llama.cpp's converter lays one out (tests only)."""
from pathlib import Path

import numpy as np

from make_large_model import add_llama_metadata, permute_qk
from storage.checkpoint import open_checkpoint

# canonical name part -> GGUF name part
PARTS = {"attn_norm": "attn_norm", "ffn_norm": "ffn_norm", "attn.q": "attn_q", "attn.k": "attn_k", "attn.v": "attn_v",
         "attn.o": "attn_output", "attn.q_norm": "attn_q_norm", "attn.k_norm": "attn_k_norm",
         "ffn.router": "ffn_gate_inp", "ffn.shared.gate": "ffn_gate_shexp", "ffn.shared.up": "ffn_up_shexp",
         "ffn.shared.down": "ffn_down_shexp", "ffn.shared_gate": "ffn_gate_inp_shexp"}
TOP = {"embed.weight": "token_embd.weight", "lm_head.weight": "output.weight", "norm.weight": "output_norm.weight"}


def write_moe_gguf(hf_dir: Path, out: Path, arch: str, expert_type: str = "F32") -> Path:
    """arch: llama (Mixtral), qwen2moe or qwen3moe. Every tensor float32 but the experts' 3-D tensors, in
    expert_type (F32, Q8_0, Q4_0)."""
    import gguf
    ck = open_checkpoint(hf_dir)
    c = ck.config
    w = gguf.GGUFWriter(str(out), arch)
    add_llama_metadata(w, c.n_layers, c.max_pos, c.dim, c.ffn_dim, c.n_heads, c.n_kv_heads, c.norm_eps, c.rope_theta)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_expert_count(c.n_experts)
    w.add_expert_used_count(c.n_experts_used)
    if arch != "llama":
        w.add_expert_feed_forward_length(c.ffn_dim)
    if c.shared_expert_dim:
        w.add_expert_shared_feed_forward_length(c.shared_expert_dim)
    for name in ck.names():
        if ".experts." in name:
            continue
        t = ck.tensor(name)
        if name in TOP:
            gname = TOP[name]
        else:
            _, i, rest = name.split(".", 2)
            part, kind = rest.rsplit(".", 1)
            gname = f"blk.{i}.{PARTS[part]}.{kind}"
        if arch == "llama" and name.endswith(("attn.q.weight", "attn.k.weight")):
            t = permute_qk(t, c.n_heads if ".q." in name else c.n_kv_heads)
        if name.endswith("shared_gate.weight"):
            t = t.reshape(-1)
        w.add_tensor(gname, np.ascontiguousarray(t, np.float32))
    Q = gguf.GGMLQuantizationType[expert_type]
    for i in range(c.n_layers):
        for m in ("gate", "up", "down"):
            t = np.stack([ck.tensor(f"layers.{i}.ffn.experts.{e}.{m}.weight") for e in range(c.n_experts)])
            data = t if Q == gguf.GGMLQuantizationType.F32 else gguf.quants.quantize(t, Q)
            w.add_tensor(f"blk.{i}.ffn_{m}_exps.weight", data, raw_dtype=Q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
