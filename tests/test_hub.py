"""-m ORG/NAME[:TAG] against a Hugging Face hub cache built here as huggingface_hub lays it out (blobs, snapshots of
symlinks, refs/main) around the models the tests have: stories260K (an HF directory) and SmolLM2's GGUF."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import STORIES

REPO = Path(__file__).resolve().parents[1]


def hub_repo(hub: Path, repo: str, files: dict[str, Path], revision: str = "0123abcd") -> Path:
    """models--ORG--NAME with files (name -> source) as blobs, a snapshot of symlinks to them, refs/main."""
    d = hub / f"models--{repo.replace('/', '--')}"
    snap = d / "snapshots" / revision
    snap.mkdir(parents=True)
    (d / "blobs").mkdir()
    for i, (name, src) in enumerate(files.items()):
        blob = d / "blobs" / f"blob{i:040d}"
        try:                        # a blob is a file of its own, named by its hash: no .gguf suffix
            os.link(src, blob)
        except OSError:             # another file system
            shutil.copy(src, blob)
        os.symlink(os.path.relpath(blob, snap), snap / name)
    (d / "refs").mkdir()
    (d / "refs" / "main").write_text(revision)
    (d / "snapshots" / "old-revision").mkdir()       # refs/main, not the only snapshot, names the one
    return snap


@pytest.fixture
def hub(tmp_path, smollm2_gguf):
    h = tmp_path / "hub"
    hub_repo(h, "karpathy/stories260K", {p.name: p for p in STORIES.iterdir() if p.is_file()})
    hub_repo(h, "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF", {"smollm2-135m-instruct-q4_1.gguf": smollm2_gguf,
                                                              "smollm2-135m-instruct-q8_0.gguf": smollm2_gguf})
    hub_repo(h, "HuggingFaceTB/SmolLM2-one-GGUF", {"smollm2-135m-instruct-q4_1.gguf": smollm2_gguf})
    return h


def run(*args, env):
    r = subprocess.run([sys.executable, "-m", "flashinfer_lite", *args], capture_output=True, timeout=600, cwd=REPO,
                       env=dict(os.environ, **env))
    return r.returncode, r.stdout.decode(), r.stderr.decode()


def generated(model: str, env: dict) -> dict:
    code, out, err = run("generate", "-m", model, "-p", "Once upon a time", "-n", "8", "--temp", "0", "--json",
                         "--ignore-chat-template", "--ffn", "dense", env=env)
    assert code == 0, err
    return json.loads(out.strip().splitlines()[-1])


def test_a_repo_id_runs_the_model_in_the_hub_cache(hub, smollm2_gguf, tmp_path):
    env = {"HF_HUB_CACHE": str(hub), "FLASHINFER_LITE_CACHE": str(tmp_path / "cache")}
    assert generated("karpathy/stories260K", env)["tokens"] == generated(str(STORIES), env)["tokens"]
    want = generated(str(smollm2_gguf), env)["tokens"]
    assert generated("HuggingFaceTB/SmolLM2-135M-Instruct-GGUF:Q4_1", env)["tokens"] == want
    assert generated("HuggingFaceTB/SmolLM2-one-GGUF", env)["tokens"] == want        # its one GGUF, no tag needed
    # HF_HOME/hub when HF_HUB_CACHE is not set
    home = {"HF_HOME": str(hub.parent), "HF_HUB_CACHE": "", "FLASHINFER_LITE_CACHE": env["FLASHINFER_LITE_CACHE"]}
    assert (hub.parent / "hub") == hub
    assert generated("karpathy/stories260K", home)["tokens"] == generated(str(STORIES), env)["tokens"]


def test_what_the_hub_cache_lacks_is_one_line(hub):
    env = {"HF_HUB_CACHE": str(hub)}
    for model, says in [
        ("Qwen/Qwen2.5-0.5B-Instruct", f"model not found: Qwen/Qwen2.5-0.5B-Instruct is neither a path nor in the "
                                       f"Hugging Face cache ({hub}/models--Qwen--Qwen2.5-0.5B-Instruct); download "
                                       f"it: huggingface-cli download Qwen/Qwen2.5-0.5B-Instruct"),
        ("Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M", 'huggingface-cli download Qwen/Qwen2.5-0.5B-Instruct-GGUF '
                                                   '--include "*Q4_K_M*.gguf"'),
        ("HuggingFaceTB/SmolLM2-135M-Instruct-GGUF", "holds 2 GGUF files: smollm2-135m-instruct-q4_1.gguf, "
                                                     "smollm2-135m-instruct-q8_0.gguf; pick one by its quantization"),
        ("HuggingFaceTB/SmolLM2-135M-Instruct-GGUF:Q5_K_M", "has no .gguf file named with 'Q5_K_M': it has "
                                                            "smollm2-135m-instruct-q4_1.gguf, "
                                                            "smollm2-135m-instruct-q8_0.gguf"),
    ]:
        code, out, err = run("generate", "-m", model, "-p", "hi", "-n", "1", env=env)
        lines = err.strip().splitlines()
        assert code == 1 and len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], (model, err)
