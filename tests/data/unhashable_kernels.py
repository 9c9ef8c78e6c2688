"""Kernels whose Triton cache key cannot be computed (a plain Python function called from a @triton.jit helper):
tests/test_triton_compile.py's check that nsa_triton_common._settle_jit_cache_keys leaves no key computed over
Triton's placeholder when one fails."""

import triton
import triton.language as tl


def not_a_kernel_function(x):
    return x


@triton.jit
def _helper(x):
    return not_a_kernel_function(x)


@triton.jit
def _kernel(X):
    tl.store(X, _helper(1))
