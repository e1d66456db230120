"""The FFN's one home: how one layer's feed-forward is computed, from the bundle bytes to its output.

  gating    the gating rule (act(gate) * up, dReLU, FATReLU's threshold), once, with its numpy twin
  sparse    SparseFFN: the kernels over bundle rows of float32 / float16 / int8 (coefficients, then the down sum)
  quant     QuantSparseFFN over bundles in GGUF blocks, with dense(): a whole layer in RAM; quant_ffn: the dense FFN
            over a GGUF's matrices

Where a bundle's bytes sit is storage.format.BundleGeometry's; which neurons run and where their rows come from is
the FFN source's (runtime.FlashFFN, runtime.ResidentFFN, model.FeedForward), each an FFNFn (model.py).
"""
