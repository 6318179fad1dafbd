"""FAKE torch_npu._C (the real one is the compiled extension)."""
