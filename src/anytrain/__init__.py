"""anytrain: pre-train Transformer and Mamba language models on NVIDIA, AMD or CPU with one code base."""

__version__ = "0.1.0"
