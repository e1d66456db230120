"""flashinfer-lite: run LLMs whose FFN weights stay on flash."""

__version__ = "0.1.0"
