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
