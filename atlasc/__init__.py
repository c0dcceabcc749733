"""atlasc: an ahead-of-time compiler for transformer models (ONNX in, one .atlas artifact out)."""

__version__ = "0.1.0"
