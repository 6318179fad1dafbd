"""FAKE torch_npu/version.py (generated at build time in the real package)."""

__version__ = "2.13.0.post1"
