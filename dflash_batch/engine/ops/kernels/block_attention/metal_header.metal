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
