"""flashinfer-lite: run LLMs whose FFN weights stay on flash."""
import os

# Thread pools, before numpy/numba load (a user's explicit setting wins). OpenBLAS threads busy-wait between calls
# and take the cores from the Numba kernels and the reader threads: one BLAS thread was faster than the default in
# every decode and prefill measured here (bench/resident_gemv.py, a closed study: bench/README.md). Numba's pool: OpenMP where it loads, as a decode
# step launches ~32 parallel regions and the workqueue layer's threads take ~0.2 ms each to wake (SmolLM2 in RAM:
# 17 ms/token on workqueue, 7.5 on OpenMP); its threads spin only ~20k rounds before they sleep, so little CPU is
# taken from the reader threads or other processes (bench/part_times.py, bench/README.md).
BLAS_THREADS_FROM_USER = "OPENBLAS_NUM_THREADS" in os.environ
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("NUMBA_THREADING_LAYER_PRIORITY", "omp workqueue tbb")
os.environ.setdefault("GOMP_SPINCOUNT", "20000")

__version__ = "0.1.0"

# The Python API (flashinfer_lite/api.py), imported on first use (PEP 562) so `import flashinfer_lite` stays light.
__all__ = ["load", "generate", "stream_generate", "make_prompt_cache"]


def __getattr__(name):
    if name in __all__:
        from . import api
        # importing api loads the submodule flashinfer_lite.generate, which binds the package attribute `generate`
        # to that module: bind the API's functions over it
        globals().update({n: getattr(api, n) for n in __all__})
        return globals()[name]
    raise AttributeError(f"module 'flashinfer_lite' has no attribute {name!r}")
