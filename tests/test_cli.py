"""The command line as a user meets it: exit codes, one-line errors, JSON output against the oracle."""
import json
import os
import shutil
import subprocess
import sys


from conftest import STORIES, transformers_model



def cli(*args, stdin=None):
    env = dict(os.environ, PYTHONIOENCODING="utf-8")
    return subprocess.run([sys.executable, "-m", "flashinfer_lite", *args], capture_output=True, env=env,
                          input=stdin, timeout=300)


def assert_one_line_error(r, *fragments):
    err = r.stderr.decode("utf-8", "replace").strip()
    assert r.returncode == 1, err
    assert "Traceback" not in err
    # the one status line `--ffn auto` prints once the model has loaded is not part of the error
    err = "\n".join(ln for ln in err.splitlines() if not ln.startswith("ffn: dense (--ffn auto"))
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    for f in fragments:
        assert f in err, err


def test_generate_json_equals_transformers_greedy():
    import torch
    r = cli("generate", "-m", str(STORIES), "-p", "Once upon a time", "-n", "40", "--temp", "0", "--json")
    assert r.returncode == 0, r.stderr.decode()
    out = json.loads(r.stdout.decode().strip().splitlines()[-1])
    hf = transformers_model(STORIES)
    ids = out["prompt_tokens"]
    want = hf.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False)[0].tolist()[len(ids):]
    assert out["tokens"] == want
    assert out["text"].startswith(", there was a little girl")
    assert out["timings"]["eval_tokens"] == 39 and out["timings"]["prompt_tokens"] == len(ids)
    assert out["timings"]["first_token_ms"] >= out["timings"]["prompt_ms"] > 0   # the prompt, then the sampling


def test_generate_streams_text_and_prints_llama_cpp_timings():
    r = cli("generate", "-m", str(STORIES), "-p", "Once upon a time", "-n", "12", "--temp", "0")
    assert r.returncode == 0
    assert r.stdout.decode().startswith("Once upon a time, there was a little girl")
    err = r.stderr.decode()
    for line in ("load time =", "prompt eval time =", "first token time =", "eval time =", "ms per token",
                 "tokens per second", "P99"):
        assert line in err


def test_seeded_sampling_is_reproducible_and_seed_dependent():
    runs = [json.loads(cli("generate", "-m", str(STORIES), "-p", "Once", "-n", "30", "--temp", "1.0",
                           "--seed", s, "--json").stdout)["tokens"] for s in ("7", "7", "8")]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_missing_model_directory(tmp_path):
    assert_one_line_error(cli("generate", "-m", str(tmp_path / "nope"), "-p", "hi"), "model not found")


def test_unknown_architecture(tiny_model, tmp_path):
    d = shutil.copytree(tiny_model("llama-relu"), tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    assert_one_line_error(cli("generate", "-m", str(d), "-p", "hi"), "GPTNeoXForCausalLM", "unsupported architecture")


def test_unsupported_activation_is_named(tiny_model, tmp_path):
    d = shutil.copytree(tiny_model("llama-relu"), tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["hidden_act"] = "gelu_new"
    (d / "config.json").write_text(json.dumps(cfg))
    assert_one_line_error(cli("generate", "-m", str(d), "-p", "hi"), "gelu_new")


def test_truncated_safetensors(tmp_path):
    d = shutil.copytree(STORIES, tmp_path / "m")
    f = d / "model.safetensors"
    os.chmod(f, 0o644)
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    assert_one_line_error(cli("generate", "-m", str(d), "-p", "hi"), "truncated safetensors")


def test_corrupt_safetensors_header(tmp_path):
    d = shutil.copytree(STORIES, tmp_path / "m")
    f = d / "model.safetensors"
    os.chmod(f, 0o644)
    f.write_bytes((2**40).to_bytes(8, "little") + b"{}")
    assert_one_line_error(cli("generate", "-m", str(d), "-p", "hi"), "not a valid safetensors file")


def test_index_naming_a_file_outside_the_model_dir(tmp_path):
    d = shutil.copytree(STORIES, tmp_path / "m")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../../etc/passwd"}}))
    assert_one_line_error(cli("generate", "-m", str(d), "-p", "hi"), "path outside the directory")


def test_prompt_longer_than_context():
    r = cli("generate", "-m", str(STORIES), "-p", "Once upon a time " * 20, "-c", "16")
    assert_one_line_error(r, "prompt is too long", "context is 16")


def test_context_larger_than_model_allows():
    assert_one_line_error(cli("generate", "-m", str(STORIES), "-p", "hi", "-c", "100000"), "exceeds the model's maximum")


def test_non_utf8_prompt_file_and_argument(tmp_path):
    f = tmp_path / "p.txt"
    f.write_bytes(b"Once upon \xff\xfe a time")
    assert_one_line_error(cli("generate", "-m", str(STORIES), "-f", str(f)), "not valid UTF-8")
    r = subprocess.run([sys.executable, "-m", "flashinfer_lite", "generate", "-m", str(STORIES).encode(), "-p",
                        b"bad \xff byte"], capture_output=True, timeout=120)
    assert_one_line_error(r, "not valid UTF-8")


def test_not_a_gguf_file(tmp_path):
    f = tmp_path / "x.gguf"
    f.write_bytes(b"GGUF" + os.urandom(64))
    assert_one_line_error(cli("generate", "-m", str(f), "-p", "hi"), "not a valid GGUF file")


def test_runtime_path_does_not_import_torch():
    code = ("import sys; from flashinfer_lite.cli import main; "
            f"main(['generate', '-m', {str(STORIES)!r}, '-p', 'Once', '-n', '3', '--json']); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr.decode()


def test_a_raw_continuation_keeps_the_space_at_the_join():
    """SentencePiece drops a leading space when a continuation is decoded alone ("Once upon" + "▁a" -> "Once upona").
    Stream and --json text must equal the tokenizer's decoding of prompt + continuation as one sequence."""
    from flashinfer_lite.model import load_reference
    _, tok = load_reference(STORIES)
    r = cli("generate", "-m", str(STORIES), "-p", "Once upon", "-n", "12", "--temp", "0", "--json")
    assert r.returncode == 0, r.stderr.decode()
    out = json.loads(r.stdout.decode().strip().splitlines()[-1])
    whole = tok.decode(out["prompt_tokens"] + out["tokens"])
    assert whole.startswith("Once upon ") and not whole.startswith("Once upon,")   # the case the bug hid in
    assert "Once upon" + out["text"] == whole
    r = cli("generate", "-m", str(STORIES), "-p", "Once upon", "-n", "12", "--temp", "0")
    assert r.stdout.decode().rstrip("\n") == whole


def test_prompt_from_stdin_reverse_prompt_and_one_prompt_only(tmp_path):
    r = cli("generate", "-m", str(STORIES), "-p", "-", "-n", "12", "--temp", "0", "--json", stdin=b"Once upon")
    assert r.returncode == 0, r.stderr.decode()
    full = json.loads(r.stdout.decode().strip().splitlines()[-1])
    r = cli("generate", "-m", str(STORIES), "-p", "Once upon", "-n", "12", "--temp", "0", "--json")
    assert json.loads(r.stdout.decode().strip().splitlines()[-1])["tokens"] == full["tokens"]   # same as -p TEXT
    (tmp_path / "p.txt").write_text("Once upon")
    r = cli("generate", "-m", str(STORIES), "-p", "x", "-f", str(tmp_path / "p.txt"))
    assert r.returncode == 1 and r.stderr.decode().strip() == "error: give the prompt once: -p TEXT or -f FILE, not both"
    # -r: stops at the first output that contains the text; the same tokens up to there
    word = full["text"].split()[2]
    r = cli("generate", "-m", str(STORIES), "-p", "Once upon", "-n", "12", "--temp", "0", "--json", "-r", word)
    got = json.loads(r.stdout.decode().strip().splitlines()[-1])
    assert word in got["text"] and got["stopped"] == f"reverse prompt {word!r}"
    assert got["tokens"] == full["tokens"][: len(got["tokens"])] and len(got["tokens"]) < len(full["tokens"])
