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
SDPA's multi-row path on CUDA pays 35-50 ms for every new key length):

    CUDA, bf16 / fp16   PASS1_MMA_BODY: pass 1 on tensor cores (mma.sync), pass 2 fused in: one launch
    CUDA fp32, Metal    PASS1_BODY on CUDA cores / SIMD lanes, then PASS2_BODY: two launches

The bodies are written once against a few macros that each backend's header (and the tests'
CPU emulator) defines.

``block_attention_kernel`` runs the kernels as they are (what the GPU tests and benchmarks
compare and time). ``block_attention`` and the engine's routing first ask ``kernel_verified``:
once per process and kind of call (backend, dtype, head dim, mask flags), the kernel runs a
small seeded case against the reference (``selfcheck``); after a compile error or a mismatch
they warn once and use the reference. The Metal kernels have never run on Apple hardware.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import mlx.core as mx

from ..ops import device
from . import selfcheck

LOG2E = 1.4426950408889634
HEAD_DIMS = (64, 128, 256)
DTYPES = (mx.float32, mx.float16, mx.bfloat16)
TILE = 32  # keys per tile: one per lane of a 32-wide warp / simdgroup
REFERENCE_CHUNK = 128  # keys per chunk in the reference's first pass
TARGET_BLOCKS = 264  # pass-1 blocks to aim for (about two per SM on an H100/H200)


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
    rows = mx.arange(Lq)[None, None, :, None] + (lengths - Lq)  # absolute position of each query row
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
) -> mx.array:
    """The two-pass block attention in MLX ops, fp32 inside; returns q's dtype, shape [B, H, Lq, D].
    ``kv_len`` (int [B]): row b as if its keys were k[b, :, :kv_len[b]] (0: all of k's length)."""
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
    ok = visible_keys(Lq, Lk, causal=causal, window=window, kv_start=kv_start, width=Lk + pad, kv_len=kv_len)
    ok = mx.broadcast_to(ok[:, :, None], (ok.shape[0], 1, G, Lq, Lk + pad)).reshape(ok.shape[0], 1, G * Lq, -1)
    s = mx.where(ok, s, -mx.inf).reshape(B, Hk, G * Lq, n_chunks, chunk)
    # pass 1: per chunk, m_c = max s, p = e^(s - m_c), l_c = sum p, o_c = p @ v
    m = s.max(axis=-1)
    m_safe = mx.where(m == -mx.inf, 0.0, m)
    p = mx.exp(s - m_safe[..., None])  # e^-inf = 0 on hidden keys
    l = p.sum(axis=-1)
    o = p.transpose(0, 1, 3, 2, 4) @ vf.reshape(B, Hk, n_chunks, chunk, D)  # [B, Hk, C, R, D]
    # pass 2: M = max_c m_c, w_c = e^(m_c - M), out = sum w_c o_c / sum w_c l_c
    M = m.max(axis=-1, keepdims=True)
    w = mx.where(m == -mx.inf, 0.0, mx.exp(m - mx.where(M == -mx.inf, 0.0, M)))
    L = (l * w).sum(axis=-1)
    out = (o * w.transpose(0, 1, 3, 2)[..., None]).sum(axis=2)
    out = mx.where(L[..., None] > 0, out / mx.where(L > 0, L, 1.0)[..., None], 0.0)
    return out.reshape(B, H, Lq, D).astype(q.dtype)


# --------------------------------------------------------------------------------------------
# Kernels: one body for both backends
# --------------------------------------------------------------------------------------------

# Text shared by both pass-1 bodies. SETUP: shapes, this block's batch row and KV head, masks.
# Lk is this batch row's key length: kv_len[b] (at most the buffer's k_shape[2]; 0: all of it),
# so every bound below (tiles, loads, masks, the rows' positions q_pos0 + i) is per row.
SETUP = r"""
    const int H = q_shape[1];
    const int Lq = q_shape[2];
    const int Hk = k_shape[1];
    const int G = H / Hk;
    const int R = G * Lq;
    const int b = bh / Hk;
    const int kvh = bh - b * Hk;
    const int Lk = kv_len[b] > 0 ? IMIN(k_shape[2], kv_len[b]) : k_shape[2];
    const bool causal = flags[0] != 0;
    const int window = flags[1];
    const float qscale = scale[0];
    const int first_key = kv_start[b];
    const int q_pos0 = Lk - Lq;
"""

# KEY_RANGE (after TK, keys per tile, and VEC): the block's tiles [t_begin, t_end) of its chunk
# (keys before key_begin are outside every row's window: no tile reads them); K / V bases; whether
# 16-byte loads are safe for K / V and for q. The tiles are this batch row's (up to its Lk), dealt
# over the n_splits chunks that the host planned from the buffer's length: a shorter row gets
# fewer tiles per chunk, or none (an empty chunk writes m = -inf, l = 0, o = 0, which pass 2 and
# the fused tail weigh 0).
KEY_RANGE = r"""
    int key_begin = 0;
    if (window > 0) {
        key_begin = IMAX(0, q_pos0 - window + 1);
    }
    key_begin = IMAX(key_begin, first_key);
    const int tiles = IMAX(0, (Lk - key_begin + TK - 1) / TK);
    const int tps = (tiles + n_splits - 1) / n_splits;
    const int t_begin = split * tps;
    const int t_end = IMIN(t_begin + tps, tiles);
    const I64 kb = (I64)b * k_strides[0] + (I64)kvh * k_strides[1];
    const I64 vb = (I64)b * v_strides[0] + (I64)kvh * v_strides[1];
    const bool vec_ok = k_strides[3] == 1 && v_strides[3] == 1 && ALIGNED16(k) && ALIGNED16(v) &&
                        k_strides[0] % VEC == 0 && k_strides[1] % VEC == 0 && k_strides[2] % VEC == 0 &&
                        v_strides[0] % VEC == 0 && v_strides[1] % VEC == 0 && v_strides[2] % VEC == 0;
    const bool q_vec = q_strides[3] == 1 && ALIGNED16(q) && q_strides[0] % VEC == 0 &&
                       q_strides[1] % VEC == 0 && q_strides[2] % VEC == 0;
"""

# The fused reduction (CUDA): the last block of this (batch, KV head, row group) to finish (a
# ticket from a counter, fenced, that it resets to 0) reduces the partials of every chunk for its
# ROWS rows as pass 2 does, with 16-byte loads: M = max_c m_c, out = sum_c 2^(m_c - M) o_c / L.
FUSED_TAIL = r"""
    FENCE_DEVICE();
    SYNC_BLOCK();
    const int ticket_at = bh * GROUPS_Z + rg;
    if (tid == 0) {
        const int ticket = ATOMIC_ADD(counters, ticket_at, 1);
        smem[0] = (ticket == n_splits - 1) ? 1.0f : 0.0f;
    }
    SYNC_BLOCK();
    const bool last = smem[0] != 0.0f;
    SYNC_BLOCK();
    if (last) {
        FENCE_DEVICE();
        SPTR w_s = smem;                      // [ROWS][n_splits]: 2^(m_c - M)
        SPTR inv_s = smem + ROWS * n_splits;  // [ROWS]: 1 / sum_c 2^(m_c - M) l_c (0: no key)
        for (int rl = tid; rl < ROWS; rl += NT) {
            const int row = rg * ROWS + rl;
            float inv = 0.0f;
            if (row < R) {
                const int gq = row / Lq;
                const I64 base = (((I64)b * H + kvh * G + gq) * Lq + (row - gq * Lq)) * n_splits;
                float M = NEG_INF;
                for (int c = 0; c < n_splits; ++c) {
                    M = FMAX(M, LOAD_CG(m_part + base + c));
                }
                float L = 0.0f;
                for (int c = 0; c < n_splits; ++c) {
                    const float mc = LOAD_CG(m_part + base + c);
                    const float wt = (M == NEG_INF || mc == NEG_INF) ? 0.0f : EXP2(mc - M);
                    w_s[rl * n_splits + c] = wt;
                    L += LOAD_CG(l_part + base + c) * wt;
                }
                inv = L > 0.0f ? 1.0f / L : 0.0f;
            }
            inv_s[rl] = inv;
        }
        SYNC_BLOCK();
        for (int idx = tid; idx < ROWS * (D / 4); idx += NT) {
            const int rl = idx / (D / 4);
            const int d = (idx - rl * (D / 4)) * 4;
            const int row = rg * ROWS + rl;
            if (row < R) {
                const int gq = row / Lq;
                const I64 orow = ((I64)b * H + kvh * G + gq) * Lq + (row - gq * Lq);
                float4 acc = {0.0f, 0.0f, 0.0f, 0.0f};
                UNROLL4
                for (int c = 0; c < n_splits; ++c) {
                    const float4 x = LOAD_CG4(o_part + (orow * n_splits + c) * D + d);
                    const float wt = w_s[rl * n_splits + c];
                    acc.x += wt * x.x;
                    acc.y += wt * x.y;
                    acc.z += wt * x.z;
                    acc.w += wt * x.w;
                }
                const float inv = inv_s[rl];
                out[orow * D + d] = OUT_CAST(acc.x * inv);
                out[orow * D + d + 1] = OUT_CAST(acc.y * inv);
                out[orow * D + d + 2] = OUT_CAST(acc.z * inv);
                out[orow * D + d + 3] = OUT_CAST(acc.w * inv);
            }
        }
        if (tid == 0) {
            ATOMIC_STORE(counters, ticket_at, 0);
        }
    }
"""

# Pass 1. Block (split, b * Hk + kv head, row group): NW warps of 32 lanes; warp w owns WR rows
# (row r = g * Lq + i of this KV head's G * Lq rows), so one K/V tile serves every query head
# that shares the KV head. Per tile of 32 keys, staged in shared memory as fp32:
#   QK: lane = (key group kg = lane % 8, row group rg = lane / 8) computes a 4 x (WR / 4) block
#       of scores, keys kg + 8c and rows rg + 4i:  s = sum_d q[row][d] k[key][d]
#       (q pre-scaled by scale * log2 e; register tiling keeps shared-memory traffic per FMA low)
#   online softmax per row: m' = max(m, max over the 8 lanes of a row group),
#       alpha = 2^(m - m'), p = 2^(s - m'); l keeps per-lane partial sums until the end
#   PV: lane = (dim group dg = lane % DG, row group pg = lane / DG) owns PR rows x D / DG dims:
#       o[row][d] = alpha[row] o[row][d] + sum_key p[row][key] v[key][d]   (p, alpha via smem)
PASS1_BODY = (
    SETUP
    + r"""

    constexpr int NT = NW * 32;
    constexpr int ROWS = NW * WR;       // rows per block
    constexpr int QR = WR / 4;          // rows per lane in QK
    constexpr int PG = 32 / DG;         // row groups in PV
    constexpr int PR = WR / PG;         // rows per lane in PV
    constexpr int DPL = D / DG;         // dims per lane in PV (DPL / 4 chunks of 4)
    constexpr int KSTRIDE = DK + 4;
    constexpr int QSTRIDE = D + 4;
    constexpr int PSTRIDE = WR + 4;
    constexpr int VEC = 16 / (int)sizeof(T);
    SPTR k_s = smem;                                  // [32][KSTRIDE]
    SPTR v_s = k_s + 32 * KSTRIDE;                    // [32][D]       (V_SMEM)
    SPTR q_s = v_s + (V_SMEM ? 32 * D : 0);           // [ROWS][QSTRIDE]
    SPTR p_s = q_s + ROWS * QSTRIDE;                  // [NW][32][PSTRIDE]: p[key][row]
    SPTR a_s = p_s + NW * 32 * PSTRIDE;               // [NW][WR]: alpha per row

    constexpr int TK = 32;              // keys per tile
"""
    + KEY_RANGE
    + r"""
    if (q_vec) {
        UNROLL4
        for (int idx = tid; idx < ROWS * (D / VEC); idx += NT) {
            const int rl = idx / (D / VEC);
            const int d0 = (idx - rl * (D / VEC)) * VEC;
            const int row = rg * ROWS + rl;
            SPTR dst = q_s + rl * QSTRIDE + d0;
            if (row < R) {
                const int g = row / Lq;
                const int i = row - g * Lq;
                LOADV(dst, q + ((I64)b * q_strides[0] + (I64)(kvh * G + g) * q_strides[1] + (I64)i * q_strides[2] + d0));
                for (int e = 0; e < VEC; ++e) {
                    dst[e] *= qscale;
                }
            } else {
                for (int e = 0; e < VEC; ++e) {
                    dst[e] = 0.0f;
                }
            }
        }
    } else {
        for (int idx = tid; idx < ROWS * D; idx += NT) {
            const int rl = idx / D;
            const int d = idx - rl * D;
            const int row = rg * ROWS + rl;
            float val = 0.0f;
            if (row < R) {
                const int g = row / Lq;
                const int i = row - g * Lq;
                const int h = kvh * G + g;
                val = static_cast<float>(q[(I64)b * q_strides[0] + (I64)h * q_strides[1] +
                                           (I64)i * q_strides[2] + (I64)d * q_strides[3]]) * qscale;
            }
            q_s[rl * QSTRIDE + d] = val;
        }
    }

    const int wrow = warp * WR;         // first block-local row of this warp
    const int kg = lane & 7;            // QK: keys kg + 8c
    const int qg = lane >> 3;           // QK: rows qg + 4i
    const int dg = lane % DG;           // PV: dims (j * DG + dg) * 4 + e
    const int pg = lane / DG;           // PV: rows pg * PR + r
    SPTR p_w = p_s + warp * 32 * PSTRIDE;
    SPTR a_w = a_s + warp * WR;

    float m_i[QR];
    float l_i[QR];
    float o_i[PR][DPL];
    UNROLL
    for (int i = 0; i < QR; ++i) {
        m_i[i] = NEG_INF;
        l_i[i] = 0.0f;
    }
    UNROLL
    for (int r = 0; r < PR; ++r) {
        UNROLL
        for (int e = 0; e < DPL; ++e) {
            o_i[r][e] = 0.0f;
        }
    }

    for (int t = t_begin; t < t_end; ++t) {
        const int j0 = key_begin + t * 32;
        float s[QR][4];
        UNROLL
        for (int i = 0; i < QR; ++i) {
            UNROLL
            for (int c = 0; c < 4; ++c) {
                s[i][c] = 0.0f;
            }
        }
        for (int dk0 = 0; dk0 < D; dk0 += DK) {
            SYNC_BLOCK();
            if (vec_ok) {
                UNROLL4
                for (int idx = tid; idx < 32 * (DK / VEC); idx += NT) {
                    const int kk = idx / (DK / VEC);
                    const int dd = (idx - kk * (DK / VEC)) * VEC;
                    const int j = j0 + kk;
                    SPTR dst = k_s + kk * KSTRIDE + dd;
                    if (j < Lk) {
                        LOADV(dst, k + (kb + (I64)j * k_strides[2] + dk0 + dd));
                    } else {
                        for (int e = 0; e < VEC; ++e) {
                            dst[e] = 0.0f;
                        }
                    }
                }
                if (V_SMEM && dk0 == 0) {
                    UNROLL4
                    for (int idx = tid; idx < 32 * (D / VEC); idx += NT) {
                        const int kk = idx / (D / VEC);
                        const int dd = (idx - kk * (D / VEC)) * VEC;
                        const int j = j0 + kk;
                        SPTR dst = v_s + kk * D + dd;
                        if (j < Lk) {
                            LOADV(dst, v + (vb + (I64)j * v_strides[2] + dd));
                        } else {
                            for (int e = 0; e < VEC; ++e) {
                                dst[e] = 0.0f;
                            }
                        }
                    }
                }
            } else {
                for (int idx = tid; idx < 32 * DK; idx += NT) {
                    const int kk = idx / DK;
                    const int dd = idx - kk * DK;
                    const int j = j0 + kk;
                    k_s[kk * KSTRIDE + dd] = (j < Lk)
                        ? static_cast<float>(k[kb + (I64)j * k_strides[2] + (I64)(dk0 + dd) * k_strides[3]])
                        : 0.0f;
                }
                if (V_SMEM && dk0 == 0) {
                    for (int idx = tid; idx < 32 * D; idx += NT) {
                        const int kk = idx / D;
                        const int d = idx - kk * D;
                        const int j = j0 + kk;
                        v_s[idx] = (j < Lk)
                            ? static_cast<float>(v[vb + (I64)j * v_strides[2] + (I64)d * v_strides[3]])
                            : 0.0f;
                    }
                }
            }
            SYNC_BLOCK();
            UNROLL
            for (int dd = 0; dd < DK; dd += 4) {
                float4 kx[4];
                UNROLL
                for (int c = 0; c < 4; ++c) {
                    kx[c] = LDS4(k_s + (kg + 8 * c) * KSTRIDE + dd);
                }
                UNROLL
                for (int i = 0; i < QR; ++i) {
                    const float4 qx = LDS4(q_s + (wrow + qg + 4 * i) * QSTRIDE + dk0 + dd);
                    UNROLL
                    for (int c = 0; c < 4; ++c) {
                        s[i][c] += qx.x * kx[c].x + qx.y * kx[c].y + qx.z * kx[c].z + qx.w * kx[c].w;
                    }
                }
            }
        }

        UNROLL
        for (int i = 0; i < QR; ++i) {
            const int lr = wrow + qg + 4 * i;
            const int qpos = q_pos0 + ((rg * ROWS + lr) % Lq);
            bool ok[4];
            float sv[4];
            float tmax = NEG_INF;
            UNROLL
            for (int c = 0; c < 4; ++c) {
                const int j = j0 + kg + 8 * c;
                ok[c] = (j < Lk) && (j >= first_key) && (!causal || j <= qpos) && (window <= 0 || qpos - j < window);
                sv[c] = ok[c] ? s[i][c] : NEG_INF;
                tmax = FMAX(tmax, sv[c]);
            }
            const float m_new = FMAX(m_i[i], GROUP8_MAX(tmax));
            float alpha = 1.0f;
            float psum = 0.0f;
            UNROLL
            for (int c = 0; c < 4; ++c) {
                float p = 0.0f;
                if (m_new != NEG_INF && ok[c]) {
                    p = EXP2(sv[c] - m_new);
                }
                psum += p;
                p_w[(kg + 8 * c) * PSTRIDE + qg + 4 * i] = p;
            }
            if (m_new != NEG_INF) {
                alpha = (m_i[i] == NEG_INF) ? 0.0f : EXP2(m_i[i] - m_new);
            }
            l_i[i] = l_i[i] * alpha + psum;
            m_i[i] = m_new;
            if (kg == 0) {
                a_w[qg + 4 * i] = alpha;
            }
        }
        SYNC_WARP();

        UNROLL
        for (int r0 = 0; r0 < PR; r0 += 4) {
            const float4 ax = LDS4(a_w + pg * PR + r0);
            UNROLL
            for (int e = 0; e < DPL; ++e) {
                o_i[r0][e] *= ax.x;
                o_i[r0 + 1][e] *= ax.y;
                o_i[r0 + 2][e] *= ax.z;
                o_i[r0 + 3][e] *= ax.w;
            }
        }
        for (int kk = 0; kk < 32; ++kk) {
            const int jj = j0 + kk;
            float vx[DPL];
            UNROLL
            for (int jc = 0; jc < DPL / 4; ++jc) {
                const int d0 = (jc * DG + dg) * 4;
                if (V_SMEM) {
                    const float4 w = LDS4(v_s + kk * D + d0);
                    vx[jc * 4] = w.x;
                    vx[jc * 4 + 1] = w.y;
                    vx[jc * 4 + 2] = w.z;
                    vx[jc * 4 + 3] = w.w;
                } else {
                    UNROLL
                    for (int e = 0; e < 4; ++e) {
                        vx[jc * 4 + e] = (jj < Lk)
                            ? static_cast<float>(v[vb + (I64)jj * v_strides[2] + (I64)(d0 + e) * v_strides[3]])
                            : 0.0f;
                    }
                }
            }
            UNROLL
            for (int r0 = 0; r0 < PR; r0 += 4) {
                const float4 px = LDS4(p_w + kk * PSTRIDE + pg * PR + r0);
                UNROLL
                for (int e = 0; e < DPL; ++e) {
                    o_i[r0][e] += px.x * vx[e];
                    o_i[r0 + 1][e] += px.y * vx[e];
                    o_i[r0 + 2][e] += px.z * vx[e];
                    o_i[r0 + 3][e] += px.w * vx[e];
                }
            }
        }
        SYNC_WARP();
    }

    UNROLL
    for (int i = 0; i < QR; ++i) {
        const float l = GROUP8_SUM(l_i[i]);
        const int row = rg * ROWS + wrow + qg + 4 * i;
        if (row < R && kg == 0) {
            const int g = row / Lq;
            const int qi = row - g * Lq;
            const I64 part = (((I64)b * H + kvh * G + g) * Lq + qi) * n_splits + split;
            m_part[part] = m_i[i];
            l_part[part] = l;
        }
    }
    UNROLL
    for (int r = 0; r < PR; ++r) {
        const int row = rg * ROWS + wrow + pg * PR + r;
        if (row < R) {
            const int g = row / Lq;
            const int qi = row - g * Lq;
            const I64 part = (((I64)b * H + kvh * G + g) * Lq + qi) * n_splits + split;
            UNROLL
            for (int jc = 0; jc < DPL / 4; ++jc) {
                UNROLL
                for (int e = 0; e < 4; ++e) {
                    o_part[part * D + (jc * DG + dg) * 4 + e] = o_i[r][jc * 4 + e];
                }
            }
        }
    }
#if DFLASH_FUSED
"""
    + FUSED_TAIL
    + r"""
#endif
"""
)

# Pass 2. Block per output row (b, h, i), thread per dim d:
#   M = max_c m_c;  out[d] = sum_c 2^(m_c - M) o_c[d] / sum_c 2^(m_c - M) l_c   (0 if no key seen)
PASS2_BODY = r"""
    const int n_splits = m_part_shape[3];
    const I64 base = (I64)row * n_splits;
    float M = NEG_INF;
    UNROLL8
    for (int c = 0; c < n_splits; ++c) {
        M = FMAX(M, m_part[base + c]);
    }
    float acc = 0.0f;
    float L = 0.0f;
    if (M != NEG_INF) {
        UNROLL8
        for (int c = 0; c < n_splits; ++c) {
            const float mc = m_part[base + c];
            if (mc != NEG_INF) {
                const float w = EXP2(mc - M);
                L += l_part[base + c] * w;
                acc += o_part[(base + c) * D + d] * w;
            }
        }
    }
    out[(I64)row * D + d] = OUT_CAST(L > 0.0f ? acc / L : 0.0f);
"""

# Pass 1 on tensor cores (CUDA; T = bf16 or fp16), with the reduction over key chunks fused in.
# Block (split, b * Hk + kv head, group of 16 rows): NW warps share the block's 16 rows; warp w
# takes key tiles w, w + NW, ... of the block's chunk (KT keys each), staged in its own ring of
# STAGES shared-memory buffers by 16-byte asynchronous copies (STAGES - 1 tiles in flight), so
# the main loop needs no block barrier. Per tile, with mma.sync m16n8k16 (A 16 x 16 row-major,
# B 16 x 8 column-major, fp32 accumulators; lane = (g = lane / 4, t = lane % 4) holds rows g, g + 8):
#   S = Q K^T: A = the 16 rows of q, B = K rows as columns; exact products, fp32 sums, then
#       s = S * scale * log2 e
#   masks as in PASS1_BODY; online softmax per row: m' = max(m, max over the row's 4 lanes),
#       alpha = 2^(m - m'), p = 2^(s - m'), l = alpha l + sum p
#   O = alpha O + P V: the accumulator layout of S is the A layout of P, so P stays in
#       registers; P = hi + lo, both rounded to T, two MMAs: P loses about 2^-16, not 2^-8
# Then the warps' (m, l, O) are combined in shared memory (pass 2's formula), and the block
# writes the output (one chunk) or its chunk's partials; FUSED, the last block of a (batch, KV
# head, row group) to finish (a ticket from a counter that it resets) reduces those as pass 2
# would, with 16-byte loads, so a call is one launch.
PASS1_MMA_BODY = (
    SETUP
    + r"""

    constexpr int NT = NW * 32;
    constexpr int ROWS = 16;
    constexpr int DS = D + 8;           // row stride (elements of T) of q, K and V in shared memory
    constexpr int NKS = D / 16;         // k-steps of Q K^T
    constexpr int NST = KT / 8;         // 8-key column tiles of S
    constexpr int NDT = D / 8;          // 8-dim column tiles of O
    constexpr int OS = D + 4;           // row stride (floats) of the combine buffer
    constexpr int VEC = 16 / (int)sizeof(T);
    TPTR q_s = reinterpret_cast<TPTR>(smem);                  // [16][DS]
    TPTR kv_w = q_s + ROWS * DS + warp * STAGES * 2 * KT * DS;  // this warp's ring: [STAGES][K, V][KT][DS]

    constexpr int TK = KT;              // keys per tile
"""
    + KEY_RANGE
    + r"""

    // the block's q rows (zero past R)
    UNROLL4
    for (int idx = tid; idx < ROWS * (D / VEC); idx += NT) {
        const int rl = idx / (D / VEC);
        const int d0 = (idx - rl * (D / VEC)) * VEC;
        const int row = IMIN(rg * ROWS + rl, R - 1);
        const int gq = row / Lq;
        const I64 at = (I64)b * q_strides[0] + (I64)(kvh * G + gq) * q_strides[1] + (I64)(row - gq * Lq) * q_strides[2];
        TPTR dst = q_s + rl * DS + d0;
        if (q_vec) {
            CP_ASYNC16(dst, q + at + d0, rg * ROWS + rl < R);
        } else {
            for (int e = 0; e < VEC; ++e) {
                dst[e] = (rg * ROWS + rl < R) ? q[at + (I64)(d0 + e) * q_strides[3]] : static_cast<T>(0.0f);
            }
        }
    }
    CP_ASYNC_COMMIT();

    // this warp's buffer `buf` <- K and V rows of tile `tile` (zero past Lk); a commit group per tile
#define DFLASH_LOAD_TILE(tile, buf)                                                               \
    {                                                                                             \
        const int j0_ = key_begin + (tile) * KT;                                                  \
        TPTR kd_ = kv_w + (buf) * 2 * KT * DS;                                                    \
        TPTR vd_ = kd_ + KT * DS;                                                                 \
        UNROLL4                                                                                   \
        for (int idx = lane; idx < KT * (D / VEC); idx += 32) {                                   \
            const int kk = idx / (D / VEC);                                                       \
            const int d0 = (idx - kk * (D / VEC)) * VEC;                                          \
            const int j = j0_ + kk;                                                               \
            const I64 jr = IMIN(j, Lk - 1);                                                       \
            if (vec_ok) {                                                                         \
                CP_ASYNC16(kd_ + kk * DS + d0, k + (kb + jr * k_strides[2] + d0), j < Lk);        \
                CP_ASYNC16(vd_ + kk * DS + d0, v + (vb + jr * v_strides[2] + d0), j < Lk);        \
            } else {                                                                              \
                for (int e = 0; e < VEC; ++e) {                                                   \
                    kd_[kk * DS + d0 + e] = (j < Lk) ? k[kb + jr * k_strides[2] + (I64)(d0 + e) * k_strides[3]] : static_cast<T>(0.0f); \
                    vd_[kk * DS + d0 + e] = (j < Lk) ? v[vb + jr * v_strides[2] + (I64)(d0 + e) * v_strides[3]] : static_cast<T>(0.0f); \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
        CP_ASYNC_COMMIT();                                                                        \
    }

    UNROLL
    for (int st = 0; st < STAGES - 1; ++st) {
        if (t_begin + warp + st * NW < t_end) {
            DFLASH_LOAD_TILE(t_begin + warp + st * NW, st);
        } else {
            CP_ASYNC_COMMIT();
        }
    }
    CP_ASYNC_WAIT(STAGES - 1);  // this thread's q copies have landed (tiles may be in flight) ...
    SYNC_BLOCK();               // ... and every thread's

    const int g = lane >> 2;
    const int t = lane & 3;
    TPTR q_w = q_s;
    int qpos[2];
    UNROLL
    for (int h = 0; h < 2; ++h) {
        qpos[h] = q_pos0 + ((rg * ROWS + g + 8 * h) % Lq);
    }
    float m_i[2] = {NEG_INF, NEG_INF};
    float l_i[2] = {0.0f, 0.0f};
    float o_i[NDT][4];
    UNROLL
    for (int n = 0; n < NDT; ++n) {
        UNROLL
        for (int c = 0; c < 4; ++c) {
            o_i[n][c] = 0.0f;
        }
    }

    for (int tile = t_begin + warp; tile < t_end; tile += NW) {
        const int i = (tile - t_begin) / NW;  // this warp's i-th tile
        const int j0 = key_begin + tile * KT;
        CP_ASYNC_WAIT(STAGES - 2);  // this tile has landed (this lane's copies) ...
        SYNC_WARP();                // ... every lane's; and the warp is done with its tile i - 1
        if (tile + (STAGES - 1) * NW < t_end) {
            DFLASH_LOAD_TILE(tile + (STAGES - 1) * NW, (i + STAGES - 1) % STAGES);  // tile i - 1's buffer
        } else {
            CP_ASYNC_COMMIT();
        }
        TPTR k_s = kv_w + (i % STAGES) * 2 * KT * DS;
        TPTR v_s = k_s + KT * DS;

        float s[NST][4];
        UNROLL
        for (int n = 0; n < NST; ++n) {
            UNROLL
            for (int c = 0; c < 4; ++c) {
                s[n][c] = 0.0f;
            }
        }
        UNROLL
        for (int ks = 0; ks < NKS; ++ks) {
            unsigned a[4];
            a[0] = LD32(q_w + g * DS + ks * 16 + 2 * t);
            a[1] = LD32(q_w + (g + 8) * DS + ks * 16 + 2 * t);
            a[2] = LD32(q_w + g * DS + ks * 16 + 2 * t + 8);
            a[3] = LD32(q_w + (g + 8) * DS + ks * 16 + 2 * t + 8);
            UNROLL
            for (int n = 0; n < NST; ++n) {
                unsigned bq[2];
                bq[0] = LD32(k_s + (n * 8 + g) * DS + ks * 16 + 2 * t);
                bq[1] = LD32(k_s + (n * 8 + g) * DS + ks * 16 + 2 * t + 8);
                MMA16816(s[n], a, bq);
            }
        }

        float tmax[2] = {NEG_INF, NEG_INF};
        UNROLL
        for (int n = 0; n < NST; ++n) {
            UNROLL
            for (int c = 0; c < 4; ++c) {
                const int h = c >> 1;
                const int j = j0 + n * 8 + 2 * t + (c & 1);
                const bool ok = (j < Lk) && (j >= first_key) && (!causal || j <= qpos[h]) &&
                                (window <= 0 || qpos[h] - j < window);
                s[n][c] = ok ? s[n][c] * qscale : NEG_INF;
                tmax[h] = FMAX(tmax[h], s[n][c]);
            }
        }
        float m_new[2];
        UNROLL
        for (int h = 0; h < 2; ++h) {
            m_new[h] = FMAX(m_i[h], QUAD_MAX(tmax[h]));
            const float alpha = (m_new[h] == NEG_INF) ? 1.0f : EXP2(m_i[h] - m_new[h]);
            m_i[h] = m_new[h];
            l_i[h] *= alpha;
            UNROLL
            for (int n = 0; n < NDT; ++n) {
                o_i[n][2 * h] *= alpha;
                o_i[n][2 * h + 1] *= alpha;
            }
        }
        UNROLL
        for (int n = 0; n < NST; ++n) {
            UNROLL
            for (int c = 0; c < 4; ++c) {
                const int h = c >> 1;
                s[n][c] = (m_new[h] == NEG_INF) ? 0.0f : EXP2(s[n][c] - m_new[h]);
                l_i[h] += s[n][c];
            }
        }
        UNROLL
        for (int kk = 0; kk < KT / 16; ++kk) {
            unsigned hi[4];
            unsigned lo[4];
            UNROLL
            for (int r = 0; r < 4; ++r) {
                const float* pr = &s[2 * kk + (r >> 1)][2 * (r & 1)];
                const float h0 = ROUND_T(pr[0]);
                const float h1 = ROUND_T(pr[1]);
                hi[r] = PACK2(h0, h1);
                lo[r] = PACK2(pr[0] - h0, pr[1] - h1);
            }
            TPTR v0 = v_s + (kk * 16 + 2 * t) * DS + g;
            UNROLL
            for (int n = 0; n < NDT; ++n) {
                unsigned bv[2];
                bv[0] = RAW16(v0[n * 8]) | (RAW16(v0[DS + n * 8]) << 16);
                bv[1] = RAW16(v0[8 * DS + n * 8]) | (RAW16(v0[9 * DS + n * 8]) << 16);
                MMA16816(o_i[n], hi, bv);
                MMA16816(o_i[n], lo, bv);
            }
        }
    }
    CP_ASYNC_WAIT(0);
#undef DFLASH_LOAD_TILE

    // Combine the warps: M = max_w m_w, O = sum_w 2^(m_w - M) O_w, L = sum_w 2^(m_w - M) l_w;
    // then the output O / L (one chunk) or this chunk's partials (M, L, O)
    SYNC_BLOCK();
    SPTR cm = smem;                     // [NW][16]
    SPTR cl = cm + NW * 16;             // [NW][16]
    SPTR co = cl + NW * 16;             // [NW][16][OS]
    UNROLL
    for (int h = 0; h < 2; ++h) {
        const float l = QUAD_SUM(l_i[h]);
        if (t == 0) {
            cm[warp * 16 + g + 8 * h] = m_i[h];
            cl[warp * 16 + g + 8 * h] = l;
        }
    }
    UNROLL
    for (int n = 0; n < NDT; ++n) {
        UNROLL
        for (int c = 0; c < 4; ++c) {
            co[(warp * 16 + g + 8 * (c >> 1)) * OS + n * 8 + 2 * t + (c & 1)] = o_i[n][c];
        }
    }
    SYNC_BLOCK();
    for (int idx = tid; idx < 16 * D; idx += NT) {
        const int rl = idx / D;
        const int d = idx - rl * D;
        const int row = rg * ROWS + rl;
        if (row < R) {
            float M = NEG_INF;
            for (int w = 0; w < NW; ++w) {
                M = FMAX(M, cm[w * 16 + rl]);
            }
            float O = 0.0f;
            float L = 0.0f;
            if (M != NEG_INF) {
                for (int w = 0; w < NW; ++w) {
                    const float wt = EXP2(cm[w * 16 + rl] - M);
                    O += wt * co[(w * 16 + rl) * OS + d];
                    L += wt * cl[w * 16 + rl];
                }
            }
            const int gq = row / Lq;
            const I64 orow = ((I64)b * H + kvh * G + gq) * Lq + (row - gq * Lq);
            if (n_splits == 1) {
                out[orow * D + d] = OUT_CAST(L > 0.0f ? O / L : 0.0f);
            } else {
                o_part[(orow * n_splits + split) * D + d] = O;
                if (d == 0) {
                    m_part[orow * n_splits + split] = M;
                    l_part[orow * n_splits + split] = L;
                }
            }
        }
    }
    if (FUSED && n_splits > 1) {
"""
    + FUSED_TAIL
    + r"""
    }
"""
)

CUDA_HEADER = r"""
#define SPTR float*
#define I64 long long
#define NEG_INF (-__int_as_float(0x7f800000))
#define IMAX(a, b) max((a), (b))
#define IMIN(a, b) min((a), (b))
#define FMAX(a, b) fmaxf((a), (b))
#define EXP2(x) exp2f(x)
#define UNROLL _Pragma("unroll")
#define UNROLL4 _Pragma("unroll 4")
#define UNROLL8 _Pragma("unroll 8")
#define SYNC_BLOCK() __syncthreads()
#define SYNC_WARP() __syncwarp()
#define LDS4(ptr) (*reinterpret_cast<const float4*>(ptr))
#define F4GET(v, c) ((c) == 0 ? (v).x : (c) == 1 ? (v).y : (c) == 2 ? (v).z : (v).w)
__device__ __forceinline__ float dflash_warp_max(float x) {
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}
__device__ __forceinline__ float dflash_warp_sum(float x) {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}
__device__ __forceinline__ float dflash_group8_max(float x) {
    for (int o = 1; o < 8; o <<= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}
__device__ __forceinline__ float dflash_group8_sum(float x) {
    for (int o = 1; o < 8; o <<= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}
template <typename TT>
__device__ __forceinline__ void dflash_loadv(float* dst, const TT* src) {
    // one 16-byte global load, converted to fp32 (callers check alignment)
    const uint4 raw = *reinterpret_cast<const uint4*>(src);
    const TT* vals = reinterpret_cast<const TT*>(&raw);
    for (int e = 0; e < (int)(16 / sizeof(TT)); ++e) dst[e] = static_cast<float>(vals[e]);
}
#define WARP_MAX(x) dflash_warp_max(x)
#define WARP_SUM(x) dflash_warp_sum(x)
#define GROUP8_MAX(x) dflash_group8_max(x)
#define GROUP8_SUM(x) dflash_group8_sum(x)
#define LOADV(dst, src) dflash_loadv((dst), (src))
#define ALIGNED16(p) ((reinterpret_cast<unsigned long long>(p) & 15ull) == 0)
#define FENCE_DEVICE() __threadfence()
#define LOAD_CG(ptr) __ldcg(ptr)
#define LOAD_CG4(ptr) __ldcg(reinterpret_cast<const float4*>(ptr))
#define ATOMIC_ADD(base, i, x) atomicAdd(const_cast<int*>(reinterpret_cast<const int*>(base)) + (i), (x))
#define ATOMIC_STORE(base, i, x) atomicExch(const_cast<int*>(reinterpret_cast<const int*>(base)) + (i), (x))
#define OUT_CAST(x) static_cast<T>(x)
#define TPTR T*
#define COPY16(dst, src) (*reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src))
#define LD32(ptr) (*reinterpret_cast<const unsigned int*>(ptr))
#define RAW16(x) ((unsigned int)(*reinterpret_cast<const unsigned short*>(&(x))))
__device__ __forceinline__ float dflash_quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float dflash_quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}
template <typename TT> struct dflash_mma;
template <> struct dflash_mma<__nv_bfloat16> {
    __device__ __forceinline__ static float round(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }
    __device__ __forceinline__ static unsigned int pack(float x, float y) {
        __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
        return *reinterpret_cast<unsigned int*>(&h);
    }
    __device__ __forceinline__ static void run(float* d, const unsigned int* a, const unsigned int* b) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
};
template <> struct dflash_mma<__half> {
    __device__ __forceinline__ static float round(float x) { return __half2float(__float2half_rn(x)); }
    __device__ __forceinline__ static unsigned int pack(float x, float y) {
        __half2 h = __floats2half2_rn(x, y);
        return *reinterpret_cast<unsigned int*>(&h);
    }
    __device__ __forceinline__ static void run(float* d, const unsigned int* a, const unsigned int* b) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
};
__device__ __forceinline__ void dflash_cp_async16(void* dst, const void* src, bool valid) {
    // 16 bytes global -> shared without a register round trip; valid false: 16 zero bytes
    const unsigned int to = static_cast<unsigned int>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(to), "l"(src), "r"(valid ? 16 : 0));
}
#define CP_ASYNC16(dst, src, valid) dflash_cp_async16((dst), (src), (valid))
#define CP_ASYNC_COMMIT() asm volatile("cp.async.commit_group;")
#define CP_ASYNC_WAIT(n) asm volatile("cp.async.wait_group %0;" ::"n"(n))
#define QUAD_MAX(x) dflash_quad_max(x)
#define QUAD_SUM(x) dflash_quad_sum(x)
#define MMA16816(d, a, b) dflash_mma<T>::run((d), (a), (b))
#define PACK2(x, y) dflash_mma<T>::pack((x), (y))
#define ROUND_T(x) dflash_mma<T>::round(x)
"""

CUDA_PASS1 = (
    r"""
    extern __shared__ float4 dflash_smem4[];
    float* smem = reinterpret_cast<float*>(dflash_smem4);
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int split = blockIdx.x;
    const int n_splits = gridDim.x;
    const int bh = blockIdx.y;
    const int rg = blockIdx.z;
    const int GROUPS_Z = gridDim.z;
"""
    + PASS1_BODY
)

CUDA_MMA = CUDA_PASS1.replace(PASS1_BODY, PASS1_MMA_BODY)

CUDA_PASS2 = (
    r"""
    const int row = blockIdx.x;
    const int d = threadIdx.x;
"""
    + PASS2_BODY
)

METAL_HEADER = r"""
#define SPTR threadgroup float*
#define I64 long
#define NEG_INF (-INFINITY)
#define IMAX(a, b) metal::max((a), (b))
#define IMIN(a, b) metal::min((a), (b))
#define FMAX(a, b) metal::fmax((a), (b))
#define EXP2(x) metal::exp2(x)
#define UNROLL _Pragma("clang loop unroll(full)")
#define UNROLL4 _Pragma("clang loop unroll_count(4)")
#define UNROLL8 _Pragma("clang loop unroll_count(8)")
#define SYNC_BLOCK() threadgroup_barrier(mem_flags::mem_threadgroup)
#define SYNC_WARP() simdgroup_barrier(mem_flags::mem_threadgroup)
#define LDS4(ptr) (*((threadgroup const float4*)(ptr)))
#define F4GET(v, c) ((v)[(c)])
#define WARP_MAX(x) simd_max(x)
#define WARP_SUM(x) simd_sum(x)
inline float dflash_group8_max(float x) {
    for (ushort o = 1; o < 8; o <<= 1) x = metal::fmax(x, simd_shuffle_xor(x, o));
    return x;
}
inline float dflash_group8_sum(float x) {
    for (ushort o = 1; o < 8; o <<= 1) x += simd_shuffle_xor(x, o);
    return x;
}
#define GROUP8_MAX(x) dflash_group8_max(x)
#define GROUP8_SUM(x) dflash_group8_sum(x)
#define LOADV(dst, src) for (int _e = 0; _e < VEC; ++_e) (dst)[_e] = static_cast<float>((src)[_e])
#define ALIGNED16(p) true
#define OUT_CAST(x) static_cast<T>(x)
"""

METAL_PASS1 = (
    r"""
    threadgroup float4 smem4[SMEM_FLOATS / 4];
    threadgroup float* smem = (threadgroup float*)smem4;
    const int tid = (int)thread_position_in_threadgroup.x;
    const int lane = (int)thread_index_in_simdgroup;
    const int warp = (int)simdgroup_index_in_threadgroup;
    const int split = (int)threadgroup_position_in_grid.x;
    const int n_splits = (int)threadgroups_per_grid.x;
    const int bh = (int)threadgroup_position_in_grid.y;
    const int rg = (int)threadgroup_position_in_grid.z;
"""
    + PASS1_BODY
)

METAL_PASS2 = (
    r"""
    const int row = (int)threadgroup_position_in_grid.x;
    const int d = (int)thread_position_in_threadgroup.x;
"""
    + PASS2_BODY
)

def _compact(source: str) -> str:
    """Drop comments, indentation and runs of blanks: MLX rebuilds and hashes the source on
    every call."""
    lines = (" ".join(line.split("//")[0].split()) for line in source.splitlines())
    return "\n" + "\n".join(line for line in lines if line) + "\n"  # MLX pastes it between lines


CUDA_HEADER, CUDA_PASS1, CUDA_MMA, CUDA_PASS2 = map(_compact, (CUDA_HEADER, CUDA_PASS1, CUDA_MMA, CUDA_PASS2))
METAL_HEADER, METAL_PASS1, METAL_PASS2 = map(_compact, (METAL_HEADER, METAL_PASS1, METAL_PASS2))

PASS1_INPUTS = ["q", "k", "v", "kv_start", "kv_len", "flags", "scale", "counters"]
PASS1_OUTPUTS = ["o_part", "m_part", "l_part"]
PASS2_INPUTS = ["o_part", "m_part", "l_part"]
# True (CUDA only): the last block of each (batch, KV head, row group) does pass 2, one launch
# per call. Off by default for the CUDA-core kernel: measured on an H200 (docs/gpu-attention.md),
# its serial tail made a Qwen3-4B verify pass 14.9 ms against 9.8 ms with pass 2 as its own kernel.
# Do not turn it on before it is fixed: in the default pair's fp32 verify passes on an H200
# (benchmarks/verify_ops.py --modes kernel,kernel-fused, 2026-11-24) its logits were off by 26-56
# at batch 1 and 8, where the two-launch kernel's match the one-row pass.
FUSE_REDUCTION = False
# The tensor-core pass 1 (CUDA, bf16 / fp16; PASS1_MMA_BODY): used when True. Its blocks hold
# 16 rows, so each reduction tail is short; MMA_FUSED makes the whole call one launch.
USE_MMA = True
MMA_FUSED = True
MMA_WARPS = 8
MMA_TILES_PER_WARP = 8  # per chunk, at least
MMA_TARGET_BLOCKS = 132  # one 8-warp block per SM of an H100 / H200
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
        return k_tile + v_tile + self.rows * (D + 4) + self.warps * TILE * (WR + 4) + self.warps * WR

    def template(self):
        return [("D", self.head_dim), ("DK", self.k_tile_dims), ("WR", self.rows_per_warp),
                ("DG", self.dim_groups), ("NW", self.warps), ("V_SMEM", self.v_in_smem)]


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
        return [("D", self.head_dim), ("NW", self.warps), ("KT", self.tile_keys), ("STAGES", self.stages),
                ("FUSED", self.fused)]


def mma_config(head_dim: int, warps: int = 0, fused: Optional[bool] = None, tile_keys: int = 16,
               stages: int = 2) -> MmaConfig:
    """Defaults: MMA_WARPS warps, 16-key tiles, 2 stages (D=128: 139 KB with 8 warps); at D=256
    4 warps (the same bytes)."""
    warps = warps or (MMA_WARPS if head_dim <= 128 else MMA_WARPS // 2)
    return MmaConfig(warps, tile_keys, stages, head_dim, MMA_FUSED if fused is None else fused)


def gpu_backend() -> Optional[str]:
    """"cuda" or "metal" when that backend is present and the default device is the GPU."""
    return device.gpu()


_kernels: Dict[tuple, object] = {}
_consts: Dict[tuple, mx.array] = {}


def _kernel(backend: str, which: str, cfg):
    """Build (once per backend, pass and config) the kernel object; dtype is a template arg.
    ``which``: "pass1", "pass2", "fused" (pass 1 whose last blocks also do pass 2; CUDA) or
    "mma" (the tensor-core pass 1, fused or not by its template; CUDA)."""
    key = (backend, which, cfg if which != "pass2" else cfg.head_dim)
    if key not in _kernels:
        if backend == "cuda":
            if which == "mma":
                _kernels[key] = mx.fast.cuda_kernel(
                    name="dflash_block_attn_mma",
                    input_names=PASS1_INPUTS,
                    output_names=PASS1_OUTPUTS + ["out"],
                    source=CUDA_MMA,
                    header=CUDA_HEADER,
                    ensure_row_contiguous=False,
                    shared_memory=cfg.smem_bytes,
                )
            elif which in ("pass1", "fused"):
                fused = which == "fused"
                _kernels[key] = mx.fast.cuda_kernel(
                    name=f"dflash_block_attn_{which}",
                    input_names=PASS1_INPUTS,
                    output_names=PASS1_OUTPUTS + (["out"] if fused else []),
                    source=CUDA_PASS1,
                    header=f"\n#define DFLASH_FUSED {int(fused)}\n" + CUDA_HEADER,
                    ensure_row_contiguous=False,
                    shared_memory=cfg.smem_floats * 4,
                )
            else:
                _kernels[key] = mx.fast.cuda_kernel(
                    name="dflash_block_attn_pass2",
                    input_names=PASS2_INPUTS,
                    output_names=["out"],
                    source=CUDA_PASS2,
                    header=CUDA_HEADER,
                )
        else:
            if which == "pass1":
                _kernels[key] = mx.fast.metal_kernel(
                    name="dflash_block_attn_pass1",
                    input_names=PASS1_INPUTS,
                    output_names=PASS1_OUTPUTS,
                    source=METAL_PASS1,
                    header="\n#define DFLASH_FUSED 0\n" + METAL_HEADER,
                    ensure_row_contiguous=False,
                )
            else:
                _kernels[key] = mx.fast.metal_kernel(
                    name="dflash_block_attn_pass2",
                    input_names=PASS2_INPUTS,
                    output_names=["out"],
                    source=METAL_PASS2,
                    header=METAL_HEADER,
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
        fused, rows, min_keys = backend == "cuda" and FUSE_REDUCTION, cfg.rows, 2 * TILE
        target_blocks = TARGET_BLOCKS
        max_splits = cfg.smem_floats // cfg.rows - 2 if fused else 1 << 30
        pass1 = _kernel(backend, "fused" if fused else "pass1", cfg)
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
        flags=_const(("flags", bool(causal), int(window or 0)), lambda: mx.array([int(causal), int(window or 0)], dtype=mx.int32)),
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
        raise RuntimeError("block_attention_kernel needs the CUDA or Metal backend as the default device")
    if not checked:
        check_supported(q, k, v)
    return LAUNCHERS[backend](q, k, v, scale=scale, causal=causal, window=window, kv_start=kv_start,
                              kv_len=kv_len, backend=backend, config=config, splits=splits)


def _launch(q, k, v, *, scale, causal, window, kv_start, kv_len=None, backend, config, splits) -> mx.array:
    """Plan (once per signature) and launch the kernels of ``backend``. The chunk count comes from
    k's length (the longest a row may have): with ``kv_len``, shorter rows get fewer tiles per
    chunk, or none."""
    Hk, Lk = k.shape[1], k.shape[2]
    key = (backend, q.dtype, q.shape, Hk, scale, causal, window, config, FUSE_REDUCTION, USE_MMA, MMA_FUSED)
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
# hold fewer tiles). The reference runs on the CPU. A few ms, once per process and kind of call.
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
    return q, k, v, dict(scale=D**-0.5, causal=causal, window=CHECK_WINDOW if windowed else None, kv_start=kv_start,
                         kv_len=kv_len)


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
    key = (("dtype", q.dtype), ("head_dim", D), ("causal", bool(causal)), ("window", bool(window)),
           ("kv_start", kv_start is not None), ("kv_len", kv_len is not None), ("config", config))
    ok = selfcheck.known("block attention", backend, key)
    if ok is not None:
        return ok

    q_, k_, v_, kw = _check_case(q.dtype, D, causal, bool(window), kv_start is not None, kv_len is not None)

    def kernel():
        return {"out": LAUNCHERS[backend](q_, k_, v_, **kw, backend=backend, config=config, splits=CHECK_SPLITS)}

    def reference():
        with mx.stream(mx.cpu):  # an fp32 oracle: MLX's fp32 matmuls on CUDA round through TF32
            return {"out": block_attention_reference(q_, k_, v_, **kw)}

    return selfcheck.verified("block attention", backend, key, kernel, reference, selfcheck.tolerance(q.dtype))


def check_supported(q: mx.array, k: mx.array, v: mx.array) -> None:
    """Raise ValueError for what the kernels do not cover."""
    reason = unsupported(q, k, v)
    if reason:
        raise ValueError(reason)


def unsupported(q: mx.array, k: mx.array, v: mx.array, head_dims: Optional[tuple] = HEAD_DIMS) -> Optional[str]:
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
    if (head_dims is not None and q.dtype not in DTYPES) or k.dtype != q.dtype or v.dtype != q.dtype:
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
    if (backend is not None and unsupported(q, k, v) is None
            and kernel_verified(q, causal=causal, window=window, kv_start=kv_start, kv_len=kv_len, backend=backend)):
        return block_attention_kernel(q, k, v, scale=scale, causal=causal, window=window, kv_start=kv_start,
                                      kv_len=kv_len, backend=backend, checked=True)
    return block_attention_reference(q, k, v, scale=scale, causal=causal, window=window, kv_start=kv_start,
                                     kv_len=kv_len)


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
