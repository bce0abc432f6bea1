"""Triton kernels of the LLM path, each with a host wrapper that validates its arguments and a
pure-torch reference (`*_ref`) that the tests compare against.

Modules import triton at import time; import them only when the triton backend is selected.
"""
