"""The Numba kernels every part of the model shares, one module per role:

  rows      the building blocks of the others: float16 bits <-> float32 (F16C or portable) and `f32_at`, a weight
            element of any stored type as float32; software prefetch of the rows a loop will read next; dot / axpy /
            scalar over one vector
  gemv      resident matrices: x @ W^T for float16 or float32 W (matmul_t), and widening them for BLAS
  attention a decode step's attention over the float16 KV cache
  norm      RMSNorm and the residual add fused with it
  blocks    GGUF's block formats (q8_0 ... q6_k): row dot / dequant / axpy, 8-bit activations, down columns,
            quant_matmul_t, QuantMatrix and linear (x @ W^T of any resident matrix)
  neurons   the FFN's: the gating rule (once), the sparse FFN over bundle rows, and the FFNs over GGUF blocks
"""
