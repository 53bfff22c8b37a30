"""Few-row products (kernels/matmul.py, engine/ops/matmul.py): the kernel body run on the CPU under an
emulated GPU against ``x @ W.T``, the CUDA kernel itself where that backend exists, the routing
(what goes to the kernel, and that stock mode runs the layers' own code), and DFlash output with
the routing on."""

from __future__ import annotations

import subprocess
from pathlib import Path

from dflash_batch.engine.config import EngineConfig
from dflash_batch.engine.ops import matmul as routing
from dflash_batch.engine.ops import switch
from dflash_batch.engine.ops.kernels import attention as ka
from dflash_batch.engine.ops.kernels import matmul as km
from dflash_batch.engine.ops.kernels import selfcheck

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from tests import emulator as emulator_build
from tests.synthetic import assert_dflash_lossless

# --------------------------------------------------------------------------------------------
# The kernel body (BODY, the exact text CUDA compiles) on the CPU: one OS thread per lane of a
# warp, a std::barrier for the warp's shuffles, blocks and warps run one after another.
# --------------------------------------------------------------------------------------------

EMU = r"""
#include <array>
#include <cmath>
#include <barrier>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>
struct Dim { int x; };
thread_local Dim threadIdx, blockIdx;
static std::barrier<>* warp_barrier;
static float warp_buffer[32];
static float warp_sum(float x) {
  warp_barrier->arrive_and_wait();
  warp_buffer[threadIdx.x % 32] = x;
  warp_barrier->arrive_and_wait();
  float r = 0.0f;
  for (int i = 0; i < 32; ++i) r += warp_buffer[i];
  warp_barrier->arrive_and_wait();
  return r;
}
#define I64 long long
#define THREAD_X threadIdx.x
#define BLOCK_X blockIdx.x
#define UNROLL
#define ALIGNED16(p) ((reinterpret_cast<uintptr_t>(p) & 15u) == 0)
#define OUT_CAST(v) (v)
#define WARP_SUM(v) warp_sum(v)
#define LOADV(dst, src) for (int _e = 0; _e < V; ++_e) (dst)[_e] = static_cast<float>((src)[_e])
using Shape = std::array<int32_t, 8>;

template <typename T, int ROWS, int WARPS, int COLS>
void kernel(const T* x, Shape x_shape, int x_ndim, const T* w, Shape w_shape, T* y) {
  BODY
}

template <int ROWS>
void run(const float* x, const float* w, float* y, int M, int K, int N, int blocks, int lead) {
  constexpr int WARPS = WARPS_VALUE, COLS = COLS_VALUE;
  // x as [M, K], or as [lead, M / lead, K]: the kernel takes every leading axis as rows
  Shape xs = lead > 1 ? Shape{lead, M / lead, K} : Shape{M, K}, ws{N, K};
  const int ndim = lead > 1 ? 3 : 2;
  for (int b = 0; b < blocks; ++b)
    for (int wp = 0; wp < WARPS; ++wp) {
      std::barrier<> bar(32);
      warp_barrier = &bar;
      std::vector<std::thread> lanes;
      for (int l = 0; l < 32; ++l)
        lanes.emplace_back([&, l] {
          threadIdx.x = wp * 32 + l;
          blockIdx.x = b;
          kernel<float, ROWS, WARPS, COLS>(x, xs, ndim, w, ws, y);
        });
      for (auto& t : lanes) t.join();
    }
}

// argv: folder, M, K, N, x offset (elements), ROWS, leading axis (1: x is 2-D). Reads x.bin, w.bin; writes y.bin (NaN where unwritten).
int main(int argc, char** argv) {
  std::string d(argv[1]);
  const int M = atoi(argv[2]), K = atoi(argv[3]), N = atoi(argv[4]), off = atoi(argv[5]), rows = atoi(argv[6]);
  const int lead = atoi(argv[7]);
  std::vector<float> xbuf(off + (size_t)M * K + 4), w((size_t)N * K), y((size_t)M * N, NAN);
  FILE* f = fopen((d + "/x.bin").c_str(), "rb");
  if (fread(xbuf.data() + off, 4, (size_t)M * K, f) != (size_t)M * K) return 2;
  fclose(f);
  f = fopen((d + "/w.bin").c_str(), "rb");
  if (fread(w.data(), 4, (size_t)N * K, f) != (size_t)N * K) return 2;
  fclose(f);
  const int blocks = (N + WARPS_VALUE * COLS_VALUE - 1) / (WARPS_VALUE * COLS_VALUE);
  const float* x = xbuf.data() + off;
  switch (rows) {
    case 4: run<4>(x, w.data(), y.data(), M, K, N, blocks, lead); break;
    case 8: run<8>(x, w.data(), y.data(), M, K, N, blocks, lead); break;
    case 16: run<16>(x, w.data(), y.data(), M, K, N, blocks, lead); break;
    case 32: run<32>(x, w.data(), y.data(), M, K, N, blocks, lead); break;
    default: return 3;
  }
  f = fopen((d + "/y.bin").c_str(), "wb");
  fwrite(y.data(), 4, y.size(), f);
  fclose(f);
  return 0;
}
"""


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    emulator_build.compiler()
    folder = tmp_path_factory.mktemp("mm")
    src = (
        EMU.replace("BODY", km.BODY)
        .replace("WARPS_VALUE", str(km.WARPS))
        .replace("COLS_VALUE", str(km.COLS))
    )
    exe = emulator_build.build(src, folder, "emu")

    def run(x: np.ndarray, w: np.ndarray, offset: int = 0, lead: int = 1, rows: int = 0):
        (M, K), N = x.shape, w.shape[0]
        x.astype(np.float32).tofile(folder / "x.bin")
        w.astype(np.float32).tofile(folder / "w.bin")
        args = [exe, folder, M, K, N, offset, rows or km.row_bucket(M), lead]
        subprocess.run([str(a) for a in args], check=True, timeout=300)
        return np.fromfile(folder / "y.bin", dtype=np.float32).reshape(M, N)

    return run


# (M, K, N, x offset in elements, leading axis): the offset misaligns x, so the scalar path runs;
# a leading axis > 1 passes x as [lead, M / lead, K], as a [B, T, K] activation
EMU_CASES = [
    (2, 256, 16, 0, 1),  # 16-byte loads, every lane 2 iterations, 2 blocks
    (
        5,
        202,
        37,
        0,
        1,
    ),  # K not a multiple of 4: scalar loads, a tail; N leaves a column past the end
    (16, 136, 9, 0, 2),  # 3-D x; lanes 0..1 do a second iteration; one block, its later warps idle
    (32, 64, 8, 0, 4),  # the largest bucket: 64 accumulators a lane, lanes write 2 values each
    (3, 128, 11, 1, 1),  # x misaligned by 4 bytes: scalar loads
    (1, 40, 5, 0, 1),  # one row
]


@pytest.mark.parametrize(
    "case", EMU_CASES, ids=lambda c: f"M{c[0]}-K{c[1]}-N{c[2]}-off{c[3]}-lead{c[4]}"
)
def test_kernel_body_on_emulated_gpu_matches_the_product(emulator, case):
    M, K, N, offset, lead = case
    rng = np.random.default_rng(M * 1000 + K + N)
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = rng.standard_normal((N, K)).astype(np.float32)
    got = emulator(x, w, offset, lead)
    want = x.astype(np.float64) @ w.T.astype(
        np.float64
    )  # not MLX: on CUDA its fp32 matmul rounds through TF32
    assert not np.isnan(got).any(), "an output was never written"
    # fp32 sums of K products: about 1e-7 relative here
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), np.abs(got - want).max()


@pytest.mark.parametrize("M", [2, 3, 5, 8])
def test_every_bucket_that_holds_the_rows_gives_the_same_bits(emulator, M):
    """A product may run a larger ROWS template than it needs (``launch_rows``): each row's sums run
    the same, so the output is the same to the bit, misaligned (scalar loads) or not."""
    rng = np.random.default_rng(M)
    x = rng.standard_normal((M, 202)).astype(np.float32)
    w = rng.standard_normal((37, 202)).astype(np.float32)
    for offset in (0, 1):
        outs = {rows: emulator(x, w, offset, rows=rows) for rows in km.ROW_BUCKETS if rows >= M}
        first = outs[km.row_bucket(M)]
        for rows, y in outs.items():
            assert np.array_equal(y, first), (M, rows, offset)


def test_a_product_runs_the_smallest_built_bucket_that_holds_it(monkeypatch):
    """A template not yet built compiles on its first launch, so a product of few rows borrows a
    larger one this process has built, and builds its own only where none holds it."""
    launched = []

    def kernel(**kw):
        launched.append(dict(kw["template"])["ROWS"])
        return [mx.zeros(kw["output_shapes"][0], kw["output_dtypes"][0])]

    monkeypatch.setattr(km, "_kernel", lambda: kernel)
    monkeypatch.setattr(km, "_launches", {})
    w = mx.zeros((8, 16))
    km.matmul_kernel(mx.zeros((3, 16)), w)  # nothing built: its own bucket
    km.matmul_kernel(mx.zeros((12, 16)), w)
    km.matmul_kernel(mx.zeros((5, 16)), w)  # 16 is built, 8 is not: 16
    km.matmul_kernel(mx.zeros((2, 16)), w)  # 4 is built
    km.matmul_kernel(mx.zeros((2, 16), mx.float16), w.astype(mx.float16))  # per dtype
    assert launched == [4, 16, 16, 4, 4]
    assert km.launch_rows(mx.float32, 7) == 16 and km.launch_rows(mx.float32, 20) == 32


def test_a_broken_body_fails_the_emulated_comparison(emulator, tmp_path_factory):
    """The comparison above can fail: the same body, reading one lane's slice twice."""
    # not through the fixture: compile a variant whose lanes stride by 16 V instead of 32 V
    folder = tmp_path_factory.mktemp("mm-broken")
    body = km.BODY.replace("k += 32 * V", "k += 16 * V")
    assert body != km.BODY
    src = (
        EMU.replace("BODY", body)
        .replace("WARPS_VALUE", str(km.WARPS))
        .replace("COLS_VALUE", str(km.COLS))
    )
    emulator_build.build(src, folder, "emu")
    rng = np.random.default_rng(1)
    x, w = (
        rng.standard_normal((4, 256)).astype(np.float32),
        rng.standard_normal((8, 256)).astype(np.float32),
    )
    x.tofile(folder / "x.bin")
    w.tofile(folder / "w.bin")
    subprocess.run(
        [str(folder / "emu"), str(folder), "4", "256", "8", "0", "4", "1"], check=True, timeout=300
    )
    got = np.fromfile(folder / "y.bin", dtype=np.float32).reshape(4, 8)
    assert np.abs(got - x @ w.T).max() > 1e-2 * np.abs(x @ w.T).max()


def test_row_buckets():
    assert [km.row_bucket(m) for m in (1, 4, 5, 8, 9, 16, 17, 32)] == [4, 4, 8, 8, 16, 16, 32, 32]
    with pytest.raises(ValueError):
        km.row_bucket(33)
    assert km.unsupported(mx.zeros((2, 16, 8)), mx.zeros((4, 8))) is None
    assert "rows" in km.unsupported(mx.zeros((3, 16, 8)), mx.zeros((4, 8)))
    assert "dtypes" in km.unsupported(mx.zeros((2, 8), mx.float16), mx.zeros((4, 8)))
    assert km.unsupported(mx.zeros((2, 7)), mx.zeros((4, 8))) is not None


# --------------------------------------------------------------------------------------------
# Routing
# --------------------------------------------------------------------------------------------


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.layers = [nn.Linear(16, 24), nn.Linear(24, 16, bias=False)]
        self.q = nn.QuantizedLinear(64, 32, bias=False)

    def __call__(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.embed.as_linear(h)


def test_install_re_classes_plain_linear_layers_only_and_keeps_parameters():
    mx.random.seed(0)
    model = Tiny()
    before = dict(nn.utils.tree_flatten(model.parameters()))
    ids = mx.array([[1, 2, 3, 4]])
    want = model(ids)
    assert routing.install(model) == 2
    assert all(type(layer) is routing.RoutedLinear for layer in model.layers)
    assert type(model.q) is nn.QuantizedLinear and type(model.embed) is nn.Embedding
    after = dict(nn.utils.tree_flatten(model.parameters()))
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
    assert routing.install(model) == 0  # already routed
    # stock mode (the default on the CPU): the layers' own code, bit for bit
    with switch.modes(matmul="stock"):
        routed = routing.counters()["routed"]
        assert mx.array_equal(model(ids), want)
        assert routing.counters()["routed"] == routed


def test_routing_sends_few_row_products_of_layer_widths_to_the_kernel(monkeypatch):
    """With routing forced on, exactly the products of MIN_ROWS..MAX_ROWS rows of a plain weight
    of at most MAX_OUTPUTS outputs call the kernel (replaced here by the reference plus a marker,
    since the CPU has no CUDA)."""
    calls = []

    def fake_kernel(x, w):
        calls.append((x.size // x.shape[-1], w.shape[0]))
        return km.matmul_reference(x, w)

    monkeypatch.setattr(km, "matmul_kernel", fake_kernel)
    monkeypatch.setattr(km, "kernel_verified", lambda dtype, backend="cuda": True)
    monkeypatch.setattr(routing.device, "backend", lambda: "cuda")
    with switch.modes(matmul="kernel"):
        mx.random.seed(1)
        model = Tiny()
        routing.install(model)
        for rows in (1, 2, 7, 16, 17):
            calls.clear()
            model(mx.zeros((1, rows), dtype=mx.int32))
            routed = routing.MIN_ROWS <= rows <= routing.MAX_ROWS
            assert calls == ([(rows, 24), (rows, 16)] if routed else []), rows
        calls.clear()
        out = routing.linear(mx.ones((2, 3, 16)), mx.ones((5, 16)), mx.ones((5,)))
        assert calls == [(6, 5)] and mx.array_equal(out, mx.full((2, 3, 5), 17.0))
        calls.clear()
        routing.linear(
            mx.ones((1, 4, 16)), mx.ones((routing.MAX_OUTPUTS + 1, 16))
        )  # an LM head's width
        assert calls == []


def test_mode_from_environment(monkeypatch):
    monkeypatch.setenv(routing.ENV, "kernel")
    assert routing.default_mode() == "kernel"
    monkeypatch.setenv(routing.ENV, "tf32")
    with pytest.raises(ValueError, match="expected one of"):
        routing.default_mode()
    with pytest.raises(ValueError):
        EngineConfig(matmul="fast")


# --------------------------------------------------------------------------------------------
# The CUDA kernel itself: skipped where there is no CUDA backend
# --------------------------------------------------------------------------------------------

cuda_only = pytest.mark.skipif(ka.gpu_backend() != "cuda", reason="needs the CUDA backend")


@cuda_only
@pytest.mark.parametrize("dtype", km.DTYPES, ids=str)
@pytest.mark.parametrize(
    "shape",
    [
        (2, 576, 576),
        (16, 576, 1536),
        (7, 1536, 576),
        (32, 2880, 576),
        (16, 576, 49152),
        (3, 202, 37),
    ],
)
def test_cuda_kernel_matches_the_reference(dtype, shape):
    M, K, N = shape
    keys = mx.random.split(mx.random.key(M + K + N), 2)
    x = mx.random.normal((M, K), key=keys[0]).astype(dtype)
    w = (mx.random.normal((N, K), key=keys[1]) / K**0.5).astype(dtype)
    with selfcheck.unchecked():
        got = km.matmul_kernel(x, w).astype(mx.float32)
    with mx.stream(mx.cpu):
        want = km.matmul_reference(x.astype(mx.float32), w.astype(mx.float32))
    tol = selfcheck.tolerance(dtype)
    assert mx.abs(got - want).max().item() <= tol * mx.abs(want).max().item()
    assert km.kernel_verified(dtype)


@cuda_only
def test_dflash_is_lossless_with_the_kernel_routed(tiny_pair, monkeypatch):
    """Greedy DFlash equals plain decoding with few-row products on the kernel (on CUDA)."""
    monkeypatch.setenv(routing.ENV, "kernel")
    before = routing.counters()["routed"]
    assert_dflash_lossless(*tiny_pair)
    assert routing.counters()["routed"] > before  # verify and draft passes went through the kernel
