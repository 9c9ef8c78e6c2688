"""Which implementation computes a layer's NSA: the one place that chooses between the PyTorch reference
(`nsa_reference.py`, any device, the oracle) and the Triton kernels (`nsa_triton.py`, NVIDIA GPUs), and the one
place that says in the log when it falls back to the reference.

`nsa_backend` (NSAConfig) is "auto", "reference" or "triton". Under "auto" the kernels run wherever they can
(an NVIDIA GPU of compute capability 8.0 or newer with Triton installed, NSA parameters and a head size they
handle) and the reference runs elsewhere, said once in the log on a GPU; an explicit "triton" raises where the
kernels cannot run instead of quietly changing the code path. The kernel entry points themselves never fall
back: they raise on inputs they do not handle.

This file travels as remote code and imports without triton: the kernel files are imported only once a device
asks for them.
"""

from __future__ import annotations

import logging

import torch

from .configuration_nsa import NSA_BACKENDS
from .nsa_layout import NSAParams
from .nsa_reference import nsa_attention_reference

logger = logging.getLogger(__name__)

_logged_once: set[str] = set()


def _emit_once(message: str) -> None:
    """Log a warning the first time it comes up."""
    if message not in _logged_once:
        _logged_once.add(message)
        logger.warning(message)


def _emit_while_tracing(ctx) -> None:
    """_log_once's message said while torch.compile traces it (dynamo's comptime runs this at trace time, once per
    compilation; it takes no free variables, so the message is read from _log_once's frame)."""
    _emit_once(ctx.get_local("message").as_python_constant())


def _log_once(message: str) -> None:
    """Log a warning the first time it comes up, also inside torch.compile, where a fallback is decided while
    the graph is traced (a whole model compiled has no eager call around it that would say it): logging cannot be
    traced (fullgraph=True would fail), so the message is said at trace time through dynamo's comptime."""
    if torch.compiler.is_compiling():
        if _comptime is not None:
            _comptime(_emit_while_tracing)
        return
    _emit_once(message)


try:  # (dynamo's hook for code run at trace time; without it a compiled region says nothing, as before)
    from torch._dynamo.comptime import comptime as _comptime
except ImportError:  # pragma: no cover
    _comptime = None


def resolve_nsa_backend(requested: str, device: torch.device) -> str:
    """'auto' -> 'triton' where the kernels run (an NVIDIA GPU of compute capability 8.0 or newer with Triton
    installed), else 'reference', said once in the log on a GPU. An explicit 'triton' on a device where the
    kernels cannot run raises instead of quietly changing the code path. (Parameters the kernels do not handle
    on a device where they run, an unsupported head_dim say, are nsa_attention's to decide: the reference with
    a log line under 'auto', an error under 'triton'.)"""
    if requested not in NSA_BACKENDS:
        raise ValueError(f"backend={requested!r}: choose one of {', '.join(map(repr, NSA_BACKENDS))}.")
    if requested == "reference":
        return "reference"
    try:
        from .nsa_triton import triton_unusable_reason

        reason = triton_unusable_reason(device)
    except ImportError as error:  # nsa_triton itself missing
        reason = str(error)
    if requested == "triton":
        if reason:
            raise RuntimeError(f"nsa_backend='triton' but {reason}. Use nsa_backend='reference' or 'auto' (a saved "
                               "model: from_pretrained(..., nsa_backend='auto') overrides the saved value).")
        return "triton"
    if device.type == "cuda":
        if reason:
            _log_once(f"NSA: nsa_backend='auto' falls back to the PyTorch reference on {device}: {reason}.")
            return "reference"
        return "triton"
    return "reference"


def _check_explicit_triton(config) -> None:
    """nsa_backend='triton' with NSA parameters the kernels do not handle raises when the model is built (with
    'auto' they run the reference, logged), rather than running the O(T^2)-memory reference in their place."""
    if config.nsa_backend != "triton" or config.attention_mode != "nsa":
        return
    from .nsa_triton import triton_unsupported_reason

    reason = triton_unsupported_reason(NSAParams.from_config(config), config.head_dim)
    if reason:
        raise ValueError(f"nsa_backend='triton' but the Triton kernels do not handle {reason}. Change it, or use "
                         "nsa_backend='auto' (the PyTorch reference where the kernels do not apply, logged).")


def nsa_attention(q, k_cmp, v_cmp, cmp_end, k_slc, v_slc, k_win, v_win, gates, doc_pos, params, backend="auto",
                  query_end=None):
    """Gated NSA output (B, Tq, H, D) for queries at the last Tq of Tk key positions (or, query_end: a static
    cache's step, the queries ending at key query_end[0]).

    Arguments as `nsa_reference.nsa_attention_reference` (gates in [0, 1]: Eq. 5's sigmoid gates, which the
    kernels' backward relies on, nsa_triton.nsa_attention_triton). The Triton path covers training/prefill
    (Tq = Tk = Tw, differentiable) and chunks after a cache (decode, no autograd); under 'auto' the reference
    runs, logged once, for parameters the kernels do not handle on this device and for a chunk after a cache
    that needs gradients. (Float32 inputs on a GPU compute in bf16, logged: nsa_triton._kernel_inputs.)
    """
    requested, backend = backend, resolve_nsa_backend(backend, q.device)
    if backend == "triton":
        from .nsa_triton import nsa_attention_triton, nsa_decode_triton, triton_unsupported_reason

        # asked once per call (the device's part: head_dim 256 needs 160 KiB of shared memory per block)
        unsupported = triton_unsupported_reason(params, q.shape[-1], q.device)
        num_queries, num_keys, num_win = q.shape[1], k_slc.shape[1], k_win.shape[1]
        if unsupported and requested == "triton":
            raise RuntimeError(f"nsa_backend='triton' but the Triton kernels do not handle {unsupported} on "
                               f"{q.device}. Use nsa_backend='auto' (the PyTorch reference there, logged).")
        if unsupported:
            _log_once(f"NSA: the Triton kernels do not handle {unsupported}; using the PyTorch reference (much "
                      "slower).")
        elif num_queries == num_keys == num_win and query_end is None:
            return nsa_attention_triton(
                q, k_cmp, v_cmp, cmp_end, k_slc, v_slc, k_win, v_win, gates, doc_pos, params, checked=True
            )
        elif not (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k_cmp, v_cmp, k_slc, v_slc, k_win,
                                                                              v_win, gates))):  # fmt: skip
            # (any input: q alone left gradients to trained K/V or gate projections behind a frozen q out)
            return nsa_decode_triton(
                q, k_cmp, v_cmp, cmp_end, k_slc, v_slc, k_win, v_win, gates, doc_pos, params, query_end=query_end,
                checked=True,
            )
        elif requested == "triton":
            raise RuntimeError("nsa_backend='triton' but no Triton kernel differentiates a chunk after a cache "
                               "(queries behind cached keys, with gradients). Use nsa_backend='auto' (the PyTorch "
                               "reference there, logged), or run the chunk without gradients.")
        else:
            _log_once("NSA: no differentiable Triton kernel for a chunk after a cache; using the reference.")
    return nsa_attention_reference(
        q, k_cmp, v_cmp, cmp_end, k_slc, v_slc, k_win, v_win, gates, doc_pos, params, query_end=query_end
    )


__all__ = ["nsa_attention", "resolve_nsa_backend"]
