"""Block attention (verify / draft passes): the two-pass reference against stock SDPA, the kernel
body run on the CPU under an emulated GPU, the kernels themselves where a GPU backend exists,
and DFlash losslessness with the routed path on.

Tolerances (max |a - b| over the output, whose entries are O(1): values are N(0, 1)):
- fp32: 2e-5. Both sides compute the exact softmax in fp32; they differ only in summation
  order (chunked online softmax vs one row softmax), about 1e-6 here.
- bf16 / fp16: the reference reads the same rounded inputs, computes in fp32 and rounds the
  output once; stock SDPA also rounds once at the end, so the two differ by at most about
  one output ulp plus fp32 noise: 2^-7 relative for bf16 (0.0078 at |x| <= 1, 2 ulp at 2^-8),
  2^-10 for fp16. We allow 1.6e-2 (bf16) and 2e-3 (fp16) absolute on outputs bounded by ~2.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from dflash_batch.engine.ops import attention as routing
from dflash_batch.engine.ops import switch
from dflash_batch.engine.ops.kernels import attention as ka

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.base import create_causal_mask

from tests import emulator as emulator_build
from tests.synthetic import assert_dflash_lossless

TOL = {mx.float32: 2e-5, mx.bfloat16: 1.6e-2, mx.float16: 2e-3}


def stock(q, k, v, scale, *, causal, window=None, kv_start=None):
    """mx.fast.scaled_dot_product_attention with the equivalent mask."""
    Lq, Lk = q.shape[2], k.shape[2]
    if kv_start is None and window is None:
        mask = "causal" if causal else None
    else:
        mask = ka.visible_keys(Lq, Lk, causal=causal, window=window, kv_start=kv_start, width=Lk)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def make_qkv(B, H, Hk, Lq, Lk, D, dtype, seed=0, cap=None):
    """q contiguous; k, v as the live [:Lk] slice of a larger buffer, like a KV cache."""
    mx.random.seed(seed)
    cap = cap or Lk
    q = mx.random.normal((B, H, Lq, D)).astype(dtype)
    kb = mx.random.normal((B, Hk, cap, D)).astype(dtype)
    vb = mx.random.normal((B, Hk, cap, D)).astype(dtype)
    return q, kb[:, :, :Lk], vb[:, :, :Lk]


def max_err(a, b):
    return mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item()


# (B, H, Hk, Lq, Lk, D): GQA 1/2/4/8, 1 to 16 rows, key lengths around chunk and tile edges
SHAPES = [
    (1, 4, 4, 16, 16, 64),
    (1, 8, 2, 16, 200, 64),
    (1, 32, 8, 16, 300, 128),
    (1, 16, 8, 7, 129, 128),
    (1, 8, 1, 2, 33, 128),
    (2, 8, 4, 16, 257, 256),
    (1, 4, 2, 1, 40, 256),
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize("causal", [True, False])
def test_reference_matches_stock(shape, dtype, causal):
    B, H, Hk, Lq, Lk, D = shape
    q, k, v = make_qkv(B, H, Hk, Lq, Lk, D, dtype, seed=Lk, cap=Lk + 37)
    scale = D**-0.5
    ref = ka.block_attention_reference(q, k, v, scale=scale, causal=causal)
    assert ref.shape == q.shape and ref.dtype == dtype
    assert max_err(ref, stock(q, k, v, scale, causal=causal)) < TOL[dtype]


@pytest.mark.parametrize("window", [1, 5, 40, 1000])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_reference_sliding_window_matches_stock(window, dtype):
    B, H, Hk, Lq, Lk, D = 1, 8, 2, 16, 150, 128
    q, k, v = make_qkv(B, H, Hk, Lq, Lk, D, dtype, seed=window)
    ref = ka.block_attention_reference(q, k, v, scale=0.1, causal=True, window=window)
    mask = create_causal_mask(Lq, offset=Lk - Lq, window_size=window)  # the drafter's own mask
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.1, mask=mask)
    assert max_err(ref, want) < TOL[dtype]


@pytest.mark.parametrize("causal", [True, False])
def test_reference_left_padding_matches_stock(causal):
    B, H, Hk, Lq, Lk, D = 3, 8, 4, 16, 90, 64
    q, k, v = make_qkv(B, H, Hk, Lq, Lk, D, mx.float32, seed=3)
    kv_start = mx.array([0, 17, 70], dtype=mx.int32)
    ref = ka.block_attention_reference(q, k, v, scale=0.125, causal=causal, kv_start=kv_start)
    want = stock(q, k, v, 0.125, causal=causal, kv_start=kv_start)
    assert max_err(ref, want) < TOL[mx.float32]


def ragged_mask(B, Lq, Lk, *, lengths, causal, window=None, kv_start=None):
    """The bool mask [B, 1, Lq, Lk] of per-row key lengths, built key by key in numpy (not with
    visible_keys): row b has L = lengths[b] keys (0: Lk), its query i sits at L - Lq + i."""
    mask = np.zeros((B, 1, Lq, Lk), dtype=bool)
    for b in range(B):
        L = lengths[b] or Lk
        for i in range(Lq):
            pos = L - Lq + i
            for j in range(Lk):
                mask[b, 0, i, j] = (
                    j < L
                    and (not causal or j <= pos)
                    and (not window or pos - j < window)
                    and (kv_start is None or j >= kv_start[b])
                )
    return mx.array(mask)


# (Lq, lengths, causal, window, kv_start) over a 96-key view of a 120-key buffer, B = 4
RAGGED_REFERENCE_CASES = [
    (16, [96, 61, 17, 40], True, None, None),  # verify passes of a ragged batch
    (16, [96, 61, 17, 40], False, None, None),
    (16, [96, 61, 17, 40], True, 5, None),
    (16, [90, 61, 30, 40], True, None, [0, 20, 14, 3]),  # with left padding
    (16, [0, 50, 96, 33], False, 9, [4, 0, 60, 10]),  # 0: the whole length
    (1, [96, 61, 1, 40], True, None, None),  # a decoding step of a ragged batch
    (1, [96, 61, 2, 40], True, 3, [0, 60, 0, 39]),
    (3, [96, 3, 17, 40], True, None, None),
    (3, [96, 3, 17, 40], False, None, [10, 0, 5, 0]),
]


@pytest.mark.parametrize(
    "case",
    RAGGED_REFERENCE_CASES,
    ids=lambda c: f"Lq{c[0]}-{'causal' if c[2] else 'bidir'}-w{c[3]}-{'pad' if c[4] else 'nopad'}",
)
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_reference_row_lengths_match_stock(case, dtype):
    """kv_len against stock SDPA over the whole buffer with the equivalent bool mask, and each row
    against stock SDPA on that row's keys alone (k[b, :, :kv_len[b]], as if it were its cache)."""
    Lq, lengths, causal, window, kv_start = case
    B, H, Hk, Lk, D = 4, 8, 2, 96, 64
    q, k, v = make_qkv(B, H, Hk, Lq, Lk, D, dtype, seed=Lq + sum(lengths), cap=120)
    kv_len = mx.array(lengths, dtype=mx.int32)
    starts = None if kv_start is None else mx.array(kv_start, dtype=mx.int32)
    ref = ka.block_attention_reference(
        q, k, v, scale=0.125, causal=causal, window=window, kv_start=starts, kv_len=kv_len
    )
    assert ref.shape == q.shape and ref.dtype == dtype
    mask = ragged_mask(B, Lq, Lk, lengths=lengths, causal=causal, window=window, kv_start=kv_start)
    assert mx.array_equal(
        mask,
        ka.visible_keys(
            Lq, Lk, causal=causal, window=window, kv_start=starts, width=Lk, kv_len=kv_len
        ),
    ).item()
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    assert max_err(ref, want) < TOL[dtype]
    for b, L in enumerate(lengths):
        L = L or Lk
        alone = ka.block_attention_reference(
            q[b : b + 1],
            k[b : b + 1, :, :L],
            v[b : b + 1, :, :L],
            scale=0.125,
            causal=causal,
            window=window,
            kv_start=None if starts is None else starts[b : b + 1],
        )
        assert max_err(ref[b : b + 1], alone) < TOL[dtype]
        row_mask = ragged_mask(
            1,
            Lq,
            L,
            lengths=[L],
            causal=causal,
            window=window,
            kv_start=None if kv_start is None else kv_start[b : b + 1],
        )
        stock_alone = mx.fast.scaled_dot_product_attention(
            q[b : b + 1], k[b : b + 1, :, :L], v[b : b + 1, :, :L], scale=0.125, mask=row_mask
        )
        assert max_err(ref[b : b + 1], stock_alone) < TOL[dtype]


def test_reference_row_lengths_zero_or_past_the_buffer_mean_the_whole_length():
    q, k, v = make_qkv(3, 4, 2, 5, 40, 64, mx.float32, seed=8)
    whole = ka.block_attention_reference(q, k, v, scale=0.1, causal=True)
    for lengths in ([0, 0, 0], [40, 41, 1000]):
        got = ka.block_attention_reference(
            q, k, v, scale=0.1, causal=True, kv_len=mx.array(lengths, dtype=mx.int32)
        )
        assert max_err(got, whole) == 0.0


def test_reference_chunking_does_not_change_the_result():
    q, k, v = make_qkv(1, 8, 2, 16, 1000, 128, mx.float32, seed=9)
    a = ka.block_attention_reference(q, k, v, scale=0.09, chunk=32)
    b = ka.block_attention_reference(q, k, v, scale=0.09, chunk=1024)
    assert max_err(a, b) < 2e-6


def test_reference_fully_hidden_row_is_zero():
    q, k, v = make_qkv(2, 4, 2, 4, 20, 64, mx.float32, seed=5)
    out = ka.block_attention_reference(
        q, k, v, scale=0.1, causal=True, kv_start=mx.array([0, 19], dtype=mx.int32)
    )
    # batch row 1 sees only key 19: rows 0..2 (positions 16..18) see nothing, row 3 sees key 19
    assert mx.all(out[1, :, :3] == 0).item()
    assert max_err(out[1, :, 3], mx.repeat(v[1, :, 19], 2, axis=0)) < 1e-6


def test_unsupported_shapes_are_named():
    q, k, v = make_qkv(1, 4, 2, 4, 20, 96, mx.float32)
    assert "head dim 96" in ka.unsupported(q, k, v)
    q, k, v = make_qkv(1, 6, 4, 4, 20, 64, mx.float32)
    assert "multiple" in ka.unsupported(q, k, v)
    q, k, v = make_qkv(1, 4, 2, 4, 20, 64, mx.float32)
    assert ka.unsupported(q, k, v) is None


# --------------------------------------------------------------------------------------------
# The kernel body (shared by CUDA and Metal) compiled for the CPU with an emulated GPU:
# one OS thread per GPU thread, std::barrier for block and warp barriers, warp reductions
# through a shared buffer. Exercises the exact text of PASS1_BODY / PASS2_BODY.
# --------------------------------------------------------------------------------------------

EMU_HEADER = r"""
#include <algorithm>
#include <array>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <thread>
#include <vector>
struct float4 { float x, y, z, w; };
using Shape = std::array<int32_t, 8>;
using Strides = std::array<int64_t, 8>;
struct Ctx {
  std::barrier<>* block;
  std::vector<std::barrier<>*> warps;
  float red[32][32];
};
static float warp_reduce(Ctx* ctx, int warp, int lane, float x, bool is_max) {
  ctx->warps[warp]->arrive_and_wait();
  ctx->red[warp][lane] = x;
  ctx->warps[warp]->arrive_and_wait();
  float r = ctx->red[warp][0];
  for (int i = 1; i < 32; ++i) r = is_max ? std::fmax(r, ctx->red[warp][i]) : r + ctx->red[warp][i];
  ctx->warps[warp]->arrive_and_wait();
  return r;
}
#define SPTR float*
#define I64 long long
#define NEG_INF (-INFINITY)
#define IMAX(a, b) std::max((a), (b))
#define IMIN(a, b) std::min((a), (b))
#define FMAX(a, b) std::fmax((a), (b))
#define EXP2(x) std::exp2(x)
#define UNROLL
#define UNROLL4
#define UNROLL8
#define SYNC_BLOCK() ctx->block->arrive_and_wait()
#define SYNC_WARP() ctx->warps[warp]->arrive_and_wait()
#define LDS4(ptr) (*reinterpret_cast<const float4*>(ptr))
#define F4GET(v, c) ((c) == 0 ? (v).x : (c) == 1 ? (v).y : (c) == 2 ? (v).z : (v).w)
static float group8_reduce(Ctx* ctx, int warp, int lane, float x, bool is_max) {
  ctx->warps[warp]->arrive_and_wait();
  ctx->red[warp][lane] = x;
  ctx->warps[warp]->arrive_and_wait();
  const int base = lane & ~7;
  float r = ctx->red[warp][base];
  for (int i = 1; i < 8; ++i) r = is_max ? std::fmax(r, ctx->red[warp][base + i]) : r + ctx->red[warp][base + i];
  ctx->warps[warp]->arrive_and_wait();
  return r;
}
#define WARP_MAX(x) warp_reduce(ctx, warp, lane, (x), true)
#define WARP_SUM(x) warp_reduce(ctx, warp, lane, (x), false)
#define GROUP8_MAX(x) group8_reduce(ctx, warp, lane, (x), true)
#define GROUP8_SUM(x) group8_reduce(ctx, warp, lane, (x), false)
#define LOADV(dst, src) for (int _e = 0; _e < VEC; ++_e) (dst)[_e] = static_cast<float>((src)[_e])
#define ALIGNED16(p) true
#define FENCE_DEVICE()
#define LOAD_CG(ptr) (*(ptr))
#define LOAD_CG4(ptr) (*reinterpret_cast<const float4*>(ptr))
static int emu_atomic_add(const int32_t* base, int i, int x) {  // thread 0 only: no race
  int32_t* p = const_cast<int32_t*>(base) + i;
  const int old = *p;
  *p += x;
  return old;
}
#define ATOMIC_ADD(base, i, x) emu_atomic_add((base), (i), (x))
#define ATOMIC_STORE(base, i, x) (const_cast<int32_t*>(base)[i] = (x))
#define OUT_CAST(x) (x)
template <typename X> std::vector<X> load(const char* path, size_t n) {
  std::vector<X> x(n);
  FILE* f = fopen(path, "rb");
  if (fread(x.data(), sizeof(X), n, f) != n) { fprintf(stderr, "short read %s\n", path); std::exit(2); }
  fclose(f);
  return x;
}
"""

# pass1 (its template line comes first; T is the input type) and pass2, as the GPU runs them per
# thread, with the block's shared memory and the warp barriers in ctx; out is fp32 here
EMU_KERNELS = r"""
void pass1(Ctx* ctx, int tid, int split, int n_splits, int bh, int rg, float* smem,
           const T* q, Shape q_shape, Strides q_strides, const T* k, Shape k_shape, Strides k_strides,
           const T* v, Strides v_strides, const int32_t* kv_start, const int32_t* kv_len, const int32_t* flags,
           const float* scale,
           const int32_t* counters, float* o_part, float* m_part, float* l_part, float* out, int GROUPS_Z) {
  const int lane = tid & 31;
  const int warp = tid >> 5;
  PASS1
}

template <int D>
void pass2(int row, int d, const float* o_part, Shape m_part_shape, const float* m_part, const float* l_part, float* out) {
  PASS2
}
"""

# Every emulator's driver and entry point (after its pass1 / pass2): argv = folder, configuration
# index, B, H, Hk, Lq, Lk, cap, splits, groups
EMU_ENTRY = r"""
// Runs pass 1 block by block (one OS thread per GPU thread), then pass 2 where asked; writes out.bin.
template <typename Elem, int D, int NW, int SMEM_BYTES, typename Pass1>
int run_blocks(const char* dir, int B, int H, int Hk, int Lq, int Lk, int cap, int splits, int groups,
               bool pass2_after, Pass1 pass1_fn) {
  std::string d(dir);
  auto q = load<Elem>((d + "/q.bin").c_str(), (size_t)B * H * Lq * D);
  auto kb = load<Elem>((d + "/k.bin").c_str(), (size_t)B * Hk * cap * D);
  auto vb = load<Elem>((d + "/v.bin").c_str(), (size_t)B * Hk * cap * D);
  auto kv_start = load<int32_t>((d + "/kv_start.bin").c_str(), B);
  auto kv_len = load<int32_t>((d + "/kv_len.bin").c_str(), B);
  auto flags = load<int32_t>((d + "/flags.bin").c_str(), 2);
  auto scale = load<float>((d + "/scale.bin").c_str(), 1);
  Shape qs{B, H, Lq, D}, ks{B, Hk, Lk, D};
  Strides qst{(int64_t)H * Lq * D, (int64_t)Lq * D, D, 1};
  Strides kst{(int64_t)Hk * cap * D, (int64_t)cap * D, D, 1};
  const size_t rows = (size_t)B * H * Lq;
  std::vector<float> o_part(rows * splits * D, NAN), m_part(rows * splits, NAN), l_part(rows * splits, NAN);
  std::vector<float> out(rows * D, NAN);
  std::vector<int32_t> counters(B * Hk * groups, 0);
  constexpr int NT = NW * 32;
  for (int split = 0; split < splits; ++split)
    for (int bh = 0; bh < B * Hk; ++bh)
      for (int rg = 0; rg < groups; ++rg) {
        std::vector<float4> smem4(SMEM_BYTES / 16, float4{NAN, NAN, NAN, NAN});  // NaN: reads before writes show
        Ctx ctx;
        std::barrier<> block(NT);
        ctx.block = &block;
        std::vector<std::barrier<>*> wp;
        for (int w = 0; w < NW; ++w) wp.push_back(new std::barrier<>(32));
        ctx.warps = wp;
        std::vector<std::thread> th;
        for (int tid = 0; tid < NT; ++tid)
          th.emplace_back([&, tid] {
            pass1_fn(&ctx, tid, split, splits, bh, rg, reinterpret_cast<float*>(smem4.data()), q.data(), qs, qst,
                     kb.data(), ks, kst, vb.data(), kst, kv_start.data(), kv_len.data(), flags.data(), scale.data(),
                     counters.data(), o_part.data(), m_part.data(), l_part.data(), out.data(), groups);
          });
        for (auto& t : th) t.join();
        for (auto* w : wp) delete w;
      }
  for (int c : counters)
    if (c != 0) { fprintf(stderr, "a ticket counter was left at %d\n", c); return 4; }
  Shape ms{B, H, Lq, splits};
  if (pass2_after)
    for (size_t row = 0; row < rows; ++row)
      for (int dd = 0; dd < D; ++dd) pass2<D>((int)row, dd, o_part.data(), ms, m_part.data(), l_part.data(), out.data());
  FILE* f = fopen((d + "/out.bin").c_str(), "wb");
  fwrite(out.data(), sizeof(float), out.size(), f);
  fclose(f);
  return 0;
}

int main(int argc, char** argv) {
  const char* dir = argv[1];
  int cfg = atoi(argv[2]), B = atoi(argv[3]), H = atoi(argv[4]), Hk = atoi(argv[5]), Lq = atoi(argv[6]);
  int Lk = atoi(argv[7]), cap = atoi(argv[8]), splits = atoi(argv[9]), groups = atoi(argv[10]);
  switch (cfg) {
    CASES
  }
  return 3;
}
"""

EMU_MAIN = r"""
using T = float;
template <int D, int DK, int WR, int DG, int NW, bool V_SMEM>
KERNELS


"""

# (backend, head dim) configurations the emulator is built for
EMU_CONFIGS = [
    ("cuda", 64),
    ("cuda", 128),
    ("cuda", 256),
    ("metal", 64),
    ("metal", 128),
    ("metal", 256),
]


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    emulator_build.compiler()
    folder = tmp_path_factory.mktemp("emu")
    cases = []
    for n, (backend, D) in enumerate(EMU_CONFIGS):
        c = ka.kernel_config(backend, D)
        v = "true" if c.v_in_smem else "false"
        kernel = f"pass1<{D}, {c.k_tile_dims}, {c.rows_per_warp}, {c.dim_groups}, {c.warps}, {v}>"
        cases.append(
            f"case {n}: return run_blocks<float, {D}, {c.warps}, {c.smem_floats * 4}>"
            f"(dir, B, H, Hk, Lq, Lk, cap, splits, groups, true, {kernel});"
        )
    body1 = ka.PASS1_BODY
    body2 = ka.PASS2_BODY
    src = EMU_HEADER + (EMU_MAIN.replace("KERNELS", EMU_KERNELS) + EMU_ENTRY).replace(
        "PASS1", body1
    ).replace("PASS2", body2).replace("CASES", "\n    ".join(cases))
    exe = emulator_build.build(src, folder, "emu")  # pass 2 as its own kernel, as on the GPU

    def run(
        backend, q, k_buf, v_buf, Lk, *, scale, causal, window, kv_start, kv_len=None, splits=None
    ):
        B, H, Lq, D = q.shape
        Hk, cap = k_buf.shape[1], k_buf.shape[2]
        c = ka.kernel_config(backend, D)
        splits = splits or ka.split_count(Lq, Lk, H, Hk, B, c.rows, window)
        groups = -(-((H // Hk) * Lq) // c.rows)
        d = Path(folder) / "case"
        d.mkdir(exist_ok=True)
        np.asarray(q, dtype=np.float32).tofile(d / "q.bin")
        np.asarray(k_buf, dtype=np.float32).tofile(d / "k.bin")
        np.asarray(v_buf, dtype=np.float32).tofile(d / "v.bin")
        np.asarray(kv_start if kv_start is not None else np.zeros(B), dtype=np.int32).tofile(
            d / "kv_start.bin"
        )
        np.asarray(kv_len if kv_len is not None else np.zeros(B), dtype=np.int32).tofile(
            d / "kv_len.bin"
        )
        np.asarray([int(causal), int(window or 0)], dtype=np.int32).tofile(d / "flags.bin")
        np.asarray([scale * ka.LOG2E], dtype=np.float32).tofile(d / "scale.bin")
        cfg = EMU_CONFIGS.index((backend, D))
        args = [str(exe), str(d), cfg, B, H, Hk, Lq, Lk, cap, splits, groups]
        subprocess.run([str(a) for a in args], check=True, timeout=300)
        return mx.array(np.fromfile(d / "out.bin", dtype=np.float32).reshape(B, H, Lq, D))

    return run


# (backend, B, H, Hk, Lq, Lk, cap, D, causal, window, kv_start, splits)
# fmt: off
EMU_CASES = [
    ("cuda", 1, 8, 2, 16, 200, 230, 128, True, None, None, None),  # 2 row groups, 4 splits
    ("cuda", 1, 4, 4, 16, 16, 16, 64, True, None, None, None),  # keys == rows
    ("cuda", 1, 8, 4, 16, 300, 300, 128, True, None, None, 1),  # one split: 10 tiles, online rescaling
    ("cuda", 2, 4, 2, 3, 70, 80, 64, False, None, [0, 33], 5),  # bidirectional, padding, empty splits
    ("cuda", 1, 8, 2, 16, 150, 150, 256, True, 20, None, None),  # sliding window
    ("metal", 1, 8, 2, 16, 100, 120, 128, True, None, None, 2),
    ("metal", 1, 4, 2, 5, 90, 90, 256, True, 7, [3], None),  # K staged 64 dims at a time, V from memory
    ("metal", 2, 8, 8, 16, 70, 75, 64, False, None, [5, 0], 3),  # MHA: rows past R in the block
    ("cuda", 1, 16, 2, 16, 64, 64, 256, True, None, None, 1),  # 128 rows: 4 row groups
]
# fmt: on


@pytest.mark.parametrize("case", EMU_CASES, ids=lambda c: f"{c[0]}-D{c[7]}-Lq{c[4]}-Lk{c[5]}")
def test_kernel_body_on_emulated_gpu_matches_reference(emulator, case):
    backend, B, H, Hk, Lq, Lk, cap, D, causal, window, kv_start, splits = case
    q, k, v = make_qkv(B, H, Hk, Lq, Lk, D, mx.float32, seed=Lk + D, cap=cap)
    k_buf, v_buf = k.reshape(B, Hk, Lk, D), v.reshape(B, Hk, Lk, D)
    # the emulator reads the whole buffer with the cache's strides; rebuild it with padding
    pad = [(0, 0), (0, 0), (0, cap - Lk), (0, 0)]
    k_buf, v_buf = (
        mx.pad(k_buf, pad, constant_values=float("nan")),
        mx.pad(v_buf, pad, constant_values=float("nan")),
    )
    starts = None if kv_start is None else mx.array(kv_start, dtype=mx.int32)
    want = ka.block_attention_reference(
        q, k, v, scale=D**-0.5, causal=causal, window=window, kv_start=starts
    )
    got = emulator(
        backend,
        q,
        k_buf,
        v_buf,
        Lk,
        scale=D**-0.5,
        causal=causal,
        window=window,
        kv_start=kv_start,
        splits=splits,
    )
    assert not mx.isnan(got).any().item(), "a key past Lk leaked into the result"
    assert max_err(got, want) < 2e-5


def ragged_buffers(k, v, cap, lengths):
    """The cache buffers the emulator reads: k, v [B, Hk, Lk, D] padded to cap columns, with NaN in
    every column at or past a row's own length (0: Lk), so a key read past it shows in the result."""
    B, Hk, Lk, D = k.shape
    pad = [(0, 0), (0, 0), (0, cap - Lk), (0, 0)]
    k_buf, v_buf = mx.pad(k, pad), mx.pad(v, pad)
    live = mx.arange(cap)[None, :] < mx.array([L or Lk for L in lengths])[:, None]  # [B, cap]
    live = live[:, None, :, None]
    return mx.where(live, k_buf, float("nan")), mx.where(live, v_buf, float("nan"))


# Per-row key lengths (kv_len): (backend, B, H, Hk, Lq, Lk, cap, D, causal, window, kv_start, kv_len, splits)
# fmt: off
EMU_RAGGED_CASES = [
    ("cuda", 3, 8, 2, 16, 200, 230, 128, True, None, None, [200, 61, 17], 4),  # 7 / 2 / 1 tiles over 4 splits
    ("cuda", 2, 8, 2, 1, 130, 160, 64, True, None, [0, 5], [0, 40], 3),  # decoding step (Lq 1), 0 = all
    ("cuda", 2, 4, 4, 3, 100, 128, 256, False, None, None, [3, 77], 2),  # Lq 3, MHA, a row of Lq keys
    ("cuda", 2, 8, 2, 3, 150, 150, 128, True, 20, [0, 10], [150, 90], 3),  # window: key_begin per row
    ("metal", 2, 8, 2, 1, 100, 128, 128, True, 10, None, [100, 33], 2),  # Lq 1 in a window, K staged 32 dims at a time
    ("metal", 3, 4, 2, 3, 90, 96, 256, True, 7, [3, 0, 0], [90, 50, 4], None),
    ("metal", 2, 8, 8, 16, 70, 75, 64, False, None, [5, 0], [64, 16], 3),  # rows past R, empty splits
]
# fmt: on


@pytest.mark.parametrize(
    "case",
    EMU_RAGGED_CASES,
    ids=lambda c: f"{c[0]}-D{c[7]}-Lq{c[4]}-len{'-'.join(map(str, c[11]))}",
)
def test_kernel_body_with_row_lengths_on_emulated_gpu_matches_reference(emulator, case):
    backend, B, H, Hk, Lq, Lk, cap, D, causal, window, kv_start, lengths, splits = case
    q, k, v = make_qkv(B, H, Hk, Lq, Lk, D, mx.float32, seed=Lk + D + Lq, cap=cap)
    k_buf, v_buf = ragged_buffers(k, v, cap, lengths)
    starts = None if kv_start is None else mx.array(kv_start, dtype=mx.int32)
    want = ka.block_attention_reference(
        q,
        k,
        v,
        scale=D**-0.5,
        causal=causal,
        window=window,
        kv_start=starts,
        kv_len=mx.array(lengths, dtype=mx.int32),
    )
    got = emulator(
        backend,
        q,
        k_buf,
        v_buf,
        Lk,
        scale=D**-0.5,
        causal=causal,
        window=window,
        kv_start=kv_start,
        kv_len=lengths,
        splits=splits,
    )
    assert not mx.isnan(got).any().item(), "a key past a row's length leaked into the result"
    assert max_err(got, want) < 2e-5


# The tensor-core pass 1 (CUDA, bf16) under the same emulator. What the GPU does per warp is
# emulated from the PTX ISA's fragment layouts for mma.m16n8k16 (.row.col, bf16 in, fp32
# accumulate): every lane posts its A and B registers, then computes its own four accumulators
# from the whole 16 x 16 and 16 x 8 tiles. A wrong lane-to-row or lane-to-key mapping in
# PASS1_MMA_BODY gives a wrong result here, as it would on the GPU.
EMU_MMA = r"""
#include <cstring>
struct bf16 {
  uint16_t bits;
  bf16() = default;
  bf16(float f) {  // round to nearest even
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    bits = (uint16_t)(u >> 16);
  }
  operator float() const {
    uint32_t u = (uint32_t)bits << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};
using T = bf16;
struct uint4 { uint32_t x, y, z, w; };
struct Frags { uint32_t a[32][4]; uint32_t b[32][2]; };
static Frags frags[8];
static float emu_half(uint32_t reg, int hi) { bf16 h; h.bits = (uint16_t)(hi ? reg >> 16 : reg & 0xffffu); return h; }
static void emu_mma(Ctx* ctx, int warp, int lane, float* d, const uint32_t* a, const uint32_t* b) {
  ctx->warps[warp]->arrive_and_wait();
  for (int i = 0; i < 4; ++i) frags[warp].a[lane][i] = a[i];
  for (int i = 0; i < 2; ++i) frags[warp].b[lane][i] = b[i];
  ctx->warps[warp]->arrive_and_wait();
  const int g = lane >> 2, t = lane & 3;
  for (int c = 0; c < 4; ++c) {
    const int row = g + 8 * (c >> 1), col = 2 * t + (c & 1);
    float acc = d[c];
    for (int kk = 0; kk < 16; ++kk) {
      // A[row][kk]: lane (row % 8) * 4 + (kk % 8) / 2, register (row >= 8) + 2 (kk >= 8), half kk & 1
      const float x = emu_half(frags[warp].a[(row % 8) * 4 + (kk % 8) / 2][(row >= 8) + 2 * (kk >= 8)], kk & 1);
      // B[kk][col]: lane col * 4 + (kk % 8) / 2, register (kk >= 8), half kk & 1
      const float y = emu_half(frags[warp].b[col * 4 + (kk % 8) / 2][kk >= 8], kk & 1);
      acc += x * y;
    }
    d[c] = acc;
  }
  ctx->warps[warp]->arrive_and_wait();
}
static float quad_reduce(Ctx* ctx, int warp, int lane, float x, bool is_max) {
  ctx->warps[warp]->arrive_and_wait();
  ctx->red[warp][lane] = x;
  ctx->warps[warp]->arrive_and_wait();
  const int base = lane & ~3;
  float r = ctx->red[warp][base];
  for (int i = 1; i < 4; ++i) r = is_max ? std::fmax(r, ctx->red[warp][base + i]) : r + ctx->red[warp][base + i];
  ctx->warps[warp]->arrive_and_wait();
  return r;
}
static uint32_t ld32(const void* p) { uint32_t u; std::memcpy(&u, p, 4); return u; }
#define TPTR T*
#define CP_ASYNC16(dst, src, valid) ((valid) ? (void)std::memcpy((dst), (src), 16) : (void)std::memset((dst), 0, 16))
#define CP_ASYNC_COMMIT()
#define CP_ASYNC_WAIT(n)
#define LD32(ptr) ld32(ptr)
#define RAW16(x) ((uint32_t)(x).bits)
#define QUAD_MAX(x) quad_reduce(ctx, warp, lane, (x), true)
#define QUAD_SUM(x) quad_reduce(ctx, warp, lane, (x), false)
#define MMA16816(d, a, b) emu_mma(ctx, warp, lane, (d), (a), (b))
#define PACK2(x, y) ((uint32_t)bf16(x).bits | ((uint32_t)bf16(y).bits << 16))
#define ROUND_T(x) ((float)bf16(x))

template <int D, int NW, int KT, int STAGES, bool FUSED>
KERNELS


"""

# (head dim, warps, fused, keys per tile, stages) configurations the tensor-core emulator is built for
EMU_MMA_CONFIGS = [
    (64, 4, True, 16, 2),
    (128, 8, True, 16, 2),
    (256, 4, True, 16, 2),
    (128, 2, False, 32, 3),
    (128, 1, True, 16, 4),
]


@pytest.fixture(scope="module")
def mma_emulator(tmp_path_factory):
    emulator_build.compiler()
    folder = tmp_path_factory.mktemp("emu_mma")
    cases = []
    for n, (D, warps, fused, kt, stages) in enumerate(EMU_MMA_CONFIGS):
        c = ka.mma_config(D, warps, fused, kt, stages)
        f = "true" if fused else "false"
        pass2_after = (
            "false" if fused else "splits > 1"
        )  # one chunk: the block writes the output itself
        cases.append(
            f"case {n}: return run_blocks<bf16, {D}, {warps}, {c.smem_bytes}>(dir, B, H, Hk, Lq, Lk, cap, "
            f"splits, groups, {pass2_after}, pass1<{D}, {warps}, {kt}, {stages}, {f}>);"
        )
    src = EMU_HEADER + (EMU_MMA.replace("KERNELS", EMU_KERNELS) + EMU_ENTRY).replace(
        "PASS1", ka.PASS1_MMA_BODY
    ).replace("PASS2", ka.PASS2_BODY).replace("CASES", "\n    ".join(cases))
    exe = emulator_build.build(src, folder, "emu", flags=["-fno-strict-aliasing"])

    def run(cfg, q, k_buf, v_buf, Lk, *, scale, causal, window, kv_start, splits, kv_len=None):
        B, H, Lq, D = q.shape
        Hk, cap = k_buf.shape[1], k_buf.shape[2]
        groups = -(-((H // Hk) * Lq) // 16)
        d = Path(folder) / "case"
        d.mkdir(exist_ok=True)
        for name, x in (("q", q), ("k", k_buf), ("v", v_buf)):
            np.asarray(x.astype(mx.bfloat16).view(mx.uint16)).tofile(d / f"{name}.bin")
        np.asarray(kv_start if kv_start is not None else np.zeros(B), dtype=np.int32).tofile(
            d / "kv_start.bin"
        )
        np.asarray(kv_len if kv_len is not None else np.zeros(B), dtype=np.int32).tofile(
            d / "kv_len.bin"
        )
        np.asarray([int(causal), int(window or 0)], dtype=np.int32).tofile(d / "flags.bin")
        np.asarray([scale * ka.LOG2E], dtype=np.float32).tofile(d / "scale.bin")
        args = [str(exe), str(d), cfg, B, H, Hk, Lq, Lk, cap, splits, groups]
        subprocess.run([str(a) for a in args], check=True, timeout=300)
        return mx.array(np.fromfile(d / "out.bin", dtype=np.float32).reshape(B, H, Lq, D))

    return run


# (config index, B, H, Hk, Lq, Lk, cap, causal, window, kv_start, splits)
# fmt: off
EMU_MMA_CASES = [
    (1, 1, 8, 2, 16, 200, 230, True, None, None, 3),  # 4 row groups, 3 chunks, 8 warps (some idle), fused
    (1, 1, 4, 4, 16, 16, 16, True, None, None, 1),  # keys == rows, one chunk: output written directly
    (1, 1, 8, 4, 16, 600, 600, True, None, None, 1),  # one chunk of 38 tiles: rescaling, ring reuse, combine
    (0, 2, 4, 2, 3, 70, 80, False, None, [0, 33], 5),  # bidirectional, padding, rows past R, empty chunks
    (2, 1, 8, 2, 16, 150, 150, True, 20, None, 2),  # D=256, sliding window
    (3, 1, 8, 2, 16, 260, 270, True, None, [7], 4),  # pass 2 as its own kernel, 2 warps, 3 stages
    (4, 1, 8, 2, 16, 500, 500, True, None, None, 2),  # one warp, 4 stages, 16 tiles per chunk
    (0, 1, 9, 3, 5, 64, 64, True, None, None, 2),  # SmolLM2-like: 3 query heads per KV head, 5 rows
]
# fmt: on


@pytest.mark.parametrize(
    "case", EMU_MMA_CASES, ids=lambda c: f"cfg{c[0]}-Lq{c[4]}-Lk{c[5]}-s{c[10]}"
)
def test_tensor_core_body_on_emulated_gpu_matches_reference(mma_emulator, case):
    cfg, B, H, Hk, Lq, Lk, cap, causal, window, kv_start, splits = case
    D = EMU_MMA_CONFIGS[cfg][0]
    q, k, v = (
        x.astype(mx.bfloat16).astype(mx.float32)
        for x in make_qkv(B, H, Hk, Lq, Lk, D, mx.float32, seed=Lk + D, cap=cap)
    )
    pad = [(0, 0), (0, 0), (0, cap - Lk), (0, 0)]
    k_buf, v_buf = (
        mx.pad(k, pad, constant_values=float("nan")),
        mx.pad(v, pad, constant_values=float("nan")),
    )
    starts = None if kv_start is None else mx.array(kv_start, dtype=mx.int32)
    # fp32 oracle on the bf16-rounded inputs: the kernel's products are exact and its sums fp32;
    # P is carried as hi + lo bf16 terms (relative error about 2^-16), so the two agree to ~1e-5
    want = ka.block_attention_reference(
        q, k, v, scale=D**-0.5, causal=causal, window=window, kv_start=starts
    )
    got = mma_emulator(
        cfg,
        q,
        k_buf,
        v_buf,
        Lk,
        scale=D**-0.5,
        causal=causal,
        window=window,
        kv_start=kv_start,
        splits=splits,
    )
    assert not mx.isnan(got).any().item(), "a key past Lk leaked into the result"
    assert max_err(got, want) < 5e-5


# Per-row key lengths (kv_len): (config index, B, H, Hk, Lq, Lk, cap, causal, window, kv_start, kv_len, splits)
# fmt: off
EMU_MMA_RAGGED_CASES = [
    (1, 3, 8, 2, 16, 200, 230, True, None, None, [200, 61, 17], 3),  # 13 / 4 / 2 tiles over 3 chunks, fused
    (0, 2, 8, 2, 1, 130, 160, True, None, [0, 5], [0, 40], 4),  # decoding step: 4 rows of 16, 0 = all
    (3, 2, 4, 4, 1, 100, 128, False, None, None, [100, 23], 3),  # Lq 1, MHA (1 row of 16), pass 2 separate
    (4, 2, 4, 2, 1, 60, 64, True, 12, None, [33, 0], 1),  # Lq 1 in a window, one chunk: output written directly
    (0, 2, 9, 3, 3, 64, 80, False, None, None, [64, 3], 2),  # Lq 3, bidirectional, 3 query heads per KV head
    (2, 2, 8, 2, 3, 150, 150, True, 20, [0, 10], [150, 90], 2),  # D=256, window: key_begin per row
]
# fmt: on


@pytest.mark.parametrize(
    "case", EMU_MMA_RAGGED_CASES, ids=lambda c: f"cfg{c[0]}-Lq{c[4]}-len{'-'.join(map(str, c[10]))}"
)
def test_tensor_core_body_with_row_lengths_on_emulated_gpu_matches_reference(mma_emulator, case):
    cfg, B, H, Hk, Lq, Lk, cap, causal, window, kv_start, lengths, splits = case
    D = EMU_MMA_CONFIGS[cfg][0]
    q, k, v = (
        x.astype(mx.bfloat16).astype(mx.float32)
        for x in make_qkv(B, H, Hk, Lq, Lk, D, mx.float32, seed=Lk + D + Lq, cap=cap)
    )
    k_buf, v_buf = ragged_buffers(k, v, cap, lengths)
    starts = None if kv_start is None else mx.array(kv_start, dtype=mx.int32)
    want = ka.block_attention_reference(
        q,
        k,
        v,
        scale=D**-0.5,
        causal=causal,
        window=window,
        kv_start=starts,
        kv_len=mx.array(lengths, dtype=mx.int32),
    )
    got = mma_emulator(
        cfg,
        q,
        k_buf,
        v_buf,
        Lk,
        scale=D**-0.5,
        causal=causal,
        window=window,
        kv_start=kv_start,
        splits=splits,
        kv_len=lengths,
    )
    assert not mx.isnan(got).any().item(), "a key past a row's length leaked into the result"
    assert max_err(got, want) < 5e-5


# --------------------------------------------------------------------------------------------
# Kernels on a real GPU backend (CUDA via mlx[cuda13]; Metal on Apple silicon): skipped here
# --------------------------------------------------------------------------------------------

gpu_only = pytest.mark.skipif(ka.gpu_backend() is None, reason="needs the CUDA or Metal backend")

GPU_CASES = [
    (1, 32, 8, 16, 2048, 128, mx.bfloat16, True, None),
    (1, 32, 8, 16, 2051, 128, mx.float16, True, None),
    (1, 16, 8, 16, 777, 64, mx.bfloat16, False, None),
    (2, 8, 2, 16, 300, 256, mx.bfloat16, True, 64),
    (1, 8, 4, 5, 100, 128, mx.float32, True, None),
]


@gpu_only
@pytest.mark.parametrize("case", GPU_CASES)
def test_kernel_matches_reference_on_gpu(case):
    B, H, Hk, Lq, Lk, D, dtype, causal, window = case
    q, k, v = make_qkv(B, H, Hk, Lq, Lk, D, dtype, seed=Lk, cap=Lk + 100)
    got = ka.block_attention_kernel(q, k, v, scale=D**-0.5, causal=causal, window=window)
    want = ka.block_attention_reference(q, k, v, scale=D**-0.5, causal=causal, window=window)
    assert max_err(got, want) < TOL[dtype]


# (B, H, Hk, Lq, Lk, D, dtype, causal, window, kv_len): ragged batches (decoding steps, verify passes)
GPU_RAGGED_CASES = [
    (4, 32, 8, 16, 512, 128, mx.bfloat16, True, None, [512, 300, 17, 0]),
    (4, 32, 8, 1, 512, 128, mx.bfloat16, True, None, [512, 300, 1, 77]),
    (3, 8, 2, 3, 300, 256, mx.float16, True, 64, [300, 3, 150]),
    (3, 8, 4, 1, 100, 64, mx.float32, True, None, [100, 1, 50]),
    (2, 8, 4, 5, 100, 128, mx.float32, False, None, [100, 33]),
]


@gpu_only
@pytest.mark.parametrize("case", GPU_RAGGED_CASES)
def test_kernel_with_row_lengths_matches_reference_on_gpu(case):
    B, H, Hk, Lq, Lk, D, dtype, causal, window, lengths = case
    q, k, v = make_qkv(B, H, Hk, Lq, Lk, D, dtype, seed=Lk + Lq, cap=Lk + 100)
    kv_len = mx.array(lengths, dtype=mx.int32)
    got = ka.block_attention_kernel(
        q, k, v, scale=D**-0.5, causal=causal, window=window, kv_len=kv_len
    )
    want = ka.block_attention_reference(
        q, k, v, scale=D**-0.5, causal=causal, window=window, kv_len=kv_len
    )
    assert max_err(got, want) < TOL[dtype]


# --------------------------------------------------------------------------------------------
# Routing inside the engine
# --------------------------------------------------------------------------------------------


@pytest.fixture
def reference_routing(monkeypatch):
    """Attention in mode "reference" in the test: engines made in it (their default), calls alone."""
    with switch.modes(attention="reference"):  # first: the defaults resolve without the variable
        monkeypatch.setenv(routing.ENV, "reference")
        yield


def test_default_mode_on_cpu_is_stock(monkeypatch):
    monkeypatch.delenv(routing.ENV, raising=False)
    assert routing.mode() == "stock"


def test_routed_sdpa_falls_back_for_single_rows_and_array_masks(reference_routing):
    q, k, v = make_qkv(1, 4, 2, 1, 30, 64, mx.float32)
    calls = routing.counters()
    routing.target_sdpa(q, k, v, cache=None, scale=0.1, mask=None)
    q16, k16, v16 = make_qkv(1, 4, 2, 16, 30, 64, mx.float32)
    routing.target_sdpa(
        q16, k16, v16, cache=None, scale=0.1, mask=create_causal_mask(16, offset=14)
    )
    assert routing.counters()["routed"] == calls["routed"]
    assert routing.counters()["stock"] == calls["stock"] + 2
    routing.target_sdpa(q16, k16, v16, cache=None, scale=0.1, mask="causal")
    assert routing.counters()["routed"] == calls["routed"] + 1


def test_dflash_is_lossless_with_reference_routing(tiny_pair, reference_routing):
    before = routing.counters()["routed"]
    assert_dflash_lossless(*tiny_pair)
    assert routing.counters()["routed"] > before  # verify and draft passes went through the op


def test_kernel_sources_keep_preprocessor_lines_whole():
    """MLX pastes header and body between its own lines: each must start and end on a line."""
    for backend in ("cuda", "metal"):
        for src in ka.kernel_sources(backend):
            assert src.startswith("\n") and src.endswith("\n")
            assert all(line.startswith("#define") for line in src.splitlines() if "#define" in line)


def test_metal_source_builds_a_kernel_object():
    """metal_kernel objects build on any backend (they run only on Apple silicon)."""
    header, p1, p2 = ka.kernel_sources("metal")
    k1 = mx.fast.metal_kernel(
        name="t1",
        input_names=ka.PASS1_INPUTS,
        output_names=ka.PASS1_OUTPUTS,
        source=p1,
        header=header,
        ensure_row_contiguous=False,
    )
    assert k1 is not None
    for attr in (
        "thread_index_in_simdgroup",
        "simdgroup_index_in_threadgroup",
        "threadgroups_per_grid",
    ):
        assert attr in p1  # MLX adds these kernel arguments only when the source names them
