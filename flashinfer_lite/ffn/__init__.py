"""The FFN's one home: how one layer's feed-forward is computed, from the bundle bytes to its output.

  gating    the gating rule (act(gate) * up, dReLU, FATReLU's threshold), once, with its numpy twin
  sparse    SparseFFN: the kernels over bundle rows of float32 / float16 / int8 (coefficients, then the down sum)
  quant     QuantSparseFFN over bundles in GGUF blocks, with dense(): a whole layer in RAM; quant_ffn: the dense FFN
            over a GGUF's matrices

  resident  ResidentFFN: a quantized FLASHDIR's FFN kept whole in DRAM
  flash     FlashFFN: the bundles the selector names, read from flash through the neuron cache (neuron_cache.py,
            storage/reader.py)

Where a bundle's bytes sit is storage.format.BundleGeometry's. ResidentFFN, FlashFFN and model.FeedForward (every
weight in DRAM: the reference) are the FFN sources, each an FFNFn (model.py) that runtime.py plugs into the
Transformer.
"""
