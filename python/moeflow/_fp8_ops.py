"""The FP8 quantization and FP8 GEMM ops of moeflow.ops (re-exported there):
quantize, quantize_group_rows, quantize_rowwise_columnwise, transpose_codes,
dequantize, requantize_columnwise, grouped_gemm_fp8_forward / _wgrad."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import _C
from ._ops_common import _rows, _stream


_FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def _scale_shape(rows: int, cols: int, scaling: str) -> Tuple[int, ...]:
    nb = lambda n: -(-n // 128)  # noqa: E731
    return {"tensorwise": (1,), "1x128": (rows, nb(cols)),
            "128x128": (nb(rows), nb(cols))}.get(scaling, (1,))


def quantize(x: torch.Tensor, fp8_format: str = "e4m3", scaling: str = "1x128",
             pow2_scales: bool = False, columnwise: bool = False,
             rows_used: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """FP8 quantization (moeflow/quantize.h has the exact policy): x [M, K]
    float32 / float16 / bfloat16 -> (q, scales), x ~= q * scale of its block.
    ``fp8_format`` "e4m3" (torch.float8_e4m3fn) or "e5m2"; ``scaling``
    "tensorwise" (scales [1]), "1x128" (activations: [M, ceil(K/128)]) or
    "128x128" (weights: [ceil(M/128), ceil(K/128)]); ``pow2_scales`` rounds
    the scales up to powers of two; ``columnwise`` quantizes x^T (q [K, M],
    the blocks along M). ``rows_used`` (optional int32 / int64 [1] on x's
    device, rowwise "1x128" only): only the first that many rows are
    quantized, read on the device; q's and scales' other rows are left
    uninitialised. On the device, no sync; not differentiable."""
    if x.dim() != 2:
        raise _C.Error(f"x must be [M, K], got shape {tuple(x.shape)}")
    x = _rows(x.detach())
    M, K = x.shape
    R, C = (K, M) if columnwise else (M, K)
    q = torch.empty((R, C), dtype=_FP8.get(fp8_format, torch.float8_e4m3fn), device=x.device)
    scales = torch.empty(_scale_shape(R, C, scaling), dtype=torch.float32, device=x.device)
    ws = None
    if x.is_cuda:
        n = _C.quantize_workspace_bytes(M, K, fp8_format, scaling, pow2_scales, columnwise)
        ws = torch.empty(n, dtype=torch.uint8, device=x.device) if n else None
    _C.quantize(x, fp8_format, scaling, bool(pow2_scales), bool(columnwise), q, scales, ws,
                rows_used, _stream(x))
    return q, scales


def quantize_group_rows(x: torch.Tensor, offsets: Optional[torch.Tensor] = None,
                        real_rows: Optional[torch.Tensor] = None, fp8_format: str = "e4m3",
                        pow2_scales: bool = False, transposed: bool = False,
                        amax: Optional[torch.Tensor] = None) -> Tuple:
    """Tensorwise FP8 codes of the rows of expert groups (the fp8-tensorwise
    recipe's operands): x [rows, K] -> (q [rows, K], scale [1]), the scale
    from the amax of the groups' real rows only (offsets int64 [E+1],
    real_rows int32 [E] optional; offsets None: every row), those rows
    quantized with it, every other row code 0 (never read: pad rows and rows
    past the groups may hold anything). The policy of :func:`quantize`. With
    ``transposed``: (q, scale, q_t), q_t [K, rows] contiguous the codes
    transposed (``transpose_codes(q)``, the tensorwise wgrad's operand) from
    the same pass. ``amax`` ([1] float32 on x's device): the amax of those
    rows, already computed (e.g. by ``grouped_mlp_activation_backward``'s
    ``d_h_amax``): only the codes pass runs. On the device, no sync, no
    workspace; not differentiable."""
    if x.dim() != 2:
        raise _C.Error(f"x must be [rows, K], got shape {tuple(x.shape)}")
    x = _rows(x.detach())
    fp8 = _FP8.get(fp8_format, torch.float8_e4m3fn)
    q = torch.empty(x.shape, dtype=fp8, device=x.device)
    scale = torch.empty(1, dtype=torch.float32, device=x.device)
    q_t = torch.empty(x.shape[1], x.shape[0], dtype=fp8, device=x.device) if transposed else None
    _C.quantize_group_rows(x, offsets, real_rows, fp8_format, bool(pow2_scales), q, scale,
                           _stream(x), q_t, amax)
    return (q, scale, q_t) if transposed else (q, scale)


def quantize_rowwise_columnwise(x: torch.Tensor, fp8_format: str = "e4m3",
                                pow2_scales: bool = False, rowwise: bool = True,
                                scaling: str = "1x128"
                                ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor],
                                           torch.Tensor, torch.Tensor]:
    """Both orientations of x from one read: (q, scales) exactly as
    ``quantize(x, fp8_format, scaling)`` and (q_t, scales_t) as ``quantize(x,
    fp8_format, scaling, columnwise=True)``. ``rowwise=False``: only the
    columnwise pair (q and scales are None). On the device, one kernel, no
    sync; not differentiable.

    ``scaling="1x128"`` (activations): x [M, K] (16-bit or float32);
    scales_t [K, ceil(M/128)] is the transposed view of a contiguous
    [ceil(M/128), K] buffer: the layout ``grouped_gemm_fp8_wgrad`` reads
    fastest (``.contiguous()`` gives quantize's layout).

    ``scaling="128x128"`` (expert weights): x [M, K] or [G, M, K], each
    matrix with its own block grid: q [G, M, K], scales [G, ceil(M/128),
    ceil(K/128)], and q_t [G, K, M], scales_t [G, ceil(K/128), ceil(M/128)]:
    the codes of each matrix transposed, which are ``transpose_codes(q)``
    and the scale grid transposed (what an FP8 dgrad reads), contiguous."""
    if scaling not in ("1x128", "128x128"):
        raise _C.Error(f"scaling must be '1x128' or '128x128', got {scaling!r}")
    if x.dim() != 2 and not (scaling == "128x128" and x.dim() == 3):
        raise _C.Error(f"x must be [M, K]{' or [G, M, K]' if scaling == '128x128' else ''}, "
                       f"got shape {tuple(x.shape)}")
    x = _rows(x.detach())
    M, K = x.shape[-2:]
    lead = tuple(x.shape[:-2])
    dt = _FP8.get(fp8_format, torch.float8_e4m3fn)
    nb = lambda n: -(-n // 128)  # noqa: E731
    q = scales = None
    if scaling == "128x128":
        if rowwise:
            q = torch.empty(lead + (M, K), dtype=dt, device=x.device)
            scales = torch.empty(lead + (nb(M), nb(K)), dtype=torch.float32, device=x.device)
        q_t = torch.empty(lead + (K, M), dtype=dt, device=x.device)
        scales_t = torch.empty(lead + (nb(K), nb(M)), dtype=torch.float32, device=x.device)
    else:
        if rowwise:
            q = torch.empty((M, K), dtype=dt, device=x.device)
            scales = torch.empty(_scale_shape(M, K, "1x128"), dtype=torch.float32,
                                 device=x.device)
        q_t = torch.empty((K, M), dtype=dt, device=x.device)
        scales_t = torch.empty((nb(M), K), dtype=torch.float32, device=x.device).t()
    _C.quantize_rowwise_columnwise(x, fp8_format, bool(pow2_scales), q, scales, q_t, scales_t,
                                   _stream(x), scaling)
    return q, scales, q_t, scales_t


def requantize_columnwise(q: torch.Tensor, scales: torch.Tensor,
                          dtype: torch.dtype = torch.bfloat16, fp8_format: str = "e4m3",
                          pow2_scales: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """The columnwise 1x128 codes of FP8 rows q [M, K] (float8_e4m3fn /
    float8_e5m2, rowwise 1x128 scales [M, ceil(K/128)]): (q_t, scales_t)
    exactly as ``quantize_rowwise_columnwise(dequantize(q, scales,
    dtype=dtype), rowwise=False)`` returns them (scales_t the same transposed
    view), without the 16-bit rows. dtype: bfloat16 or float16 (the rows'
    rounding). On the device, one kernel, no sync; not differentiable."""
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be torch.bfloat16 or torch.float16, got {dtype}")
    M, K = q.shape
    dt = _FP8.get(fp8_format, torch.float8_e4m3fn)
    q_t = torch.empty((K, M), dtype=dt, device=q.device)
    scales_t = torch.empty(((M + 127) // 128, K), dtype=torch.float32, device=q.device).t()
    _C.requantize_columnwise(q, scales, dtype == torch.float16, fp8_format, bool(pow2_scales),
                             q_t, scales_t, _stream(q))
    return q_t, scales_t


def transpose_codes(q: torch.Tensor) -> torch.Tensor:
    """FP8 codes [G, R, C] (or [R, C]) -> [G, C, R]: each matrix transposed,
    the values as they are (moeflow/quantize.h); also float32 scale grids.
    The 128x128 block scales of the result are the input's transposed, so
    the pair equals ``quantize(..., columnwise=True)`` of each matrix: the
    dgrad's weight codes from the forward's. On the device, no sync."""
    if q.dim() not in (2, 3):
        raise _C.Error(f"q must be [R, C] or [G, R, C], got shape {tuple(q.shape)}")
    q = q.contiguous()
    out = torch.empty(q.shape[:-2] + (q.shape[-1], q.shape[-2]), dtype=q.dtype, device=q.device)
    _C.transpose_codes(q, out, _stream(q))
    return out


def grouped_gemm_fp8_forward(a: torch.Tensor, a_scales: torch.Tensor, w: torch.Tensor,
                             w_scales: torch.Tensor, offsets: torch.Tensor,
                             real_rows: Optional[torch.Tensor] = None,
                             out: Optional[torch.Tensor] = None,
                             fp8_promote: int = -1) -> torch.Tensor:
    """FP8 grouped GEMM forward: out[rows of expert e] = dequant(a) @
    dequant(w[e])^T, bf16 [rows, N]. Blockwise (DeepSeek-V3's recipe): a
    [rows, K] float8_e4m3fn with a_scales [rows, K/128] (``quantize(x, "e4m3",
    "1x128")``), w [E, N, K] float8_e4m3fn with w_scales [E, N/128, K/128]
    (``quantize`` of w as [E*N, K] with "128x128"), promoted in float32 every
    128 of K. Tensorwise: a_scales and w_scales [1] (one scale per operand),
    the tensor cores' sums promoted every ``fp8_promote`` 128-wide K slices
    (-1: 4; 0: once, fast accumulation). offsets int64 [E+1]; real_rows
    int32 [E] (optional: rows past them are pad rows, written as zeros). K
    and N multiples of 128. ``out``: bf16 [rows, N], its rows may be strided
    (e.g. columns of a wider buffer; even row stride). CUDA: Hopper, one
    launch, no sync; CPU: the reference. Not differentiable."""
    if out is None:
        out = torch.empty(a.shape[0], w.shape[1], dtype=torch.bfloat16, device=a.device)
    _C.grouped_gemm_fp8_forward(a, a_scales, w, w_scales, offsets, real_rows, out, _stream(a),
                                int(fp8_promote))
    return out


def grouped_gemm_fp8_wgrad(dc_t: torch.Tensor, dc_t_scales: torch.Tensor, a_t: torch.Tensor,
                           a_t_scales: torch.Tensor, offsets: torch.Tensor,
                           real_rows: Optional[torch.Tensor] = None,
                           out: Optional[torch.Tensor] = None, accumulate: bool = False,
                           num_experts: Optional[int] = None,
                           error: Optional[torch.Tensor] = None) -> torch.Tensor:
    """FP8 grouped GEMM wgrad (variable K): out[e] (+)= dequant(dC
    of expert e's rows)^T @ dequant(A of those rows), [E, N, K]. The operands
    come transposed, as ``quantize(dc, "e4m3", "1x128", columnwise=True)``
    writes them: dc_t [N, rows] float8_e4m3fn with dc_t_scales [N, rows/128]
    float32, a_t [K, rows] with a_t_scales [K, rows/128] (the scales may be
    any strided view, e.g. the transpose of a contiguous [rows/128, N]: read
    fastest). offsets int64 [E+1], each expert with real rows starting at a
    multiple of 128 (align 128); real_rows int32 [E] (optional: rows past
    them are not read). ``out``: float32 or bf16 [E, N, K] (new bf16 if
    None; ``num_experts`` then gives E, default len(offsets) - 1);
    ``accumulate`` adds to it (bf16: rounded once). N and K multiples of 128.
    An expert whose real rows start off a multiple of 128: the CPU raises;
    CUDA (no sync) leaves its ``out`` as it was and sets ``error`` (optional
    int32 [1] on the device, set to 1; never cleared). Tensorwise:
    dc_t_scales and a_t_scales [1] (one scale per operand: the rowwise codes
    of :func:`quantize_group_rows` transposed by :func:`transpose_codes`),
    each expert's real rows starting at a multiple of 16 (same error
    handling otherwise). CUDA: Hopper, one launch, no sync; CPU: the
    reference. Not differentiable."""
    if out is None:
        E = int(num_experts) if num_experts is not None else int(offsets.shape[0]) - 1
        out = torch.empty(E, dc_t.shape[0], a_t.shape[0], dtype=torch.bfloat16, device=dc_t.device)
    _C.grouped_gemm_fp8_wgrad(dc_t, dc_t_scales, a_t, a_t_scales, offsets, real_rows, out,
                              bool(accumulate), error, _stream(dc_t))
    return out


def dequantize(q: torch.Tensor, scales: torch.Tensor, scaling: str = "1x128",
               columnwise: bool = False, dtype: torch.dtype = torch.bfloat16,
               rows_used: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The inverse of :func:`quantize`: out [M, K] in ``dtype`` (x's layout,
    also for ``columnwise``), q * scale rounded once. ``rows_used``
    (optional int32 / int64 [1] on q's device, rowwise only): only the first
    that many rows are dequantized, read on the device; out's other rows are
    left uninitialised (e.g. the rows past a receive buffer's tokens)."""
    fmt = "e5m2" if q.dtype == torch.float8_e5m2 else "e4m3"
    R, C = q.shape
    M, K = (C, R) if columnwise else (R, C)
    out = torch.empty((M, K), dtype=dtype, device=q.device)
    _C.dequantize(_rows(q), scales.contiguous(), fmt, scaling, False, bool(columnwise), out,
                  rows_used, _stream(q))
    return out
