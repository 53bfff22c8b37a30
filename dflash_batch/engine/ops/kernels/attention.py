"""Block attention for verify and draft passes: a few query rows over a KV cache of any length.

``q [B, H, Lq, D]`` (Lq from 1 up to 16 or so: a decoding step, the rows of a verify or draft
block) attends to ``k, v [B, Hk, Lk, D]`` (GQA: query head h reads KV head h // (H / Hk)). Batch
row b has L_b keys: ``min(kv_len[b], Lk)`` where ``kv_len`` (int32 [B]) is given and its entry
is > 0, else Lk; its query row i sits at key position ``L_b - Lq + i``. Masks, all optional and combined:

    kv_len:    key j is visible to row i of batch row b iff j < L_b   (ragged batch rows: as if
               row b's keys were k[b, :, :L_b]; a RaggedKVCache's shared buffer)
    causal:    ... and j <= L_b - Lq + i                            (verify: causal in the block)
    window w:  ... and (L_b - Lq + i) - j < w                       (sliding-window drafter layers)
    kv_start:  ... and j >= kv_start[b]                             (left-padded batch rows)

Two passes, as a split-K decode step does for its one row:

    pass 1, per chunk c of keys and per row:  m_c = max_j s_j,  l_c = sum_j 2^(s_j - m_c),
                                              o_c = sum_j 2^(s_j - m_c) v_j
              with s_j = (q . k_j) * scale * log2(e)   (base-2 exponent, same softmax)
    pass 2, per row:  M = max_c m_c,  w_c = 2^(m_c - M),  out = sum_c w_c o_c / sum_c w_c l_c

All partials are fp32. ``reference`` computes exactly this with MLX ops (any backend; the test
oracle). ``kernel`` runs it as GPU kernels compiled once per (dtype, head dim): shapes, strides
and mask parameters are run-time arguments, so a new KV length costs no compilation (stock
SDPA's multi-row path on CUDA pays tens of milliseconds for every new key length):

    CUDA, bf16 / fp16   PASS1_MMA_BODY: pass 1 on tensor cores (mma.sync), pass 2 fused in: one launch
    CUDA fp32, Metal    PASS1_BODY on CUDA cores / SIMD lanes, then PASS2_BODY: two launches

The bodies are written once against a few macros that each backend's header (and the tests'
CPU emulator) defines.

``block_attention_kernel`` runs the kernels as they are (what the GPU tests and benchmarks
compare and time). ``block_attention`` and the engine's routing first ask ``kernel_verified``:
once per machine and kind of call (backend, dtype, head dim, mask flags; a pass is kept in the
model cache), the kernel runs a small seeded case against the reference (``selfcheck``); after a
compile error or a mismatch they warn once and use the reference. The Metal kernels have never run on Apple hardware.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Optional, Tuple

import mlx.core as mx

from .. import device
from . import selfcheck, sources

LOG2E = 1.4426950408889634
HEAD_DIMS = (64, 128, 256)
DTYPES = (mx.float32, mx.float16, mx.bfloat16)
TILE = 32  # keys per tile: one per lane of a 32-wide warp / simdgroup
REFERENCE_CHUNK = 128  # keys per chunk in the reference's first pass
TARGET_BLOCKS = 264  # pass-1 blocks to aim for (about two per SM of a 132-SM GPU)


# --------------------------------------------------------------------------------------------
# Reference (pure MLX): the oracle, and the CPU path
# --------------------------------------------------------------------------------------------


def row_lengths(kv_len: mx.array, Lk: int) -> mx.array:
    """Each batch row's key length as the kernels take it: kv_len[b], at most Lk; 0 (or less): Lk."""
    kv_len = kv_len.astype(mx.int32)
    return mx.where(kv_len > 0, mx.minimum(kv_len, Lk), Lk)


def visible_keys(
    Lq: int,
    Lk: int,
    *,
    causal: bool,
    window: Optional[int],
    kv_start: Optional[mx.array],
    width: int,
    kv_len: Optional[mx.array] = None,
) -> mx.array:
    """Bool mask [B or 1, 1, Lq, width] of the keys each row may see (keys >= Lk are padding).
    With ``kv_len`` row b's key length is ``row_lengths(kv_len, Lk)[b]``: its keys past that are
    hidden and its query row i sits at that length - Lq + i."""
    lengths = mx.array(Lk) if kv_len is None else row_lengths(kv_len, Lk).reshape(-1, 1, 1, 1)
    # absolute position of each query row
    rows = mx.arange(Lq)[None, None, :, None] + (lengths - Lq)
    keys = mx.arange(width)[None, None, None, :]
    ok = keys < lengths
    if causal:
        ok = ok & (keys <= rows)
    if window:
        ok = ok & (rows - keys < window)
    if kv_start is not None:
        ok = ok & (keys >= kv_start.reshape(-1, 1, 1, 1))
    return mx.broadcast_to(ok, (ok.shape[0], 1, Lq, width))


def block_attention_reference(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    *,
    scale: float,
    causal: bool = True,
    window: Optional[int] = None,
    kv_start: Optional[mx.array] = None,
    kv_len: Optional[mx.array] = None,
    chunk: int = REFERENCE_CHUNK,
    sinks: Optional[mx.array] = None,
) -> mx.array:
    """The two-pass block attention in MLX ops, fp32 inside; returns q's dtype, shape [B, H, Lq, D].
    ``kv_len`` (int [B]): row b as if its keys were k[b, :, :kv_len[b]] (0: all of k's length).
    ``sinks`` [H] (gpt-oss): per-head logits of a key with no value, one more term of each
    softmax's sum, as in ``mx.fast.scaled_dot_product_attention``; the kernels take none."""
    B, H, Lq, D = q.shape
    Hk, Lk = k.shape[1], k.shape[2]
    G = H // Hk
    n_chunks = -(-Lk // chunk)
    pad = n_chunks * chunk - Lk
    qf = q.astype(mx.float32).reshape(B, Hk, G * Lq, D) * scale  # rows r = g * Lq + i
    kf, vf = k.astype(mx.float32), v.astype(mx.float32)
    if pad:
        widths = [(0, 0), (0, 0), (0, pad), (0, 0)]
        kf, vf = mx.pad(kf, widths), mx.pad(vf, widths)
    s = qf @ kf.transpose(0, 1, 3, 2)  # [B, Hk, R, Lk + pad] (natural log base; kernels use base 2)
    ok = visible_keys(
        Lq, Lk, causal=causal, window=window, kv_start=kv_start, width=Lk + pad, kv_len=kv_len
    )
    ok = mx.broadcast_to(ok[:, :, None], (ok.shape[0], 1, G, Lq, Lk + pad)).reshape(
        ok.shape[0], 1, G * Lq, -1
    )
    s = mx.where(ok, s, -mx.inf).reshape(B, Hk, G * Lq, n_chunks, chunk)
    # pass 1: per chunk, m_c = max s, p = e^(s - m_c), l_c = sum p, o_c = p @ v
    m = s.max(axis=-1)
    m_safe = mx.where(m == -mx.inf, 0.0, m)
    p = mx.exp(s - m_safe[..., None])  # e^-inf = 0 on hidden keys
    l = p.sum(axis=-1)
    o = p.transpose(0, 1, 3, 2, 4) @ vf.reshape(B, Hk, n_chunks, chunk, D)  # [B, Hk, C, R, D]
    # pass 2: M = max_c m_c, w_c = e^(m_c - M), out = sum w_c o_c / sum w_c l_c
    M = m.max(axis=-1, keepdims=True)
    if sinks is not None:  # head h = kv head * G + g, its rows g * Lq + i
        sink = mx.repeat(sinks.astype(mx.float32).reshape(1, Hk, G, 1), Lq, axis=3).reshape(
            1, Hk, G * Lq, 1
        )
        M = mx.maximum(M, sink)
    w = mx.where(m == -mx.inf, 0.0, mx.exp(m - mx.where(M == -mx.inf, 0.0, M)))
    L = (l * w).sum(axis=-1)
    if sinks is not None:
        L = L + mx.exp(sink - M)[..., 0]
    out = (o * w.transpose(0, 1, 3, 2)[..., None]).sum(axis=2)
    out = mx.where(L[..., None] > 0, out / mx.where(L > 0, L, 1.0)[..., None], 0.0)
    return out.reshape(B, H, Lq, D).astype(q.dtype)


# --------------------------------------------------------------------------------------------
# Kernels: one body for both backends
# --------------------------------------------------------------------------------------------

# The kernel sources: files in block_attention/ (read once here; the tests' CPU emulator builds
# the same bodies). The bodies are written against macros that each backend's header defines.
SOURCES = Path(__file__).with_name("block_attention")
PASS1_BODY = sources.read(SOURCES, "pass1.inc")  # CUDA cores / SIMD lanes
PASS1_MMA_BODY = sources.read(SOURCES, "pass1_mma.inc")  # tensor cores (CUDA, bf16 / fp16)
PASS2_BODY = sources.read(SOURCES, "pass2.inc")  # the reduction over key chunks
CUDA_HEADER, CUDA_PASS1, CUDA_MMA, CUDA_PASS2 = (
    sources.compact(sources.read(SOURCES, name))
    for name in ("cuda_header.cuh", "cuda_pass1.cuh", "cuda_mma.cuh", "cuda_pass2.cuh")
)
METAL_HEADER, METAL_PASS1, METAL_PASS2 = (
    sources.compact(sources.read(SOURCES, name))
    for name in ("metal_header.metal", "metal_pass1.metal", "metal_pass2.metal")
)

PASS1_INPUTS = ["q", "k", "v", "kv_start", "kv_len", "flags", "scale", "counters"]
PASS1_OUTPUTS = ["o_part", "m_part", "l_part"]
PASS2_INPUTS = ["o_part", "m_part", "l_part"]
# The tensor-core pass 1 (CUDA, bf16 / fp16; PASS1_MMA_BODY): used when True. Its blocks hold
# 16 rows, so each reduction tail is short; MMA_FUSED makes the whole call one launch.
USE_MMA = True
MMA_FUSED = True
MMA_WARPS = 8
MMA_TILES_PER_WARP = 8  # per chunk, at least
MMA_TARGET_BLOCKS = 132  # one 8-warp block per SM of a 132-SM GPU
MMA_MAX_SPLITS = 64


@dataclass(frozen=True)
class KernelConfig:
    """Compile-time shape of pass 1 for one (backend, head dim)."""

    warps: int  # NW
    rows_per_warp: int  # WR: 16 or 8
    dim_groups: int  # DG: lanes across D in PV (16 with WR 16, 32 with WR 8: 8 rows per lane)
    k_tile_dims: int  # DK: dims of K staged at once (D on CUDA; less on Metal)
    v_in_smem: bool  # V tile staged in shared memory (CUDA) or read from device memory (Metal)
    head_dim: int

    @property
    def rows(self) -> int:
        return self.warps * self.rows_per_warp

    @property
    def smem_floats(self) -> int:
        D, DK, WR = self.head_dim, self.k_tile_dims, self.rows_per_warp
        k_tile = TILE * (DK + 4)
        v_tile = TILE * D if self.v_in_smem else 0
        return (
            k_tile + v_tile + self.rows * (D + 4) + self.warps * TILE * (WR + 4) + self.warps * WR
        )

    def template(self):
        return [
            ("D", self.head_dim),
            ("DK", self.k_tile_dims),
            ("WR", self.rows_per_warp),
            ("DG", self.dim_groups),
            ("NW", self.warps),
            ("V_SMEM", self.v_in_smem),
        ]


def kernel_config(backend: str, head_dim: int) -> KernelConfig:
    """CUDA: 4 warps x 16 rows (x 8 at D=256), K and V tiles in dynamic shared memory (44-103 KB).
    Metal: at most 32 KB of threadgroup memory: 2 warps, V read from device memory, K staged
    32 (D=128) or 64 dims at a time (22-28 KB)."""
    wr, dg = (8, 32) if head_dim > 128 else (16, 16)
    if backend == "cuda":
        return KernelConfig(4, wr, dg, k_tile_dims=head_dim, v_in_smem=True, head_dim=head_dim)
    dk = 32 if head_dim == 128 else 64
    return KernelConfig(2, wr, dg, k_tile_dims=dk, v_in_smem=False, head_dim=head_dim)


@dataclass(frozen=True)
class MmaConfig:
    """Compile-time shape of the tensor-core pass 1: NW warps over one block's 16 rows, each with
    its own ring of STAGES tiles of KT keys (q rows and the rings in shared memory)."""

    warps: int
    tile_keys: int  # KT: 16 or 32
    stages: int  # 2..4: STAGES - 1 tiles are copied while one is computed
    head_dim: int
    fused: bool

    rows = 16

    @property
    def smem_bytes(self) -> int:
        D, NW = self.head_dim, self.warps
        tiles = 2 * (16 * (D + 8) + NW * self.stages * 2 * self.tile_keys * (D + 8))  # T is 2 bytes
        combine = 4 * (NW * 16 * 2 + NW * 16 * (D + 4))  # m, l, O of every warp (fp32)
        return max(tiles, combine)

    def template(self):
        return [
            ("D", self.head_dim),
            ("NW", self.warps),
            ("KT", self.tile_keys),
            ("STAGES", self.stages),
            ("FUSED", self.fused),
        ]


def mma_config(
    head_dim: int,
    warps: int = 0,
    fused: Optional[bool] = None,
    tile_keys: int = 16,
    stages: int = 2,
) -> MmaConfig:
    """Defaults: MMA_WARPS warps, 16-key tiles, 2 stages (D=128: 139 KB with 8 warps); at D=256
    4 warps (the same bytes)."""
    warps = warps or (MMA_WARPS if head_dim <= 128 else MMA_WARPS // 2)
    return MmaConfig(warps, tile_keys, stages, head_dim, MMA_FUSED if fused is None else fused)


def gpu_backend() -> Optional[str]:
    """The GPU backend, "cuda" or "metal", when it is present and the default device is the GPU."""
    return device.gpu()


# One row per kernel: (body, header, inputs, outputs, inputs made row-contiguous, shared memory
# in bytes from the config on CUDA, None where the body declares its own).
# fmt: off
KERNELS = {
    ("cuda", "mma"): (CUDA_MMA, CUDA_HEADER, PASS1_INPUTS, PASS1_OUTPUTS + ["out"], False,
                      lambda cfg: cfg.smem_bytes),
    ("cuda", "pass1"): (CUDA_PASS1, CUDA_HEADER, PASS1_INPUTS, PASS1_OUTPUTS, False,
                        lambda cfg: cfg.smem_floats * 4),
    ("cuda", "pass2"): (CUDA_PASS2, CUDA_HEADER, PASS2_INPUTS, ["out"], True, None),
    ("metal", "pass1"): (METAL_PASS1, METAL_HEADER, PASS1_INPUTS, PASS1_OUTPUTS, False, None),
    ("metal", "pass2"): (METAL_PASS2, METAL_HEADER, PASS2_INPUTS, ["out"], True, None),
}
# fmt: on
_kernels: Dict[tuple, object] = {}
_consts: Dict[tuple, mx.array] = {}


def _kernel(backend: str, which: str, cfg):
    """Build (once per backend, pass and config) the kernel object; dtype is a template arg.
    ``which``: "pass1", "pass2" or "mma" (the tensor-core pass 1, fused or not by its template;
    CUDA)."""
    key = (backend, which, cfg if which != "pass2" else cfg.head_dim)
    if key not in _kernels:
        source, header, inputs, outputs, row_contiguous, smem = KERNELS[backend, which]
        make = mx.fast.cuda_kernel if backend == "cuda" else mx.fast.metal_kernel
        extra = {"shared_memory": smem(cfg)} if smem else {}
        _kernels[key] = make(
            name=f"dflash_block_attn_{which}",
            input_names=inputs,
            output_names=outputs,
            source=source,
            header=header,
            ensure_row_contiguous=row_contiguous,
            **extra,
        )
    return _kernels[key]


def _const(key: tuple, make) -> mx.array:
    """Small parameter arrays, made once and reused (no host-to-device copy per call)."""
    if key not in _consts:
        _consts[key] = make()
    return _consts[key]


def chunk_count(keys: int, target_blocks: int, blocks_per_chunk: int, min_keys: int) -> int:
    """Key chunks for pass 1: enough blocks to fill the GPU, at least ``min_keys`` keys each."""
    return max(1, min(target_blocks // blocks_per_chunk, -(-keys // min_keys)))


def split_count(Lq: int, Lk: int, H: int, Hk: int, B: int, rows: int, window: Optional[int]) -> int:
    """chunk_count for the CUDA-core kernel (two 32-key tiles per chunk, at least), from shapes."""
    keys = min(Lk, Lq + window - 1) if window else Lk
    groups = -(-((H // Hk) * Lq) // rows)
    return chunk_count(keys, TARGET_BLOCKS, B * Hk * groups, 2 * TILE)


@dataclass
class _Plan:
    """Everything a call needs that does not depend on the key length, built once per signature
    (the per-layer call is on the critical path of a CPU-bound forward pass)."""

    pass1: object
    pass2: Optional[object]  # None when every call is one launch (fused reduction)
    mma: bool  # the tensor-core pass 1 (four outputs; with one chunk it writes the output itself)
    counters: mx.array  # fused: one ticket counter per (batch, KV head, row group), kept at 0
    max_splits: int  # fused: the reduction's weights must fit in shared memory
    min_keys: int  # keys per chunk, at least
    target_blocks: int  # pass-1 blocks to aim for
    template1: list
    template2: list
    flags: mx.array
    qscale: mx.array
    zeros: mx.array
    shape: Tuple[int, int, int, int]  # B, H, Lq, D
    threads: int
    grid_yz: Tuple[int, int]  # (B * Hk, row groups)
    blocks_per_split: int
    key_skip: int  # keys before Lk - key_skip are outside every row's window (0: none)
    dtype: object


_plans: Dict[tuple, _Plan] = {}


def _plan(backend, q, Hk, scale, causal, window, config) -> _Plan:
    B, H, Lq, D = q.shape
    mma = isinstance(config, MmaConfig) or (
        config is None and backend == "cuda" and USE_MMA and q.dtype in (mx.bfloat16, mx.float16)
    )
    if mma:
        cfg = config or mma_config(D)
        template1 = [("T", q.dtype)] + cfg.template()
        fused, rows, min_keys = cfg.fused, cfg.rows, MMA_TILES_PER_WARP * cfg.warps * cfg.tile_keys
        target_blocks = MMA_TARGET_BLOCKS
        max_splits = min(MMA_MAX_SPLITS, cfg.smem_bytes // (4 * rows) - 1)
        pass1 = _kernel(backend, "mma", cfg)
    else:
        cfg = config or kernel_config(backend, D)
        template1 = [("T", q.dtype)] + cfg.template()
        if backend == "metal":
            template1.append(("SMEM_FLOATS", cfg.smem_floats))
        fused, rows, min_keys = False, cfg.rows, 2 * TILE  # pass 2 is its own kernel
        target_blocks = TARGET_BLOCKS
        max_splits = 1 << 30
        pass1 = _kernel(backend, "pass1", cfg)
    groups = -(-((H // Hk) * Lq) // rows)
    counters = mx.zeros((B * Hk * groups,), dtype=mx.int32)
    mx.eval(counters)  # a real buffer now: the fused kernel updates it in place
    return _Plan(
        pass1=pass1,
        pass2=None if fused else _kernel(backend, "pass2", cfg),
        mma=mma,
        counters=counters,
        max_splits=max_splits,
        min_keys=min_keys,
        target_blocks=target_blocks,
        template1=template1,
        template2=[("T", q.dtype), ("D", D)],
        flags=_const(
            ("flags", bool(causal), int(window or 0)),
            lambda: mx.array([int(causal), int(window or 0)], dtype=mx.int32),
        ),
        qscale=_const(("scale", float(scale)), lambda: mx.array([scale * LOG2E], dtype=mx.float32)),
        zeros=_const(("zeros", B), lambda: mx.zeros((B,), dtype=mx.int32)),
        shape=(B, H, Lq, D),
        threads=cfg.warps * 32,
        grid_yz=(B * Hk, groups),
        blocks_per_split=B * Hk * groups,
        key_skip=(Lq + window - 1) if window else 0,
        dtype=q.dtype,
    )


def block_attention_kernel(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    *,
    scale: float,
    causal: bool = True,
    window: Optional[int] = None,
    kv_start: Optional[mx.array] = None,
    kv_len: Optional[mx.array] = None,
    backend: Optional[str] = None,
    config=None,
    splits: Optional[int] = None,
    checked: bool = False,
) -> mx.array:
    """The two-pass block attention as GPU kernels (CUDA or Metal). k and v may be strided views
    (e.g. the live slice of a KV cache buffer): they are read in place, not copied.
    ``config`` (a KernelConfig or MmaConfig) and ``splits`` override the tuned defaults (for
    benchmarks); ``checked`` skips the argument checks (the caller ran ``unsupported``).
    ``kv_len`` (int32 [B]; 0: all of k's length) gives each batch row its own key length, with
    the reference's semantics.
    No self-check here: callers that want the reference in place of a failing kernel ask
    ``kernel_verified`` first, as ``block_attention`` and the engine's routing do."""
    backend = backend or gpu_backend()
    if backend is None:
        raise RuntimeError(
            "block_attention_kernel needs the CUDA or Metal backend as the default device"
        )
    if not checked:
        check_supported(q, k, v)
    return LAUNCHERS[backend](
        q,
        k,
        v,
        scale=scale,
        causal=causal,
        window=window,
        kv_start=kv_start,
        kv_len=kv_len,
        backend=backend,
        config=config,
        splits=splits,
    )


def _launch(
    q, k, v, *, scale, causal, window, kv_start, kv_len=None, backend, config, splits
) -> mx.array:
    """Plan (once per signature) and launch the kernels of ``backend``. The chunk count comes from
    k's length (the longest a row may have): with ``kv_len``, shorter rows get fewer tiles per
    chunk, or none."""
    Hk, Lk = k.shape[1], k.shape[2]
    key = (backend, q.dtype, q.shape, Hk, scale, causal, window, config, USE_MMA, MMA_FUSED)
    plan = _plans.get(key)
    if plan is None:
        plan = _plans[key] = _plan(backend, q, Hk, scale, causal, window, config)
    B, H, Lq, D = plan.shape
    if not splits:
        keys = min(Lk, plan.key_skip) if plan.key_skip else Lk
        splits = chunk_count(keys, plan.target_blocks, plan.blocks_per_split, plan.min_keys)
    splits = min(splits, plan.max_splits)
    if kv_start is None:
        kv_start = plan.zeros
    elif kv_start.dtype != mx.int32:
        kv_start = kv_start.astype(mx.int32)
    if kv_len is None:
        kv_len = plan.zeros  # 0: the row's length is k's
    elif kv_len.dtype != mx.int32:
        kv_len = kv_len.astype(mx.int32)
    parts = [(B, H, Lq, splits, D), (B, H, Lq, splits), (B, H, Lq, splits)]
    one_launch = plan.pass2 is None or (plan.mma and splits == 1)
    with_out = plan.mma or plan.pass2 is None
    outs = plan.pass1(
        inputs=[q, k, v, kv_start, kv_len, plan.flags, plan.qscale, plan.counters],
        output_shapes=parts + ([(B, H, Lq, D)] if with_out else []),
        output_dtypes=[mx.float32] * 3 + ([plan.dtype] if with_out else []),
        grid=(splits * plan.threads, plan.grid_yz[0], plan.grid_yz[1]),
        threadgroup=(plan.threads, 1, 1),
        template=plan.template1,
    )
    if one_launch:
        return outs[3]
    o_part, m_part, l_part = outs[:3]
    return plan.pass2(
        inputs=[o_part, m_part, l_part],
        output_shapes=[(B, H, Lq, D)],
        output_dtypes=[plan.dtype],
        grid=(B * H * Lq * D, 1, 1),
        threadgroup=(D, 1, 1),
        template=plan.template2,
    )[0]


# The launcher per backend: the one place the kernels run (tests register deliberately broken
# ones here to check the self-check's fallback).
LAUNCHERS: Dict[str, Callable[..., mx.array]] = {"cuda": _launch, "metal": _launch}

# The self-check case: B = 1 (2 with kv_start: rows 0 and 21 keys of padding), G = 2 query heads
# per KV head, 16 rows over 83 live keys of a 96-key buffer (a strided view, as a KV cache's;
# 3 tiles, the last one partial), window 24 when the call has one, in 2 chunks (pass 2 or the
# fused reduction runs). With kv_len: B = 2, k is the first 96 keys of a 128-key buffer (a
# ragged cache's bucketed width), rows of 83 and 61 keys (CHECK_LENGTHS; the second row's chunks
# hold fewer tiles). The reference runs on the CPU. A few ms, once per machine and kind of call.
CHECK_SHAPE = (4, 2, 16, 83, 96)  # H, Hk, Lq, Lk, buffer length
CHECK_WINDOW = 24
CHECK_SPLITS = 2
CHECK_LENGTHS = (83, 61)


def _check_case(dtype, D: int, causal: bool, windowed: bool, padded: bool, ragged: bool = False):
    H, Hk, Lq, Lk, cap = CHECK_SHAPE
    B = 2 if padded or ragged else 1
    width, buffer = (cap, cap + 32) if ragged else (Lk, cap)  # k's length, the buffer's
    keys = mx.random.split(mx.random.key(selfcheck.SEED), 3)
    q = mx.random.normal((B, H, Lq, D), key=keys[0]).astype(dtype)
    k = mx.random.normal((B, Hk, buffer, D), key=keys[1]).astype(dtype)[:, :, :width]
    v = mx.random.normal((B, Hk, buffer, D), key=keys[2]).astype(dtype)[:, :, :width]
    kv_start = mx.array([0, 21], dtype=mx.int32) if padded else None
    kv_len = mx.array(CHECK_LENGTHS, dtype=mx.int32) if ragged else None
    return (
        q,
        k,
        v,
        dict(
            scale=D**-0.5,
            causal=causal,
            window=CHECK_WINDOW if windowed else None,
            kv_start=kv_start,
            kv_len=kv_len,
        ),
    )


def kernel_verified(
    q: mx.array,
    *,
    causal: bool = True,
    window: Optional[int] = None,
    kv_start: Optional[mx.array] = None,
    kv_len: Optional[mx.array] = None,
    backend: Optional[str] = None,
    config=None,
) -> bool:
    """Whether the kernels may serve this call: they passed their self-check (run now, once per
    process, for this backend, dtype, head dim, config and mask flags: kv_start, kv_len given or
    not) or checks are off (``selfcheck``). False: use ``block_attention_reference``; a warning
    has been given."""
    backend = backend or gpu_backend()
    D = q.shape[-1]
    key = (
        ("dtype", q.dtype),
        ("head_dim", D),
        ("causal", bool(causal)),
        ("window", bool(window)),
        ("kv_start", kv_start is not None),
        ("kv_len", kv_len is not None),
        ("config", config),
    )
    ok = selfcheck.known("block attention", backend, key)
    if ok is not None:
        return ok

    q_, k_, v_, kw = _check_case(
        q.dtype, D, causal, bool(window), kv_start is not None, kv_len is not None
    )

    def kernel():
        return {
            "out": LAUNCHERS[backend](
                q_, k_, v_, **kw, backend=backend, config=config, splits=CHECK_SPLITS
            )
        }

    def reference():
        with mx.stream(mx.cpu):  # an fp32 oracle: MLX's fp32 matmuls on CUDA round through TF32
            return {"out": block_attention_reference(q_, k_, v_, **kw)}

    return selfcheck.verified(
        "block attention", backend, key, kernel, reference, selfcheck.tolerance(q.dtype)
    )


def check_supported(q: mx.array, k: mx.array, v: mx.array) -> None:
    """Raise ValueError for what the kernels do not cover."""
    reason = unsupported(q, k, v)
    if reason:
        raise ValueError(reason)


def unsupported(
    q: mx.array, k: mx.array, v: mx.array, head_dims: Optional[tuple] = HEAD_DIMS
) -> Optional[str]:
    """Why the kernels (or, with head_dims=None, the reference) cannot run these arrays, or None."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        return "q, k and v must be [B, heads, length, head_dim]"
    B, H, Lq, D = q.shape
    if head_dims is not None and D not in head_dims:
        return f"head dim {D} is not one of {head_dims}"
    if k.shape != v.shape or k.shape[0] != B or k.shape[3] != D:
        return f"k {k.shape} and v {v.shape} do not match q {q.shape}"
    if H % k.shape[1]:
        return f"{H} query heads are not a multiple of {k.shape[1]} KV heads"
    if k.shape[2] < Lq:
        return f"{Lq} query rows need at least as many keys, got {k.shape[2]}"
    if (
        (head_dims is not None and q.dtype not in DTYPES)
        or k.dtype != q.dtype
        or v.dtype != q.dtype
    ):
        return f"dtypes {q.dtype}, {k.dtype}, {v.dtype}: need one of {DTYPES}, all the same"
    return None


def block_attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    *,
    scale: float,
    causal: bool = True,
    window: Optional[int] = None,
    kv_start: Optional[mx.array] = None,
    kv_len: Optional[mx.array] = None,
) -> mx.array:
    """The kernel on a GPU backend if it passed its self-check (``kernel_verified``), else the
    reference."""
    backend = gpu_backend()
    if (
        backend is not None
        and unsupported(q, k, v) is None
        and kernel_verified(
            q, causal=causal, window=window, kv_start=kv_start, kv_len=kv_len, backend=backend
        )
    ):
        return block_attention_kernel(
            q,
            k,
            v,
            scale=scale,
            causal=causal,
            window=window,
            kv_start=kv_start,
            kv_len=kv_len,
            backend=backend,
            checked=True,
        )
    return block_attention_reference(
        q, k, v, scale=scale, causal=causal, window=window, kv_start=kv_start, kv_len=kv_len
    )


def kernel_sources(backend: str) -> Tuple[str, ...]:
    """(header, pass-1 body, pass-2 body[, tensor-core pass 1]) for a backend: for inspection and
    offline compile checks."""
    if backend == "cuda":
        return CUDA_HEADER, CUDA_PASS1, CUDA_PASS2, CUDA_MMA
    return METAL_HEADER, METAL_PASS1, METAL_PASS2


__all__ = [
    "block_attention",
    "block_attention_kernel",
    "block_attention_reference",
    "chunk_count",
    "gpu_backend",
    "kernel_config",
    "kernel_sources",
    "kernel_verified",
    "mma_config",
    "row_lengths",
    "split_count",
    "unsupported",
    "visible_keys",
]
