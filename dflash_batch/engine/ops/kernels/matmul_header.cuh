#define I64 long long
#define THREAD_X threadIdx.x
#define BLOCK_X blockIdx.x
#define UNROLL _Pragma("unroll")
#define ALIGNED16(p) ((reinterpret_cast<unsigned long long>(p) & 15ull) == 0)
#define OUT_CAST(x) static_cast<T>(x)
__device__ __forceinline__ float dflash_mm_warp_sum(float x) {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}
template <typename TT>
__device__ __forceinline__ void dflash_mm_loadv(float* dst, const TT* src) {
    const uint4 raw = *reinterpret_cast<const uint4*>(src);  // one 16-byte load
    const TT* vals = reinterpret_cast<const TT*>(&raw);
    for (int e = 0; e < (int)(16 / sizeof(TT)); ++e) dst[e] = static_cast<float>(vals[e]);
}
#define WARP_SUM(x) dflash_mm_warp_sum(x)
#define LOADV(dst, src) dflash_mm_loadv((dst), (src))
