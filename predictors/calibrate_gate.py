"""Calibrate the exact gate's thresholds (ffn.gate) of a FLASHDIR with the split layout: `python -m
predictors.calibrate_gate FLASHDIR [--tokens N]`; the runtime does the same (runtime.calibrate_gate) on a FLASHDIR's
first exact-gate run, in its own process and under its budget.

The model runs with no threshold (every coefficient counts) over N tokens of the built-in calibration text
(calibration.txt, written for the project; never an evaluation text), each layer's coefficients |act(gate.x) * up.x|
seen as the runtime's own kernel computes them. Per layer and sparsity s in SPARSITIES, the threshold is the
s-quantile of those magnitudes, so a share s of them falls under it (the kernel drops |c| <= t), and a neuron's
frequency is the share of tokens it cleared it (ffn.gate.measure_thresholds). Written to FLASHDIR/gate.json
(storage.gate_file).
"""
from __future__ import annotations

import argparse
import sys

from flashinfer_lite.ffn.gate import CALIBRATION_CTX, CALIBRATION_TOKENS
from flashinfer_lite.runtime import calibrate_gate, open_model_files
from storage.errors import child_exit_code


def calibrate(flashdir: str, n_tokens: int = CALIBRATION_TOKENS, progress: bool = True) -> None:
    calibrate_gate(open_model_files(flashdir, "gate", verify=False, base_bytes=0), None, n_tokens, progress)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m predictors.calibrate_gate", description=__doc__.split("\n\n")[0])
    p.add_argument("flashdir")
    p.add_argument("--tokens", type=int, default=CALIBRATION_TOKENS)
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args(argv)
    if a.tokens < CALIBRATION_CTX:
        print(f"error: --tokens must be at least {CALIBRATION_CTX}", file=sys.stderr)
        return 2
    return child_exit_code(lambda: calibrate(a.flashdir, a.tokens, progress=not a.quiet and sys.stderr.isatty()))


if __name__ == "__main__":
    sys.exit(main())
