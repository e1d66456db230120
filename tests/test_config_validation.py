"""Impossible config.json numbers are refused in one line, before convert writes anything (issue 15)."""
import json
import resource
import shutil
import subprocess
import sys

import pytest

from conftest import STORIES
from storage.errors import UserError
from storage.config import ModelConfig

BAD = {
    "num_hidden_layers=-1": ({"num_hidden_layers": -1}, "num_hidden_layers"),
    "head_dim=-8": ({"head_dim": -8}, "head_dim"),
    "num_attention_heads=0": ({"num_attention_heads": 0}, "num_attention_heads"),
    "num_key_value_heads=3": ({"num_key_value_heads": 3}, "key/value heads"),
    "hidden_size='64'": ({"hidden_size": "64"}, "hidden_size"),
    "vocab_size=true": ({"vocab_size": True}, "vocab_size"),
    "intermediate_size=0.5": ({"intermediate_size": 0.5}, "intermediate_size"),
    "head_dim=7 (odd, RoPE)": ({"head_dim": 7}, "even head_dim"),
    "rms_norm_eps=-1": ({"rms_norm_eps": -1.0}, "norm_eps"),
    "bos_token_id=9999": ({"bos_token_id": 9999}, "bos token id"),
    "eos_token_id=-3": ({"eos_token_id": -3}, "eos token id -3 outside the vocabulary (0..511)"),
    "eos_token_id=512": ({"eos_token_id": 512}, "eos token id 512 outside the vocabulary (0..511)"),
    "eos_token_id=[2, '2']": ({"eos_token_id": [2, "2"]}, "eos token id '2'"),
    # every expected tensor name was listed before the first was looked for: GBs, then MemoryError
    "num_hidden_layers=2**32-1": ({"num_hidden_layers": 2**32 - 1}, "'num_hidden_layers' is 4294967295"),
}
MEMORY_CAP = 4 << 30        # address space: an unbounded header field fails fast instead of filling the machine


@pytest.mark.parametrize("case", list(BAD))
def test_convert_refuses_an_impossible_config_and_writes_nothing(case, tmp_path):
    change, says = BAD[case]
    src = shutil.copytree(STORIES, tmp_path / "model")
    cfg_path = src / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(change)
    cfg_path.chmod(0o644)
    cfg_path.write_text(json.dumps(cfg))
    out = tmp_path / "out.flash"
    r = subprocess.run([sys.executable, "-m", "flashinfer_lite", "convert", str(src), "-o", str(out)],
                       capture_output=True, text=True, timeout=120,
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP)))
    assert r.returncode != 0
    err = r.stderr.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and says in err, err
    assert "Traceback" not in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]       # no FLASHDIR, no temp directory


def test_every_source_goes_through_the_same_checks():
    """GGUF metadata and a FLASHDIR's manifest build the same dataclass, so they get the same refusals."""
    good = dict(arch="llama", vocab_size=16, dim=8, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=4, ffn_dim=8)
    ModelConfig(**good)
    for bad in ({"n_layers": 0}, {"n_kv_heads": 3}, {"dim": 8.0}, {"act": "gelu"}, {"norm": "batch"},
                {"arch": "gpt2"}, {"sliding_window": 0}, {"rope_theta": float("nan")}):
        with pytest.raises(UserError, match="invalid model config"):
            ModelConfig(**{**good, **bad})
