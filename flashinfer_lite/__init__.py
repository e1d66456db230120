"""flashinfer-lite: run LLMs whose FFN weights stay on flash."""
import os

# Thread pools, before numpy/numba load (a user's explicit setting wins). OpenBLAS threads busy-wait between calls
# and take the cores from the Numba kernels and the reader threads: one BLAS thread was faster than the default in
# every decode and prefill measured here (bench/resident_gemv.py). Numba's workqueue layer does not spin either.
BLAS_THREADS_FROM_USER = "OPENBLAS_NUM_THREADS" in os.environ
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("NUMBA_THREADING_LAYER", "workqueue")

__version__ = "0.1.0"

# The Python API (flashinfer_lite/api.py), imported on first use (PEP 562) so `import flashinfer_lite` stays light.
__all__ = ["load", "generate", "stream_generate"]


def __getattr__(name):
    if name in __all__:
        from . import api
        # importing api loads the submodule flashinfer_lite.generate, which binds the package attribute `generate`
        # to that module: bind the API's functions over it
        globals().update({n: getattr(api, n) for n in __all__})
        return globals()[name]
    raise AttributeError(f"module 'flashinfer_lite' has no attribute {name!r}")
