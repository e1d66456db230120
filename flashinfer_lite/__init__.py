"""flashinfer-lite: run LLMs whose FFN weights stay on flash."""
import os

# Thread pools, before numpy/numba load (a user's explicit setting wins). OpenBLAS threads busy-wait between calls
# and take the cores from the Numba kernels and the reader threads: one BLAS thread was faster than the default in
# every decode and prefill measured here (bench/resident_gemv.py). Numba's workqueue layer does not spin either.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("NUMBA_THREADING_LAYER", "workqueue")

__version__ = "0.1.0"
