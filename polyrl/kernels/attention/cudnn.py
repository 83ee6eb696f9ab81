"""Uniform-length fast path for varlen causal attention: one batched SDPA call (cuDNN, else flash backend).

When every packed sequence has the same length L -- the usual SFT/benchmark micro-batch, ``B`` sequences of
``max_seqlen`` tokens -- the packed ``[T, H, D]`` tensors are exactly ``[B, L, H, D]``, so a single
``scaled_dot_product_attention(is_causal=True)`` over ``[B, H, L, D]`` views (no copies) computes the
same thing. On an H200 the cuDNN SDPA backend does causal fwd+bwd at 4 x 4096, 16/8 heads, D 128 in
2.1 ms against 3.4 ms for our Triton kernel (docs/performance.md). Autograd comes from SDPA itself.

Dispatch, per call (nothing here reads device values in the steady state):

1. ``uniform_batch``: ``T == B * max_seqlen`` with ``B = cu_seqlens.numel() - 1`` and no sliding window
   shorter than ``max_seqlen``. Given the contract (``cu_seqlens[-1] == T``, ``max_seqlen`` = the longest
   sequence) that means every length equals ``max_seqlen``. The contract is verified once per
   ``cu_seqlens`` tensor object (one host read, remembered through a weak reference and the tensor's
   version counter, so the 28 layers of one step pay it once). While a CUDA graph is being captured the
   call goes to the fallback (the Triton kernel is known to capture; SDPA backends may not), except inside
   ``capture_keeps_fast_path()``: the training step's capture (``train/graphed_step.py``) replays only batches
   of the captured shape (same ``T``, ``B`` and ``max_seqlen``, hence the same verdict), ran an eager warm-up on
   the very ``cu_seqlens`` it captures, and checked on the H200 that SDPA cuDNN captures; there a cached verdict
   is trusted.
2. On CUDA, the backend is chosen once per (device, dtype, Hq, Hk, D) by a probe: a small fwd+bwd under
   ``sdpa_kernel([CUDNN_ATTENTION])``, then ``[FLASH_ATTENTION]``, each compared with the fp32 reference;
   the first that runs and agrees wins. GQA passes k/v with Hk heads and ``enable_gqa=True`` (cuDNN
   honours it from torch 2.8 and ignores it, accepting Hk != Hq, before; flash has it since 2.5). No
   backend passing, or a runtime error from SDPA, sends the call to the fallback (warned once).
3. Everything else (mixed lengths, windows, fp32, head dims SDPA rejects, deterministic mode, code being
   traced by ``torch.compile``) goes to the fallback: the Triton kernel on CUDA, the per-sequence SDPA
   path elsewhere.

Deliberately not here: padding mixed lengths up to a batch (the Triton kernel does not pay for padding),
the paged/decode path (``paged_attention``), and anything fp32.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from polyrl.kernels.attention.reference import varlen_attention as reference
from polyrl.kernels.attention.sdpa import varlen_attention as sdpa_attention
from polyrl.platform import device as dev

# (device str, dtype, Hq, Hk, D) -> winning backend name ("CUDNN_ATTENTION" / "FLASH_ATTENTION") or None.
_BACKEND: dict[tuple[Any, ...], str | None] = {}
# id(cu_seqlens) -> (weak ref, version, T, L, uniform?) for the one-time contract check.
_VERIFIED: dict[int, tuple[weakref.ref, int, int, int, bool]] = {}
_LOCK = threading.Lock()
_WARNED: set[str] = set()
# Depth of capture_keeps_fast_path() blocks: process-wide, since activation checkpointing recomputes the forward on
# the autograd engine's own thread, which must decide as the capturing thread did.
_TRUSTED_CAPTURE = [0]
PROBE_BACKENDS = ("CUDNN_ATTENTION", "FLASH_ATTENTION")
_PROBE_TOL = {torch.bfloat16: 3e-2, torch.float16: 5e-3}  # relative L2 vs the fp32 reference


def uniform_batch(q: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, window: int | None) -> int | None:
    """B when the packed batch is B sequences of exactly ``max_seqlen`` tokens (shape test only), else None."""
    t, b, seq = q.shape[0], cu_seqlens.shape[0] - 1, int(max_seqlen)
    if b < 1 or seq < 1 or t != b * seq:
        return None
    if window is not None and window < seq:
        return None
    return b


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _capturing(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    streams = dev.stream_api()
    return bool(streams is not None and streams.is_current_stream_capturing())


@contextlib.contextmanager
def capture_keeps_fast_path():
    """Inside: a CUDA-graph capture keeps the SDPA path for ``cu_seqlens`` verified before the capture (see the
    module docstring, 1.); unverified tensors still go to the fallback."""
    with _LOCK:
        _TRUSTED_CAPTURE[0] += 1
    try:
        yield
    finally:
        with _LOCK:
            _TRUSTED_CAPTURE[0] -= 1


def _capture_refuses(device: torch.device) -> bool:
    return _capturing(device) and not _TRUSTED_CAPTURE[0]


def _compiling() -> bool:
    fn = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(fn()) if fn is not None else False


def _contract_holds(cu_seqlens: torch.Tensor, t: int, seq: int) -> bool | None:
    """Whether every length in ``cu_seqlens`` is ``seq`` (and they cover ``t`` tokens); None if unknown
    (not yet verified for this tensor and a host read is not allowed now)."""
    if cu_seqlens.is_inference():
        # Inference tensors carry no version counter, so a cached verdict could go stale on an in-place
        # refill; inference is forward-only, where the Triton kernel is as good: delegate.
        return None
    key = id(cu_seqlens)
    hit = _VERIFIED.get(key)
    if hit is not None:
        ref, version, t0, s0, ok = hit
        if ref() is cu_seqlens and version == cu_seqlens._version and (t0, s0) == (t, seq):
            return ok
    if _capturing(cu_seqlens.device):
        return None
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    ok = bool((lens == seq).all().item()) and int(cu_seqlens[0].item()) == 0
    with _LOCK:
        if len(_VERIFIED) > 64:  # drop dead entries; a step holds one or two live cu_seqlens
            for k in [k for k, v in _VERIFIED.items() if v[0]() is None]:
                del _VERIFIED[k]
        _VERIFIED[key] = (weakref.ref(cu_seqlens), cu_seqlens._version, t, seq, ok)
    return ok


def _sdpa(q, k, v, b: int, scale: float, backend: str | None) -> torch.Tensor:
    """Packed q ``[T, Hq, D]``, k/v ``[T, Hk, D]`` as ``[B, H, L, D]`` views -> causal SDPA -> ``[T, Hq, D]``."""
    t, hq, d = q.shape
    seq = t // b
    qb, kb, vb = (x.view(b, seq, x.shape[1], d).transpose(1, 2) for x in (q, k, v))
    gqa = hq != k.shape[1]
    if backend is None:
        out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        with sdpa_kernel([getattr(SDPBackend, backend)]):
            out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale, enable_gqa=gqa)
    return out.transpose(1, 2).reshape(t, hq, d)


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _probe(device: torch.device, dtype: torch.dtype, hq: int, hk: int, d: int, seq: int = 192) -> str | None:
    """The first backend of ``PROBE_BACKENDS`` whose fwd+bwd runs and matches the reference here, or None.

    Two sequences of ``seq`` tokens (192: not a multiple of 128, so tile tails are exercised)."""
    b = 2
    scale = d**-0.5
    # Outside inference mode even when the caller is in it: the probe needs autograd.
    with torch.inference_mode(False), torch.enable_grad():
        gen = torch.Generator(device="cpu").manual_seed(0)
        # Values exactly representable in ``dtype``: the reference (fp32) sees what the backend sees.
        q0, k0, v0 = (torch.randn(b * seq, h, d, generator=gen).to(dtype).float().to(device) for h in (hq, hk, hk))
        do = torch.randn(b * seq, hq, d, generator=gen).to(dtype).float().to(device)
        cu = torch.arange(0, b * seq + 1, seq, dtype=torch.int32, device=device)
        leaves = [x.detach().requires_grad_(True) for x in (q0, k0, v0)]
        want_out = reference(*leaves, cu, seq, scale)
        want = (want_out, *torch.autograd.grad(want_out, leaves, do))
        for backend in PROBE_BACKENDS:
            try:
                leaves = [x.detach().to(dtype).requires_grad_(True) for x in (q0, k0, v0)]
                out = _sdpa(*leaves, b, scale, backend)
                got = (out, *torch.autograd.grad(out, leaves, do.to(dtype)))
            except Exception as exc:  # noqa: BLE001 - "no kernel for these inputs" and friends
                what = f"unusable for {dtype} Hq={hq} Hk={hk} D={d}: {str(exc).splitlines()[0][:160]}"
                _warn_once(f"probe:{backend}:{dtype}:{hq}:{hk}:{d}", f"attention fast path: SDPA {backend} {what}")
                continue
            errs = [_rel_l2(g, w) for g, w in zip(got, want)]
            if all(e <= _PROBE_TOL.get(dtype, 1e-3) for e in errs):
                return backend
            what = f"disagrees with the reference for {dtype} Hq={hq} Hk={hk} D={d} (rel L2 {max(errs):.2e})"
            _warn_once(f"mismatch:{backend}:{dtype}:{hq}:{hk}:{d}", f"attention fast path: SDPA {backend} {what}")
    return None


def backend_for(device: torch.device, dtype: torch.dtype, hq: int, hk: int, d: int) -> str | None:
    """The SDPA backend this fast path uses for these inputs on CUDA (probed once), or None for the fallback."""
    key = (str(device), dtype, hq, hk, d)
    if key not in _BACKEND:
        if _capturing(device):
            return None
        _BACKEND[key] = _probe_apart(device, dtype, hq, hk, d)
    return _BACKEND[key]


def _probe_apart(device: torch.device, dtype: torch.dtype, hq: int, hk: int, d: int) -> str | None:
    """``_probe`` on its own thread. The first attention call often comes inside an activation-checkpointed layer,
    whose saved-tensor hooks (thread-local) would record the probe's autograd tensors in the forward and not in the
    recomputation ("a different number of tensors was saved": found on the H200 with LoRA + checkpointing); a
    fresh thread also starts without the caller's autocast and inference modes."""
    result: list[Any] = []

    def run() -> None:
        try:
            result.append(_probe(device, dtype, hq, hk, d))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            result.append(exc)

    worker = threading.Thread(target=run, name="polyrl-attention-probe")
    worker.start()
    worker.join()
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


def _fallback(device_type: str) -> Callable[..., torch.Tensor]:
    if device_type == "cuda":
        try:
            # lazy: triton loads only when the CUDA fallback is needed, and may be missing
            from polyrl.kernels.attention.triton import varlen_attention as triton_attention

            return triton_attention
        except Exception:  # noqa: BLE001 - no triton here: the portable path
            pass
    return sdpa_attention


def plan(q: torch.Tensor, k: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, window: int | None):
    """(B, backend) when this call takes the batched SDPA path, else None (the fallback runs).

    ``backend`` is the ``SDPBackend`` name on CUDA, None elsewhere (SDPA picks; used by CPU tests)."""
    # Deterministic mode (bitwise-reproducible training) keeps the Triton kernel: its backward has no atomics.
    if torch.are_deterministic_algorithms_enabled() or _compiling() or _capture_refuses(q.device):
        return None
    if q.dim() != 3 or k.dim() != 3 or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        return None
    if k.shape[1] < 1 or q.shape[1] % k.shape[1]:
        return None
    b = uniform_batch(q, cu_seqlens, max_seqlen, window)
    if b is None or q.stride(-1) != 1 or k.stride(-1) != 1:
        return None
    if not _contract_holds(cu_seqlens, q.shape[0], int(max_seqlen)):
        return None
    if q.device.type != "cuda":
        return b, None
    backend = backend_for(q.device, q.dtype, q.shape[1], k.shape[1], q.shape[2])
    return (b, backend) if backend is not None else None


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention within each packed sequence (see ``polyrl.kernels.varlen_attention``)."""
    chosen = plan(q, k, cu_seqlens, max_seqlen, window) if v.shape == k.shape and v.stride(-1) == 1 else None
    if chosen is not None:
        b, backend = chosen
        try:
            return _sdpa(q, k, v, b, q.shape[-1] ** -0.5 if scale is None else float(scale), backend)
        except RuntimeError as exc:
            what = f"failed ({str(exc).splitlines()[0][:160]}); using the fallback for this call"
            _warn_once(f"run:{backend}", f"attention fast path: SDPA {backend} {what}")
    return _fallback(q.device.type)(q, k, v, cu_seqlens, max_seqlen, scale, window)
