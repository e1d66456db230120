"""The FFN's one home: how one layer's feed-forward is computed, from the bytes on flash to its output. Its Numba
kernels: kernels/neurons.py (the gating rule, once, and the kernels built on it) over kernels/blocks.py.

  flash     FlashFFN: a selector (ExactGate: every coefficient from gate|up rows; Predicted: the predictor, the oracle
            or a trace) times the rows read from flash through the neuron cache (neuron_cache.py, storage/reader.py)
            or read whole as a stream; SplitKernels: the kernels bound to the split layout's gate|up and down rows
  gate      the exact gate's thresholds, calibrated on text (measure_thresholds)
  dense     FeedForward (every weight in DRAM: the reference) and MixtureOfExperts (a router over experts)
  resident  ResidentFFN: a quantized FLASHDIR's FFN kept whole in DRAM
  experts   ExpertFFN: a mixture of experts whose experts stay on flash, read whole into an expert cache
  sparse    SparseFFN: the bundle kernels bound to one bundle geometry (coefficients, then the down sum)
  quant     QuantSparseFFN: the same over bundles in GGUF blocks, with dense(): a whole layer in RAM; quant_ffn: the
            dense FFN over a GGUF's matrices

Where a bundle's bytes sit is storage.format.BundleGeometry's. FlashFFN, ResidentFFN, ExpertFFN and the dense FFNs are
the FFN sources, each an FFNFn (model.py) that runtime.py plugs into the Transformer.
"""
