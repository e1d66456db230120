"""bench/part_times.py (not profile.py: that name shadows the standard library's profile module, which torch imports,
for every script run from bench/) runs from a clone and its parts add up to the total it reports; bench/ffn_cpu.py
(CPU time of a decoded token's FFN, modes alternating) shares its gated FLASHDIR."""
import pytest

from conftest import STORIES, run_bench


def test_profile_prints_parts_that_sum_to_the_total():
    doc, err = run_bench("part_times.py", "-m", STORIES, "-n", "6", timeout=300)
    assert doc["decode_tokens"] == 5 and doc["prompt_tokens"] > 0
    for key in ("decode_ms_per_token", "prompt_ms_per_token"):
        parts = doc[key]
        assert set(parts) == {"attention", "norms", "ffn", "lm_head", "python", "sampling", "total"}
        assert parts["attention"] > 0 and parts["ffn"] > 0
        assert abs(sum(v for k, v in parts.items() if k != "total") - parts["total"]) < 0.01
    assert "attention" in err
    # a dense FFN has no flash kernels to time apart (--ffn gate and predicted do: coefficients, down)
    assert doc["ffn_kernels_ms_per_token"] == {"decode": {}, "prompt": {}}


@pytest.fixture(scope="module")
def gated_flash(tiny_model, tmp_path_factory):
    """A tiny SiLU model's FLASHDIR with the exact gate calibrated (both benches' --ffn gate)."""
    from predictors.calibrate_gate import calibrate
    from storage.convert import convert
    flash = convert(tiny_model("llama-silu-gqa"), tmp_path_factory.mktemp("gated") / "flash", dtype="q8_0",
                    progress=False)
    calibrate(str(flash), n_tokens=64, progress=False)
    return flash


def test_the_exact_gates_kernels_are_timed_inside_the_ffn(gated_flash):
    """--ffn gate: the coefficients (every neuron's gate|up rows) and the down sums are timed apart, and they are part
    of the FFN's time, decode and prompt."""
    doc, _ = run_bench("part_times.py", "-m", gated_flash, "--ffn", "gate", "-n", "4", "-p", "Once upon a time",
                       timeout=300)
    for phase, key in (("decode", "decode_ms_per_token"), ("prompt", "prompt_ms_per_token")):
        k = doc["ffn_kernels_ms_per_token"][phase]
        assert set(k) == {"coefficients", "down"} and k["coefficients"] > 0 and k["down"] > 0
        assert k["coefficients"] + k["down"] <= doc[key]["ffn"]


def test_ffn_cpu_alternates_the_modes_and_times_the_gates_kernels_inside_its_ffn(gated_flash):
    """bench/ffn_cpu.py: every round runs each mode once; the ratios are to the first mode; the exact gate's two
    kernels are timed apart and lie inside its FFN's time, the dense FFN has none."""
    doc, err = run_bench("ffn_cpu.py", "-m", gated_flash, "--ffn", "dense,gate", "--rounds", "2",
                         "-p", "Once upon a time", timeout=300)
    cpu = doc["cpu_ms_per_token"]
    assert set(cpu) == {"dense", "gate"} and set(cpu["dense"]) == {"ffn"}
    assert set(cpu["gate"]) == {"ffn", "coefficients", "down"}
    assert cpu["gate"]["coefficients"] > 0 and cpu["gate"]["down"] > 0
    assert cpu["gate"]["coefficients"] + cpu["gate"]["down"] <= cpu["gate"]["ffn"]
    assert all(len(v) == 2 and min(v) > 0 for v in doc["rounds_ms"].values())
    assert doc["ratio_to_first"]["dense"] == 1.0
    g, d, h = cpu["gate"]["ffn"], cpu["dense"]["ffn"], 0.0005     # printed to 3 decimals: each within h of its own
    assert (g - h) / (d + h) - h <= doc["ratio_to_first"]["gate"] <= (g + h) / (d - h) + h
    assert "gate" in err
