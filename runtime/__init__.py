"""atlasc.runtime: load and run `.atlas` artifacts (PyCUDA on the GPU; numpy on the CPU).

Imports only the artifact format, numpy and pycuda (checked by tests/test_layering.py).
"""
