// bonsai CUDA kernels. Compiled by NVRTC with no headers at all: no cuda_fp16.h, no <cstdint>.
// f16 <-> f32 conversion is inline PTX. Every reduction has a fixed order (warp xor-tree, then a
// fixed loop over warps), so results are deterministic and independent of the launch's batch n.
//
// Layout conventions (all row-major, ggml order: a weight [n_in, n_out] is n_out rows of n_in):
//   activations f32 [n, k]; int8 activations q [n, k] with per-32 block scale d [n, k/32] (f32)
//   and per-32 block code sum s [n, k/32] (i32), the llama.cpp Q8_0 scheme with f32 scales.
//   low-bit weights re-tiled at load into a code plane [n_out, nblk, CB bytes] (16-byte aligned)
//   and a scale plane [n_out, nblk] f16. Q1_0 codes are re-ordered inside each 32-element word so
//   that bit i of byte b holds element 4i + b (then (w >> i) & 0x01010101 is four consecutive bits);
//   Q2 codes are re-ordered inside each 16-element word so that 2-bit field s of byte i holds
//   element 4s + i (then (w >> 2s) & 0x03030303 is four consecutive codes, one per byte).

typedef unsigned int u32;
typedef unsigned short u16;
typedef signed char i8;
typedef unsigned char u8;
typedef unsigned long long u64;

#define MAXN 8
#define NEG_INF __int_as_float(0xff800000)

// Programmatic dependent launch (sm_90+). When the launcher sets the programmatic-serialization
// attribute, a kernel may be scheduled while the previous kernel of the stream is still running:
// PDL_WAIT blocks until that grid has completed and its memory is visible, PDL_TRIGGER lets the
// next kernel be scheduled. Every kernel launched that way calls PDL_WAIT before it touches memory
// an earlier kernel writes or reads (and before it exits, so completion stays transitive); only
// reads of weights (never written on the device) may come before it. Without the attribute both
// are no-ops.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && !defined(BONSAI_NO_GRIDDEP)
#define PDL_WAIT() asm volatile("griddepcontrol.wait;" ::: "memory")
#define PDL_TRIGGER() asm volatile("griddepcontrol.launch_dependents;" ::: "memory")
#else
#define PDL_WAIT() do {} while (0)
#define PDL_TRIGGER() do {} while (0)
#endif
#define PDL_ENTRY() do { PDL_WAIT(); PDL_TRIGGER(); } while (0)

// Hopper-only features (thread-block clusters, bulk copies with mbarriers, the async-proxy fence).
// Below sm_90 the kernels that use them compile with helpers that trap, and the host never
// launches them there (Gpu::hopper: the staged mat-vec, the SwiGLU- and gated-norm-fused kernels
// are off, as are the wgmma GEMMs, which have their own sm_90a guard).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define BONSAI_SM90 0
#define CLUSTER_DIMS(x, y, z)
#else
#define BONSAI_SM90 1
#define CLUSTER_DIMS(x, y, z) __cluster_dims__(x, y, z)
#endif

__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ u16 f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
// warp_sum's xor tree for the first n of N values at once (interleaved, the same operations on each)
template <int N>
__device__ __forceinline__ void warp_sum_rows(float (&v)[N], int n) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
#pragma unroll
        for (int t = 0; t < N; ++t)
            if (t < n) v[t] += __shfl_xor_sync(0xffffffffu, v[t], o);
}
__device__ __forceinline__ int warp_sum_i(int v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float siluf_(float x) { return x * sigmoidf_(x); }

// Block-wide sum with a fixed order; `red` holds >= 32 floats. All threads get the result.
__device__ float block_sum(float v, float* red) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) red[w] = v;
    __syncthreads();
    float t = 0.f;
    for (int i = 0; i < nw; ++i) t += red[i];
    return t;
}
__device__ float block_max(float v, float* red) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) red[w] = v;
    __syncthreads();
    float t = NEG_INF;
    for (int i = 0; i < nw; ++i) t = fmaxf(t, red[i]);
    return t;
}

// One 32-element block quantized by one full warp: lane j holds element j.
__device__ __forceinline__ void quant32(float v, i8* q, float* d, int* s) {
    int lane = threadIdx.x & 31;
    float amax = warp_max(fabsf(v));
    float db = amax / 127.0f;
    float id = db != 0.0f ? 1.0f / db : 0.0f;
    float r = fminf(fmaxf(roundf(v * id), -127.0f), 127.0f);
    int qi = (int)r;
    q[lane] = (i8)qi;
    int sum = warp_sum_i(qi);
    if (lane == 0) {
        *d = db;
        *s = sum;
    }
}

// quant32 for a 32-element block spread over 8 lanes of 4 consecutive elements each (lanes 8g..8g+7
// of a warp hold block g): the same scale (exact max), codes and integer sum. Writes the four
// codes at q4 (4-byte aligned) and, from the group's first lane, the scale and the sum.
// With `st` false the lane only takes part in the shuffles (its group writes nothing).
__device__ __forceinline__ void quant32_x4(const float v[4], i8* q4, float* d, int* s, bool st = true) {
    float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
    for (int l = 1; l < 8; l <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, l));
    float db = amax / 127.0f;
    float id = db != 0.0f ? 1.0f / db : 0.0f;
    int qi[4], sum = 0;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        qi[e] = (int)fminf(fmaxf(roundf(v[e] * id), -127.0f), 127.0f);
        sum += qi[e];
    }
#pragma unroll
    for (int l = 1; l < 8; l <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, l);
    if (!st) return;
    *(u32*)q4 = (u32)(qi[0] & 0xff) | (u32)(qi[1] & 0xff) << 8 | (u32)(qi[2] & 0xff) << 16 | (u32)(qi[3] & 0xff) << 24;
    if ((threadIdx.x & 7) == 0) {
        *d = db;
        *s = sum;
    }
}

// ---- activation quantization --------------------------------------------------------------------

// The b1-plane activations of `kernels/mvbp.cu` for one 128-element block held by 4 warps of the
// calling block (warps 4h .. 4h + 3, warp j = w & 3 holding sub-block j, lane i element 32j + i;
// every thread of the block calls it together; `sm` ≥ 16 floats of shared memory, two halves used
// by alternate calls `it`): the block's unit u = amax / 32767, codes rint(v · (1 / u)) clamped to
// ±32767 (0 where amax is 0), their 16 bit planes and the sums of each sub-block's codes. Writes,
// for block index `blk` of the row, plane p word j into the [n_in / 256][32 lanes][4] u32 layout at
// `xp` (row base), u at xu[blk] and sub-block j's sum at xs[4·blk + j] (the mat-vec's lane tg
// subtracts the sum of sub-block tg). Host twin: `host_quant_p16`. One block barrier.
// With `xv` (row base, may be null) also the byte-split codes of the int8 tensor-core verify
// (`mvbq_q1_*` in kernels/mvbp.cu, which documents the layout): the high byte (signed) and the low
// byte of element e = 2j + h + 8m of sub-block w & 3 at bytes 8·(j & 1) + 4h + m of that sub-block's
// 16 bytes in the block's 64-byte quarter 2·(j >> 1) (high) or the quarter after (low). Host twin:
// `b1q_acts_host`. With `xp` null no planes are written (the rows only the int8 tensor-core
// verify reads: it takes the byte-split codes, the units and the sums).
// One warp's share of quant_p16_part given the block's amax: the calling warp holds sub-block j
// (lane i element 32j + i) of 128-element block `blk` and writes its codes' planes, its byte-split
// codes (xv, unless null), its code sum, and (j == 0) the unit. The producers whose 128-element
// block spans four thread blocks of a cluster (the gated norm fused into the GDN step, the SwiGLU
// fused into gate‖up) exchange the four warp maxima and call this with the same amax, so every
// producer writes the same bits for the same values.
__device__ __forceinline__ void quant_p16_store(float v, float amax, int blk, int j, u32* xp, float* xu, int* xs,
                                                u8* xv) {
    const int lane = threadIdx.x & 31;
    const float u = amax / 32767.0f;
    const float iu = u != 0.0f ? 1.0f / u : 0.0f;
    const int code = (int)fminf(fmaxf(rintf(v * iu), -32767.0f), 32767.0f);
    if (xp) {  // warp-uniform: null when only the int8 tensor-core verify reads these rows
        u32 mine = 0u;
#pragma unroll
        for (int p = 0; p < 16; ++p) {
            const u32 word = __ballot_sync(0xffffffffu, ((u32)code >> p) & 1u);
            if (lane == p) mine = word;
        }
        const int pair = blk >> 1, hb = blk & 1;
        if (lane < 16) {
            const int L = 4 * (lane & 7) + j, slot = 2 * hb + (lane >> 3);
            xp[((size_t)pair * 32 + L) * 4 + slot] = mine;
        }
    }
    if (xv) {
        const int jj = (lane >> 1) & 3, h = lane & 1, m = lane >> 3;
        u8* c = xv + (size_t)blk * 256 + (jj >> 1) * 128 + j * 16 + (jj & 1) * 8 + h * 4 + m;
        c[0] = (u8)((u32)code >> 8);
        c[64] = (u8)code;
    }
    const int sum = warp_sum_i(code);
    if (lane == 0) {
        xs[4 * blk + j] = sum;
        if (j == 0) xu[blk] = u;
    }
}

__device__ __forceinline__ void quant_p16_part(float v, int blk, int it, float* sm, u32* xp, float* xu, int* xs,
                                               u8* xv) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, h0 = (w & ~3) + 8 * (it & 1);
    float am = warp_max(fabsf(v));
    if (lane == 0) sm[w + 8 * (it & 1)] = am;
    __syncthreads();
    const float amax = fmaxf(fmaxf(sm[h0], sm[h0 + 1]), fmaxf(sm[h0 + 2], sm[h0 + 3]));
    quant_p16_store(v, amax, blk, w & 3, xp, xu, xs, xv);
}

// The b1-plane outputs of a producer (kernels/mvbp.cu's activation layout, per row: planes
// [k / 256][32][4] u32, units [k / 128] f32, sums [k / 128][4] i32, byte-split codes [k / 128][4]
// [64] u8 or null), kernel parameters xp, xu, xs, xv of row 0; row t is at t·k/2 u32, t·k/128,
// t·k/32 and t·2k bytes.
struct P16Out {
    u32* xp;
    float* xu;
    int* xs;
    u8* xv;
};

// x [n, k] f32 -> q, d, s. grid (ceil(k/32/8), n), block 256: warp w quantizes block 8·bx + w.
extern "C" __global__ void quant_rows(const float* x, int k, i8* q, float* d, int* s) {
    PDL_ENTRY();
    int t = blockIdx.y, b = blockIdx.x * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    int nb = k >> 5;
    if (b >= nb) return;
    float v = x[(size_t)t * k + b * 32 + lane];
    quant32(v, q + (size_t)t * k + b * 32, d + (size_t)t * nb + b, s + (size_t)t * nb + b);
}

// xn = rmsnorm(x[t]) ⊙ w, written as f32 (xf, may be null) and quantized: int8 per 32 (q, d, s; q
// may be null when the b1-plane outputs are asked for) and b1-plane. grid (gx, n), block 256:
// every block computes the row's sum of squares itself (same fixed order in every block, so all
// agree bit for bit), then normalizes and quantizes the 256-element segments blockIdx.x,
// blockIdx.x + gx, ... (one 32-block per warp). Decode launches take one segment per block (many
// short blocks); long prefill launches a few segments per block, so that the row is not re-read
// once per segment. Every element's value is the same whatever gx.
extern "C" __global__ void rmsnorm_quant(const float* x, const float* w, float eps, int k, float* xf,
                                         i8* q, float* d, int* s, u32* p16, float* p16u, int* p16s, u8* p16v) {
    __shared__ float red[32];
    __shared__ float p16sm[16];
    int t = blockIdx.y;
    const float* xr = x + (size_t)t * k;
    int nb = k >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    int b = blockIdx.x * nw + (threadIdx.x >> 5);
    bool act = b < nb;
    int i = b * 32 + lane;
    // this thread's first weight before the PDL wait (weights are never written on the device),
    // its first element together with the sum-of-squares stream
    float wv = act ? w[i] : 0.f;
    PDL_ENTRY();
    float xv = act ? xr[i] : 0.f;
    float ss = 0.f;
    if ((((size_t)xr) & 15) == 0) {
        const float4* x4 = (const float4*)xr;
#pragma unroll 8
        for (int c = threadIdx.x; c < (k >> 2); c += blockDim.x) {
            float4 v = x4[c];
            ss = fmaf(v.x, v.x, ss);
            ss = fmaf(v.y, v.y, ss);
            ss = fmaf(v.z, v.z, ss);
            ss = fmaf(v.w, v.w, ss);
        }
    } else {
        // same order as the vector path
        for (int c = threadIdx.x; c < (k >> 2); c += blockDim.x)
            for (int e = 0; e < 4; ++e) ss = fmaf(xr[4 * c + e], xr[4 * c + e], ss);
    }
    ss = block_sum(ss, red);
    float inv = 1.0f / sqrtf(ss / (float)k + eps);
    for (int it = 0; b < nb; ++it, b += gridDim.x * nw) {
        i = b * 32 + lane;
        if (it > 0) {
            xv = xr[i];
            wv = w[i];
        }
        float v = xv * inv * wv;
        if (xf) xf[(size_t)t * k + i] = v;
        // the int8 codes only when asked (null where every consumer reads the b1-plane outputs)
        if (q) quant32(v, q + (size_t)t * k + b * 32, d + (size_t)t * nb + b, s + (size_t)t * nb + b);
        // the b1-plane activations too (k % 256 == 0, so every warp of the block runs the same
        // iterations and the 4 warps of a 128-element block are warps 4h .. 4h + 3)
        if (p16u)
            quant_p16_part(v, b >> 2, it, p16sm, p16 ? p16 + (size_t)t * (k >> 1) : nullptr, p16u + (size_t)t * (k >> 7),
                           p16s + (size_t)t * (k >> 5), p16v ? p16v + (size_t)t * k * 2 : nullptr);
    }
}

// rmsnorm_quant for long launches (prefill): one 256-thread block per row, which reads the row
// once. Σ x² is rmsnorm_quant's (thread c sums float4s c, c + 256, .. in order with fmas, then
// block_sum), so `inv` has the same bits; each thread then normalizes the float4s it summed (the
// first RN_CACHE of them kept in registers) and quantizes them with quant32_x4 (8 lanes per
// 32-block: exact max, exact integer sum), so every output equals rmsnorm_quant's bit for bit.
// grid n, block 256; k % 128 == 0 (a warp's float4s are all in the row or all past it); x rows,
// w and xf 16-byte aligned. The last four parameters (rmsnorm_quant's b1-plane outputs) are not
// written here: the launcher takes rmsnorm_quant when they are asked for.
#define RN_CACHE 8
extern "C" __global__ void __launch_bounds__(256) rmsnorm_quant_rows(const float* x, const float* w, float eps,
                                                                     int k, float* xf, i8* q, float* d, int* s,
                                                                     u32*, float*, int*, u8*) {
    PDL_ENTRY();
    __shared__ float red[32];
    const int t = blockIdx.x, k4 = k >> 2;
    const float4* x4 = (const float4*)(x + (size_t)t * k);
    float4 xc[RN_CACHE];  // this thread's float4s c = threadIdx.x + 256·it, it < RN_CACHE
    float ss = 0.f;
#pragma unroll
    for (int it = 0; it < RN_CACHE; ++it) {
        const int c = threadIdx.x + 256 * it;
        xc[it] = c < k4 ? x4[c] : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int it = 0; it < RN_CACHE; ++it) {
        if (threadIdx.x + 256 * it < k4) {
            const float4 v = xc[it];
            ss = fmaf(v.x, v.x, ss);
            ss = fmaf(v.y, v.y, ss);
            ss = fmaf(v.z, v.z, ss);
            ss = fmaf(v.w, v.w, ss);
        }
    }
    for (int c = threadIdx.x + 256 * RN_CACHE; c < k4; c += 256) {
        const float4 v = x4[c];
        ss = fmaf(v.x, v.x, ss);
        ss = fmaf(v.y, v.y, ss);
        ss = fmaf(v.z, v.z, ss);
        ss = fmaf(v.w, v.w, ss);
    }
    ss = block_sum(ss, red);
    const float inv = 1.0f / sqrtf(ss / (float)k + eps);
    const int nb = k >> 5;
    auto emit = [&](int c, float4 xv) {
        const float4 wv = *(const float4*)(w + 4 * c);
        float v[4] = {xv.x * inv * wv.x, xv.y * inv * wv.y, xv.z * inv * wv.z, xv.w * inv * wv.w};
        const size_t i = (size_t)t * k + 4 * (size_t)c;
        if (xf) *(float4*)(xf + i) = make_float4(v[0], v[1], v[2], v[3]);
        const size_t b = (size_t)t * nb + (c >> 3);
        quant32_x4(v, q + i, d + b, s + b);
    };
#pragma unroll
    for (int it = 0; it < RN_CACHE; ++it) {
        const int c = threadIdx.x + 256 * it;
        if (c < k4) emit(c, xc[it]);
    }
    for (int c = threadIdx.x + 256 * RN_CACHE; c < k4; c += 256) emit(c, x4[c]);
}

// ---- low-bit mat-vec (n <= 8 rows, batch invariant) ------------------------------------------

// KIND 1: Q1_0 (128 elems, 4 B codes per 32); 2: Q2_0 g128 / PQ2_0 (8 B per 32); 3: Q2_0 g64 (8 B
// per 32). Every kind reads its codes per 32-element sub-block j at [o·nsb + j] (u32 or uint2) and
// the f16 scale of block j / (BE/32).
//
// Work split: block = MV_WARPS warps, each warp owns R consecutive weight rows of one segment
// (a launch covers up to 4 matrices with the same n_in, e.g. gate ‖ up). Lane l handles
// sub-blocks l, l+32, ... of all its rows, so every activation load feeds R rows, and U sub-block
// iterations are loaded before use (several 128-byte warp loads per row in flight).
// NT is the most activation rows the variant takes (1 for decode: fewer registers, more warps).
// Per (row, activation row t) the float ops are identical whatever n, NT, R and U are (lane l
// always sums its sub-blocks in increasing order, then a fixed xor-tree), so row t of an n-row
// launch equals the 1-row launch bit for bit. No atomics.
#define MV_WARPS 4

struct MvSeg {
    const void* codes;
    const u16* scales;
    float* y;
    int n_out;
};

// dp4a with the bytes of `a` unsigned and those of `b` signed (exact in int32).
__device__ __forceinline__ int dp4a_us(u32 a, int b, int c) {
    int d;
    asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// Sum over one 32-element sub-block of (code_j · q_j) for Q1 (returns Σ sign·q) or Q2 (Σ code·q).
// The unpacking is the decode mat-vec's bottleneck (integer ops beside every dp4a). A dp4a operand
// is one field of every byte, masked where it lies after a shift (bytes unsigned); the fields of
// the low and the high half of the bytes go to two accumulators, one per weight, added after exact
// shifts. The sum is an exact integer whatever the fields' weights, so every scheme gives the same
// bits, and a launch may pick its scheme freely:
//   split (the default): half the fields to the bottom of their bytes by right shifts (SHF, ALU
//     pipe; weight 1), the other half to the top by left shifts (IMAD.SHL, FMA pipe; weight 2^7
//     for Q1's bit, 2^6 for Q2's 2-bit field); the lowest and highest fields need only the mask.
//   PAIRED (Q1 only, the one-row kernels of mv_lowbit): one left shift by 3 − i serves two fields,
//     bit i to bit 3 of each byte (weight 8) and bit i + 4 to bit 7 (weight 128): 3 shifts and 8
//     masks instead of 6 and 8. Measured on the H200 (2026-12-01, alternating builds in one
//     call): Q1_0 decode graph 2.866 → 2.851 ms/token; but the 5-row verify kernels took more
//     registers and the n-gram round 10 % longer, and Q2_0 (one shift per word for fields 1, 3,
//     weights 1 and 16) 3.319 → 3.487 (in the staged kernels alone 3.315 → 3.493), so those
//     keep the split scheme.
// A sub-block's code word(s) unpacked into the 8 dp4a operands (independent of the activations,
// so an n-row launch unpacks once and reuses them for every activation row).
struct SubOps {
    u32 m[8];
};

template <int KIND, bool PAIRED = false>
__device__ __forceinline__ SubOps sub_unpack(uint2 c) {
    SubOps o;
    if (KIND == 1 && PAIRED) {
        // Q1 re-tiled word: bit i of byte b is element 4i + b
        u32 w = c.x;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const u32 t = w << (3 - i);
            o.m[i] = t & 0x08080808u;
            o.m[i + 4] = t & 0x80808080u;
        }
    } else if (KIND == 1) {
        // bits 0..3 to bit 0 of each byte, bits 4..7 to bit 7
        u32 w = c.x;
#pragma unroll
        for (int i = 0; i < 4; ++i) o.m[i] = (w >> i) & 0x01010101u;
#pragma unroll
        for (int i = 4; i < 8; ++i) o.m[i] = (w << (7 - i)) & 0x80808080u;
    } else {
        // Q2 re-tiled word: 2-bit field s of byte i is element 4s + i. Fields 0, 1 to the bottom,
        // fields 2, 3 to the top of each byte.
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            u32 w = h == 0 ? c.x : c.y;
            o.m[4 * h] = w & 0x03030303u;
            o.m[4 * h + 1] = (w >> 2) & 0x03030303u;
            o.m[4 * h + 2] = (w << 2) & 0xC0C0C0C0u;
            o.m[4 * h + 3] = w & 0xC0C0C0C0u;
        }
    }
    return o;
}

// Σ(code·q) of one sub-block from its unpacked operands (of sub_unpack<KIND, PAIRED>): Q1 Σ sign·q,
// Q2 Σ code·q − s.
template <int KIND, bool PAIRED = false>
__device__ __forceinline__ int sub_dot_ops(const SubOps& o, const int* qa, int sa) {
    int lo = 0, hi = 0;
    if (KIND == 1) {
#pragma unroll
        for (int i = 0; i < 4; ++i) lo = dp4a_us(o.m[i], qa[i], lo);
#pragma unroll
        for (int i = 4; i < 8; ++i) hi = dp4a_us(o.m[i], qa[i], hi);
        // lo = S_lo (PAIRED: 8·S_lo), hi = 128·S_hi; Σ sign·q = 2·(S_lo + S_hi) − s
        return (PAIRED ? lo >> 2 : 2 * lo) + (hi >> 6) - sa;
    } else {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            lo = dp4a_us(o.m[4 * h], qa[4 * h], lo);
            lo = dp4a_us(o.m[4 * h + 1], qa[4 * h + 1], lo);
            hi = dp4a_us(o.m[4 * h + 2], qa[4 * h + 2], hi);
            hi = dp4a_us(o.m[4 * h + 3], qa[4 * h + 3], hi);
        }
        // hi = 64·Σ (fields 2, 3)·q
        return lo + (hi >> 6) - sa;
    }
}

template <int KIND>
__device__ __forceinline__ int sub_dot(uint2 c, const int* qa, int sa) {
    return sub_dot_ops<KIND>(sub_unpack<KIND>(c), qa, sa);
}

__device__ __forceinline__ unsigned atom_add_acq_rel_gpu(unsigned* p, unsigned v) {
    unsigned r;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(r) : "l"(p), "r"(v) : "memory");
    return r;
}
// Release only: the thread goes on without waiting for the old value until it is used; a reader
// that acts on the value pairs it with fence_acq_rel_gpu().
__device__ __forceinline__ unsigned atom_add_release_gpu(unsigned* p, unsigned v) {
    unsigned r;
    asm volatile("atom.release.gpu.global.add.u32 %0, [%1], %2;" : "=r"(r) : "l"(p), "r"(v) : "memory");
    return r;
}
__device__ __forceinline__ void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }
__device__ __forceinline__ void cluster_sync_all() {
#if BONSAI_SM90
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#else
    __trap();
#endif
}
// Every thread of the cluster arrives and waits for the others, with no memory ordering (the
// release of cluster_sync_all is a GPU-wide fence behind the thread's outstanding stores): an
// execution barrier, e.g. to keep a block's shared memory alive until its peers' reads of it,
// whose values they have already used, are done.
__device__ __forceinline__ void cluster_sync_relaxed() {
#if BONSAI_SM90
    asm volatile("barrier.cluster.arrive.relaxed.aligned;\n\tbarrier.cluster.wait.aligned;" ::: "memory");
#else
    __trap();
#endif
}
// The float at `local` in the shared memory of cluster block `rank`.
__device__ __forceinline__ float ld_cluster_f32(const float* local, unsigned rank) {
#if BONSAI_SM90
    unsigned a = (unsigned)__cvta_generic_to_shared(local), ra;
    float v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(ra) : "r"(a), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(ra) : "memory");
    return v;
#else
    __trap();
    return 0.f;
#endif
}
__device__ __forceinline__ unsigned cluster_rank() {
#if BONSAI_SM90
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
#else
    __trap();
    return 0;
#endif
}

// Where the SwiGLU-fused gate‖up launch (SWI) writes SiLU(gate) ⊙ up: f32 (hf, unless null) and
// quantized per 32 (q, d, s), as swiglu_quant does; or (the b1-plane launch `_swi_p16`) as
// b1-plane activations (p), as swiglu_quant_p16 does.
struct SwiOut {
    float* hf;
    i8* q;
    float* d;
    int* s;
    P16Out p;
};

// RS (row split, verify launches): RS consecutive blocks take the same weight rows, block b of them
// activation rows NT·b .. NT·b + NT − 1 (those < n), so a launch of n <= RS·NT rows has RS times
// the warps, each holding NT rows' sums. A row's operations are those of the one-row launch all the
// same (the same lanes' chains, the same unpack: NT > 1 either way).
// RF (rows first, verify launches, opt-in: `_n5r4f` / `_n5r8f`, `Gpu::mv_rows_first`): a sub-block's
// activation rows are loaded first (zeros past n) and each weight row's word unpacked once for all
// of them, with no branch between. Without it ptxas unpacks every word again for every activation
// row (behind the `t < n` branches): the main loop of `mv_q1_n5r8_k2` has 2,523 instructions (640
// IDP, ~1,000 shift / mask), with RF 1,705 (NVRTC 13.5, sm_90, at the same 3 blocks per SM). The
// same bits.
template <int KIND, int NT, int MV_R, int MV_U, int KS, bool SWI = false, int RS = 1, bool RF = false>
__device__ __forceinline__ void mv_lowbit(MvSeg s0, MvSeg s1, MvSeg s2, MvSeg s3, const i8* __restrict__ q,
                                          const float* __restrict__ da, const int* __restrict__ sa,
                                          int n_in, int n, int accumulate, int pre, SwiOut so = {}) {
    static_assert(RS == 1 || (NT > 1 && !SWI), "row split: verify launches only");
    static_assert(!RF || (NT > 1 && !SWI), "rows first: verify launches only");
    const int BE = KIND == 3 ? 64 : 128;  // elements per scale block
    const int SPB = BE / 32;              // sub-blocks per scale block
    const int G = MV_WARPS / KS;          // row groups per block
    // per-warp partial sums of the K-split (KS > 1): [warp][row][activation row]
    __shared__ float part[KS > 1 ? MV_WARPS : 1][MV_R][NT];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    int kp = w % KS;                       // this warp's K part
    const int bx = RS > 1 ? blockIdx.x / RS : blockIdx.x;
    // RS > 1: this block's activation rows start at t0 (its outputs at row t0 of y)
    const int t0 = RS > 1 ? (int)(blockIdx.x % RS) * NT : 0;
    if (RS > 1) {
        if (t0 >= n) return;  // the whole block, before any barrier
        n = min(NT, n - t0);
        q += (size_t)t0 * n_in;
        da += (size_t)t0 * (n_in >> 5);
        sa += (size_t)t0 * (n_in >> 5);
    }
    int gw = bx * G + w / KS;              // row group of this warp
    // find the segment (groups of MV_R rows never straddle two matrices)
    int g0 = (s0.n_out + MV_R - 1) / MV_R, g1 = (s1.n_out + MV_R - 1) / MV_R,
        g2 = (s2.n_out + MV_R - 1) / MV_R, g3 = (s3.n_out + MV_R - 1) / MV_R;
    MvSeg sg = s0;
    bool valid = true;
    // SWI: a cluster of 2 blocks per G·MV_R consecutive outputs, gate rows in rank 0, the same up
    // rows in rank 1 (blockIdx.x = 2·pair + rank); each row computed as in the plain launch
    __shared__ float sres[SWI ? MV_WARPS * MV_R : 1];
    if (SWI) {
        sg = (blockIdx.x & 1) ? s1 : s0;
        gw = (blockIdx.x >> 1) * G + w / KS;
        valid = gw * MV_R < sg.n_out;
    } else if (gw < g0) {
        sg = s0;
    } else if ((gw -= g0) < g1) {
        sg = s1;
    } else if ((gw -= g1) < g2) {
        sg = s2;
    } else if ((gw -= g2) < g3) {
        sg = s3;
    } else {
        valid = false;
    }
    if (!valid && KS == 1 && !SWI) return;  // no block barrier below when KS == 1 (SWI: the cluster's)
    int o0 = gw * MV_R;
    int nsb = n_in >> 5, nblk = n_in / BE;
    // per-row base pointers: codes [n_out, nsb] (u32 or uint2 per sub-block), scales [n_out, nblk]
    const u32* cp1[MV_R];
    const uint2* cp2[MV_R];
    const u16* sp[MV_R];
#pragma unroll
    for (int r = 0; r < MV_R; ++r) {
        size_t ro = valid ? (size_t)min(o0 + r, sg.n_out - 1) : 0;
        cp1[r] = (const u32*)sg.codes + ro * nsb;
        cp2[r] = (const uint2*)sg.codes + ro * nsb;
        sp[r] = sg.scales + ro * nblk;
    }
    float acc[MV_R][NT];
#pragma unroll
    for (int r = 0; r < MV_R; ++r)
#pragma unroll
        for (int t = 0; t < NT; ++t) acc[r][t] = 0.f;
    // Sub-blocks come in chunks of 32 (one per lane); chunk c belongs to K part c % KS, and a warp
    // takes U of its chunks per iteration: sub-block j = (kp + KS·(U·i + u))·32 + lane.
    const int STEP = 32 * KS;
    uint2 c[MV_U][MV_R];
    float dw[MV_U][MV_R];
    // Addressing: one base pointer per row and batch (j0 >= 0, so the scale index is an unsigned
    // shift), the U sub-blocks of the batch at the constant offsets STEP·u from it.
    auto load_w = [&](int j0) {
        unsigned uj0 = (unsigned)j0;
#pragma unroll
        for (int r = 0; r < MV_R; ++r) {
            const u32* b1 = cp1[r] + uj0;
            const uint2* b2 = cp2[r] + uj0;
            const u16* bs = sp[r] + uj0 / SPB;
#pragma unroll
            for (int u = 0; u < MV_U; ++u) {
                c[u][r].x = 0u;
                c[u][r].y = 0u;
                dw[u][r] = 0.f;
                if (j0 + STEP * u < nsb) {
                    if (KIND == 1) {
                        c[u][r].x = __ldg(b1 + STEP * u);
                    } else {
                        c[u][r] = __ldg(b2 + STEP * u);
                    }
                    dw[u][r] = h2f(__ldg(bs + STEP * u / SPB));
                }
            }
        }
    };
    int jfirst = kp * 32 + lane;
    // weights are never written on the device: with `pre` the first batch is loaded before
    // PDL_WAIT, overlapping the previous kernel's tail
    if (pre) {
        if (valid) load_w(jfirst);
        PDL_ENTRY();
    } else {
        PDL_ENTRY();
        if (valid) load_w(jfirst);
    }
    for (int j0 = jfirst; valid && j0 < nsb; j0 += STEP * MV_U) {
        if (j0 != jfirst) load_w(j0);
        // activation bases of this batch: codes [n, n_in] i8, d and s [n, nsb]
        const i8* qb = q + (size_t)(unsigned)j0 * 32;
        const float* db = da + (unsigned)j0;
        const int* sb = sa + (unsigned)j0;
#pragma unroll
        for (int u = 0; u < MV_U; ++u) {
            if (j0 + STEP * u < nsb && !RF) {
                // unpack the R code words once for all activation rows
                SubOps ops[MV_R];
#pragma unroll
                for (int r = 0; r < MV_R; ++r) ops[r] = sub_unpack<KIND, NT == 1>(c[u][r]);
#pragma unroll
                for (int t = 0; t < NT; ++t) {
                    if (t < n) {
                        const int4* qa4 = (const int4*)(qb + (size_t)t * n_in + STEP * u * 32);
                        int4 qa0 = __ldg(qa4), qa1 = __ldg(qa4 + 1);
                        int qa[8] = {qa0.x, qa0.y, qa0.z, qa0.w, qa1.x, qa1.y, qa1.z, qa1.w};
                        float dt = __ldg(db + (size_t)t * nsb + STEP * u);
                        int st = __ldg(sb + (size_t)t * nsb + STEP * u);
#pragma unroll
                        for (int r = 0; r < MV_R; ++r) {
                            int isum = sub_dot_ops<KIND, NT == 1>(ops[r], qa, st);
                            acc[r][t] = fmaf(dw[u][r] * dt, (float)isum, acc[r][t]);
                        }
                    }
                }
            } else if (j0 + STEP * u < nsb) {
                // RF: every activation row's codes first (zeros past n), then each weight row's
                // word unpacked once and used for all of them. Each acc[r][t] is its own chain, so
                // the order across r and t inside a sub-block changes no bit; the chains of rows
                // t >= n add 0 · 0 and are never stored. (Reading row n − 1 again instead of the
                // zeros cost more address registers: 40 spill loads a loop instead of 8.)
                int qa[NT][8];
                float dt[NT];
                int st[NT];
#pragma unroll
                for (int t = 0; t < NT; ++t) {
                    int4 qa0 = make_int4(0, 0, 0, 0), qa1 = qa0;
                    dt[t] = 0.f;
                    st[t] = 0;
                    if (t < n) {
                        const int4* qa4 = (const int4*)(qb + (size_t)t * n_in + STEP * u * 32);
                        qa0 = __ldg(qa4);
                        qa1 = __ldg(qa4 + 1);
                        dt[t] = __ldg(db + (size_t)t * nsb + STEP * u);
                        st[t] = __ldg(sb + (size_t)t * nsb + STEP * u);
                    }
                    qa[t][0] = qa0.x, qa[t][1] = qa0.y, qa[t][2] = qa0.z, qa[t][3] = qa0.w;
                    qa[t][4] = qa1.x, qa[t][5] = qa1.y, qa[t][6] = qa1.z, qa[t][7] = qa1.w;
                }
#pragma unroll
                for (int r = 0; r < MV_R; ++r) {
                    const SubOps ops = sub_unpack<KIND, false>(c[u][r]);
#pragma unroll
                    for (int t = 0; t < NT; ++t) {
                        int isum = sub_dot_ops<KIND, false>(ops, qa[t], st[t]);
                        acc[r][t] = fmaf(dw[u][r] * dt[t], (float)isum, acc[r][t]);
                    }
                }
            }
        }
    }
    // lane sums → warp (fixed xor-tree) → K parts in order kp = 0, 1, .. (fixed)
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        if (t < n) {
#pragma unroll
            for (int r = 0; r < MV_R; ++r) {
                float v = warp_sum(acc[r][t]);
                if (SWI) {
                    if (lane == r) sres[(w / KS) * MV_R + r] = v;
                } else if (KS == 1) {
                    if (lane == r && o0 + r < sg.n_out) {
                        float* yp = sg.y + (size_t)(t0 + t) * sg.n_out + o0 + r;
                        *yp = accumulate ? *yp + v : v;
                    }
                } else if (lane == 0) {
                    part[w][r][t] = v;
                }
            }
        }
    }
    if (KS > 1) {
        __syncthreads();
        if (valid && kp == 0 && lane < MV_R && o0 + lane < sg.n_out) {
            int r = lane;
            for (int t = 0; t < n; ++t) {
                float v = part[w][r][t];
#pragma unroll
                for (int k2 = 1; k2 < KS; ++k2) v += part[w + k2][r][t];
                float* yp = sg.y + (size_t)(t0 + t) * sg.n_out + o0 + r;
                *yp = accumulate ? *yp + v : v;
            }
        }
    }
    if (SWI) {
        // rank 0 combines its gate rows with rank 1's up rows, 32 at a time (swiglu_quant's ops)
        cluster_sync_all();
        if ((blockIdx.x & 1) == 0 && w * 32 < G * MV_R) {
            int o = (blockIdx.x >> 1) * (G * MV_R) + w * 32 + lane;
            if (o - lane < s0.n_out) {
                float g = sres[w * 32 + lane];
                float u = ld_cluster_f32(&sres[w * 32 + lane], 1);
                float v = siluf_(g) * u;
                if (so.hf) so.hf[o] = v;
                int b = o >> 5;
                quant32(v, so.q + (size_t)b * 32, so.d + b, so.s + b);
            }
        }
        // rank 1's sres stays until rank 0 has read it (those reads have returned: their values
        // are in the stores above), so an execution barrier is enough
        cluster_sync_relaxed();
    }
}

// The parameter list every low-bit mat-vec family shares (the launcher passes 8-byte slots): per
// segment codes, scales, y, n_out (unused segments have n_out = 0); the activation codes `X` of
// type `XT` (int8 q, or the b1 bit planes); d, s, n_in, n, accumulate, pre. The body (the variadic
// part) sees the segments as s0..s3.
#define MV_SEG_ENTRY(NAME, WARPS, MINB, XT, X, ...)                                                  \
    extern "C" __global__ void __launch_bounds__((WARPS) * 32, MINB) NAME(                            \
        const void* c0, const u16* sc0, float* y0, int n0, const void* c1, const u16* sc1, float* y1,  \
        int n1, const void* c2, const u16* sc2, float* y2, int n2, const void* c3, const u16* sc3,     \
        float* y3, int n3, XT X, const float* da, const int* sa, int n_in, int n, int accumulate,      \
        int pre) {                                                                                    \
        MvSeg s0 = {c0, sc0, y0, n0}, s1 = {c1, sc1, y1, n1}, s2 = {c2, sc2, y2, n2},                  \
              s3 = {c3, sc3, y3, n3};                                                                 \
        __VA_ARGS__;                                                                                  \
    }
#define MV_ENTRY(NAME, KIND, NT, R, U, KS, MINB) \
    MV_SEG_ENTRY(NAME, MV_WARPS, MINB, const i8*, q,  \
                 mv_lowbit<KIND, NT, R, U, KS>(s0, s1, s2, s3, q, da, sa, n_in, n, accumulate, pre))
#define MV_RS_ENTRY(NAME, KIND, NT, R, U, KS, MINB) \
    MV_SEG_ENTRY(NAME, MV_WARPS, MINB, const i8*, q,     \
                 mv_lowbit<KIND, NT, R, U, KS, false, 2>(s0, s1, s2, s3, q, da, sa, n_in, n, accumulate, pre))
#define MV_RF_ENTRY(NAME, KIND, NT, R, U, KS, MINB) \
    MV_SEG_ENTRY(NAME, MV_WARPS, MINB, const i8*, q,     \
                 mv_lowbit<KIND, NT, R, U, KS, false, 1, true>(s0, s1, s2, s3, q, da, sa, n_in, n, accumulate, pre))
// Variants: `_n8` take up to 8 activation rows (verify) with 2 weight rows per warp (`_n8r4`: 4);
// `_n5r4` / `_n5r8` up to 5 rows (registers for 5, so 4 or 8 weight rows per warp fit; `_n5r4f` /
// `_n5r8f` the same with RF, opt-in); `_n3r4s` /
// `_n3r8s` up to 6 rows split over 2 blocks of 3 (RS = 2: twice the warps, registers for 3); `_n1`
// (decode) take one, with R = 2, 4 or 8 weight rows per warp (8: half the activation loads per
// weight). The register caps are chosen so nothing spills (the RF forms keep the plain kernels'
// occupancy and spill a few words). `_kKS` splits each row's K range over
// KS warps of the block. R, U and NT never change a row's float ops; KS does, so the launcher
// picks KS from the matrix shape alone (never from n): row t of an n-row launch equals the 1-row
// launch bit for bit. The launcher's table of these variants is `MV_VARIANTS` (src/lib.rs).
#define MV_KIND_ENTRIES(K, KIND, MB, MB8)                           \
    MV_ENTRY(mv_##K##_n8_k1, KIND, MAXN, 2, 4, 1, 1)              \
    MV_ENTRY(mv_##K##_n8_k2, KIND, MAXN, 2, 4, 2, 1)              \
    MV_ENTRY(mv_##K##_n8_k4, KIND, MAXN, 2, 4, 4, 1)              \
    MV_ENTRY(mv_##K##_n8r4_k1, KIND, MAXN, 4, 2, 1, 1)            \
    MV_ENTRY(mv_##K##_n8r4_k2, KIND, MAXN, 4, 2, 2, 1)            \
    MV_ENTRY(mv_##K##_n8r4_k4, KIND, MAXN, 4, 2, 4, 1)            \
    MV_ENTRY(mv_##K##_n5r4_k1, KIND, 5, 4, 2, 1, 4)               \
    MV_ENTRY(mv_##K##_n5r4_k2, KIND, 5, 4, 2, 2, 4)               \
    MV_ENTRY(mv_##K##_n5r4_k4, KIND, 5, 4, 2, 4, 4)               \
    MV_ENTRY(mv_##K##_n5r8_k1, KIND, 5, 8, 2, 1, 2)               \
    MV_ENTRY(mv_##K##_n5r8_k2, KIND, 5, 8, 2, 2, 2)               \
    MV_ENTRY(mv_##K##_n5r8_k4, KIND, 5, 8, 2, 4, 2)               \
    MV_RF_ENTRY(mv_##K##_n5r4f_k1, KIND, 5, 4, 2, 1, 4)           \
    MV_RF_ENTRY(mv_##K##_n5r4f_k2, KIND, 5, 4, 2, 2, 4)           \
    MV_RF_ENTRY(mv_##K##_n5r4f_k4, KIND, 5, 4, 2, 4, 4)           \
    MV_RF_ENTRY(mv_##K##_n5r8f_k1, KIND, 5, 8, 2, 1, 3)           \
    MV_RF_ENTRY(mv_##K##_n5r8f_k2, KIND, 5, 8, 2, 2, 3)           \
    MV_RF_ENTRY(mv_##K##_n5r8f_k4, KIND, 5, 8, 2, 4, 3)           \
    MV_RS_ENTRY(mv_##K##_n3r4s_k1, KIND, 3, 4, 2, 1, KIND == 1 ? 6 : 5) \
    MV_RS_ENTRY(mv_##K##_n3r4s_k2, KIND, 3, 4, 2, 2, KIND == 1 ? 6 : 5) \
    MV_RS_ENTRY(mv_##K##_n3r4s_k4, KIND, 3, 4, 2, 4, KIND == 1 ? 6 : 5) \
    MV_RS_ENTRY(mv_##K##_n3r8s_k1, KIND, 3, 8, 2, 1, KIND == 1 ? 4 : 3) \
    MV_RS_ENTRY(mv_##K##_n3r8s_k2, KIND, 3, 8, 2, 2, KIND == 1 ? 4 : 3) \
    MV_RS_ENTRY(mv_##K##_n3r8s_k4, KIND, 3, 8, 2, 4, KIND == 1 ? 4 : 3) \
    MV_ENTRY(mv_##K##_n1_r2_k1, KIND, 1, 2, 4, 1, 8)              \
    MV_ENTRY(mv_##K##_n1_r2_k2, KIND, 1, 2, 4, 2, 8)              \
    MV_ENTRY(mv_##K##_n1_r2_k4, KIND, 1, 2, 4, 4, 8)              \
    MV_ENTRY(mv_##K##_n1_r4_k1, KIND, 1, 4, 4, 1, MB)              \
    MV_ENTRY(mv_##K##_n1_r4_k2, KIND, 1, 4, 4, 2, 5)              \
    MV_ENTRY(mv_##K##_n1_r4_k4, KIND, 1, 4, 4, 4, 5)              \
    MV_ENTRY(mv_##K##_n1_r8_k1, KIND, 1, 8, 2, 1, MB8)              \
    MV_ENTRY(mv_##K##_n1_r8_k2, KIND, 1, 8, 2, 2, MB8)              \
    MV_ENTRY(mv_##K##_n1_r8_k4, KIND, 1, 8, 2, 4, MB8)
MV_KIND_ENTRIES(q1, 1, 6, 5)
MV_KIND_ENTRIES(q2, 2, 5, 4)
MV_KIND_ENTRIES(q2g64, 3, 5, 4)

// Decode gate‖up with swiglu_quant fused in (`_swi`): one-row launch, 8 rows per warp, K split 1
// (the plain `_n1_r8_k1` kernel's rows bit for bit), over two matrices of n_out rows each (gate,
// up; n_out % 32 == 0); grid 2·n_out/32 in clusters of 2 (rank 0 gate rows, rank 1 the same up
// rows). Writes SiLU(gate) ⊙ up as swiglu_quant would — hf (unless null), q, d, s — and not the
// gate / up rows themselves.
// Q1 at 6 blocks per SM (80 registers, no spill): with the paired unpack the compiler took 96
// registers at 5, and 6 measured 2.857 → 2.832 ms per Q1_0 token (H200, 2026-12-01). Slower in the
// same A/Bs: 7 blocks (72 registers, 2.860; with one sub-block batch per iteration, 2.867), and
// 6 blocks for the 4-row (2.944) or the 8-row one-row kernels (80 registers with spills, 2.896;
// with one batch per iteration and no spill, 2.857) (bench/results/cuda-unpack-ab-27b.json).
#define MV_SWI_ENTRY(NAME, KIND, MINB)                                                                \
    extern "C" __global__ void CLUSTER_DIMS(2, 1, 1) __launch_bounds__(MV_WARPS * 32, MINB) NAME( \
        const void* c0, const u16* sc0, const void* c1, const u16* sc1, int n_out, const i8* q,      \
        const float* da, const int* sa, int n_in, int pre, float* hf, i8* hq, float* hd, int* hs) {  \
        MvSeg s0 = {c0, sc0, nullptr, n_out}, s1 = {c1, sc1, nullptr, n_out}, none = {nullptr, nullptr, nullptr, 0}; \
        mv_lowbit<KIND, 1, 8, 2, 1, true>(s0, s1, none, none, q, da, sa, n_in, 1, 0, pre,           \
                                          SwiOut{hf, hq, hd, hs, {}});                                  \
    }
MV_SWI_ENTRY(mv_q1_n1_r8_k1_swi, 1, 6)
MV_SWI_ENTRY(mv_q2_n1_r8_k1_swi, 2, 4)
MV_SWI_ENTRY(mv_q2g64_n1_r8_k1_swi, 3, 4)

// f32 weights (other types, dequantized at load), f32 activations. One warp per row.
extern "C" __global__ void mv_f32(const float* __restrict__ w, const float* __restrict__ x, float* y,
                                  int n_in, int n_out, int n, int accumulate) {
    PDL_ENTRY();
    int lane = threadIdx.x & 31;
    int o = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (o >= n_out) return;
    for (int t = 0; t < n; ++t) {
        float a = 0.f;
        for (int i = lane; i < n_in; i += 32) a = fmaf(w[(size_t)o * n_in + i], x[(size_t)t * n_in + i], a);
        a = warp_sum(a);
        if (lane == 0) {
            float* yp = y + (size_t)t * n_out + o;
            *yp = accumulate ? *yp + a : a;
        }
    }
}

// ---- embedding gather --------------------------------------------------------------------------

// x[t] = dequant(row ids[t]) from a re-tiled table. kind as above, 0 = f32 table. grid (n, gy),
// block 256: block (t, y) writes elements y·256 + i·gy·256 + threadIdx.x of row t (the first
// kernel of a decode step, on its critical path: one block per row took ~8 µs of a 27B step).
extern "C" __global__ void embed_rows(int kind, const u8* codes, const u16* scales, const float* f32tab,
                                      const int* ids, int n_rows, int n_in, float* x) {
    PDL_ENTRY();
    int t = blockIdx.x;
    // an id outside the table (an argmax over a row with no finite logit gives 0x7fffffff) reads
    // nothing and embeds zeros
    bool inside = (unsigned)ids[t] < (unsigned)n_rows;
    size_t row = inside ? (size_t)ids[t] : 0;
    for (int e = blockIdx.y * blockDim.x + threadIdx.x; e < n_in; e += gridDim.y * blockDim.x) {
        float v;
        if (!inside) {
            v = 0.f;
        } else if (kind == 0) {
            v = f32tab[row * n_in + e];
        } else if (kind == 1) {
            // re-tiled Q1 word: element 4i + b of a 32-element word is bit i of byte b
            int nblk = n_in / 128, b = e / 128, j = e % 128;
            const u8* cb = codes + (row * nblk + b) * 16;
            float d = h2f(scales[row * nblk + b]);
            int w = j >> 5, r = j & 31;
            v = ((cb[4 * w + (r & 3)] >> (r >> 2)) & 1) ? d : -d;
        } else {
            int be = kind == 3 ? 64 : 128, cbytes = kind == 3 ? 16 : 32;
            int nblk = n_in / be, b = e / be, j = e % be;
            const u8* cb = codes + (row * nblk + b) * cbytes;
            float d = h2f(scales[row * nblk + b]);
            int w = j / 16, r = j % 16, s2 = r / 4, i = r % 4;
            int c = (cb[w * 4 + i] >> (2 * s2)) & 3;
            v = (float)(c - 1) * d;
        }
        x[(size_t)t * n_in + e] = v;
    }
}

// ---- Gated DeltaNet -----------------------------------------------------------------------------

// Causal depthwise conv (k taps) + SiLU over the step's n rows, then per-head L2 norm of q and k,
// and the gates. grid (2·hk + hv + 1), block = head dim (dk == dv).
//   mixed [n, conv_dim]; conv_state [k-1, conv_dim] oldest first; convw [conv_dim, k]
//   out q/k [n, hk·dk], v [n, hv·dv]; bb/aa [n, hv] raw beta/alpha projections;
//   beta_out = σ(bb), g_out = ssm_a·softplus(aa + dt_bias), [n, hv]. The last block does the gates.
extern "C" __global__ void gdn_conv(const float* mixed, float* conv_state, const float* convw, int kconv,
                                    int hk, int hv, int dk, int n, float eps, float* qo, float* ko,
                                    float* vo, const float* bb, const float* aa, const float* dt_bias,
                                    const float* ssm_a, float* beta_out, float* g_out) {
    PDL_ENTRY();
    __shared__ float red[32];
    int head = blockIdx.x;
    int conv_dim = 2 * hk * dk + hv * dk;
    if (head == 2 * hk + hv) {
        for (int i = threadIdx.x; i < n * hv; i += blockDim.x) {
            int h = i % hv;
            beta_out[i] = sigmoidf_(bb[i]);
            float a = aa[i] + dt_bias[h];
            float sp = a > 20.f ? a : log1pf(expf(a));
            g_out[i] = ssm_a[h] * sp;
        }
        return;
    }
    int ch = head * dk + threadIdx.x;
    bool active = threadIdx.x < dk;
    for (int t = 0; t < n; ++t) {
        float y = 0.f;
        if (active) {
            float xv = mixed[(size_t)t * conv_dim + ch];
            float acc = convw[ch * kconv + kconv - 1] * xv;
            for (int j = 0; j < kconv - 1; ++j) acc = fmaf(convw[ch * kconv + j], conv_state[j * conv_dim + ch], acc);
            for (int j = 0; j + 1 < kconv - 1; ++j) conv_state[j * conv_dim + ch] = conv_state[(j + 1) * conv_dim + ch];
            if (kconv > 1) conv_state[(kconv - 2) * conv_dim + ch] = xv;
            y = siluf_(acc);
        }
        if (head < 2 * hk) {
            float ss = block_sum(y * y, red);
            float inv = 1.0f / fmaxf(sqrtf(ss), eps);
            if (active) {
                float* dst = head < hk ? qo : ko;
                int hh = head < hk ? head : head - hk;
                dst[(size_t)t * hk * dk + hh * dk + threadIdx.x] = y * inv;
            }
        } else if (active) {
            vo[(size_t)t * hv * dk + (head - 2 * hk) * dk + threadIdx.x] = y;
        }
    }
}

// Gated delta rule, n recurrent steps. grid (hv, dv/32), block 256 (8 warps). Warp w owns key rows
// [w·R, (w+1)·R) (R = dk/8 <= 16), lane = value column. S stays in registers across the n rows.
//   S [hv, dk, dv]; q/k [n, hk, dk]; v [n, hv, dv]; g/beta [n, hv]; out [n, hv, dv].
extern "C" __global__ void gdn_step(float* S, const float* q, const float* k, const float* v,
                                    const float* g, const float* beta, int hk, int hv, int dk, int dv,
                                    int n, float* out) {
    __shared__ float ks[128], qs[128], red[8][32];
    int h = blockIdx.x, lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    int j = blockIdx.y * 32 + lane;
    int R = dk / 8;
    int kap = h % hk;
    float* Sh = S + (size_t)h * dk * dv;
    float s[16];
    // The state is loaded before the PDL wait, overlapping the previous kernel (the GDN conv):
    // S is written only by this kernel (a step earlier) and by the round's rollback (replay or a
    // copy), never by the kernel just before, and a kernel starts only after every block of its
    // predecessor has passed its own wait, i.e. after the one before that has finished.
#pragma unroll
    for (int r = 0; r < 16; ++r) s[r] = r < R ? Sh[(size_t)(w * R + r) * dv + j] : 0.f;
    PDL_ENTRY();
    float scale = 1.0f / sqrtf((float)dk);
    for (int t = 0; t < n; ++t) {
        __syncthreads();
        for (int i = threadIdx.x; i < dk; i += blockDim.x) {
            ks[i] = k[((size_t)t * hk + kap) * dk + i];
            qs[i] = q[((size_t)t * hk + kap) * dk + i];
        }
        __syncthreads();
        float decay = expf(g[t * hv + h]);
        float u = 0.f;
#pragma unroll
        for (int r = 0; r < 16; ++r)
            if (r < R) {
                s[r] *= decay;
                u = fmaf(s[r], ks[w * R + r], u);
            }
        red[w][lane] = u;
        __syncthreads();
        float ut = 0.f;
        for (int i = 0; i < 8; ++i) ut += red[i][lane];
        float delta = beta[t * hv + h] * (v[((size_t)t * hv + h) * dv + j] - ut);
        float o = 0.f;
#pragma unroll
        for (int r = 0; r < 16; ++r)
            if (r < R) {
                s[r] = fmaf(ks[w * R + r], delta, s[r]);
                o = fmaf(s[r], qs[w * R + r], o);
            }
        __syncthreads();
        red[w][lane] = o;
        __syncthreads();
        if (w == 0) {
            float ot = 0.f;
            for (int i = 0; i < 8; ++i) ot += red[i][lane];
            out[((size_t)t * hv + h) * dv + j] = ot * scale;
        }
    }
#pragma unroll
    for (int r = 0; r < 16; ++r)
        if (r < R) Sh[(size_t)(w * R + r) * dv + j] = s[r];
}

// gdn_conv fused into gdn_step for decode and verify (n ≤ 8 rows): the same bits as gdn_conv then
// gdn_step, one launch instead of two, and q / k never leave the block. grid (hv, dv/32), block
// 128 (GDN_CS_THREADS); dk == dv, dk % 32 == 0, dk ≤ 128, 1 ≤ kconv ≤ 8, hv ≥ hk.
//   Block (h, y) owns the 32 value columns y·32 .. y·32 + 31 of head h. gdn_step splits a column's
//   dk state rows into 8 chunks of R = dk/8 rows, sums each chunk in a thread (fmaf over its rows in
//   order) and adds the 8 chunk sums to 0 in chunk order; here thread (w, lane) holds column
//   jj = 8w + (lane & 7) and the two chunks 2cp, 2cp + 1 (cp = lane >> 3), so a column's 8 chunk
//   sums are in 4 lanes of one warp and reach each of them by shuffles, added in the same order:
//   no block barrier and no shared memory between the recurrence's two sums (gdn_step's order, so
//   the same bits). Lanes 0..7 of each warp (cp = 0) own their column's single writes.
//   Thread tid < dk also runs the conv of q channel kap·dk + tid and of k channel hk·dk + kap·dk +
//   tid of its k-head kap = h mod hk; warp w's q and k sums of squares are then the warp sums of
//   gdn_conv's warps w and 4 + w, added in their order (block_sum over dk threads). Two block
//   barriers a row (the q / k norms' warp sums, then the normed q / k), their shared buffers
//   double-buffered by row parity so that row t + 1's writes never meet row t's readers.
//   Each thread keeps its channels' conv windows in registers (read once, before the rows), so the
//   window update at the end is stores only. The value channels belong to one block each; the
//   q / k channels of head kap are read by the hv/hk·dv/32 blocks sharing kap, so each of them
//   counts itself on cnt[kap] once its window loads have been consumed (a release / acquire
//   atomic) and the last one writes them and resets the counter (cnt [≥ hk] u32, zero between
//   launches). Row t + 1's inputs are loaded while row t runs.
//   ko / vo / beta_out / g_out (L2-normed k [n, hk·dk], v [n, hv·dv], gates [n, hv], as gdn_conv
//   writes them) only when ko != 0: the verify record reads them. With rec_w > 0 they point into
//   the verify record itself (rows of rec_w floats: mixed ‖ k ‖ v ‖ g ‖ β, spec.cu) and the kernel
//   also copies each row's pre-conv input to the record (at ko − conv_dim): what gdn_rec_write
//   would write, with no launch of its own. out [n, hv·dv] unless 0.
//   snap_s / snap_conv (unless 0; S's and conv_state's layouts): the state and windows as this
//   launch read them, i.e. the speculative round's snapshot, written as a side output instead of
//   a separate copy of every layer before the verify.
//   NORM (gdn_conv_step_norm_d128: dv = 128, a cluster of the 4 blocks of a head): gated_norm_quant
//   fused in too — the owners put the row's 32 outputs in shared memory, warp 0 takes them back one
//   column a lane, the head's Σ o² is the 4 blocks' warp sums in cluster-rank order (block_sum's
//   order over the 128-thread block of gated_norm_quant), exchanged through distributed shared
//   memory, then y = o·inv·w·SiLU(z) and quant32, the same bits.
#define GDN_BN_MAXN 8      // rows of a BN launch (verify; the launcher takes BN only for 2..=8 rows)
#define GDN_CS_THREADS 128  // threads of a gdn_conv_step block (the launcher's block size)
// A column's 8 chunk sums added to 0 in chunk order (gdn_step's `for i < 8: ut += red[i]`), in
// every lane of the column, for the layout of gdn_conv_step_body and gdn_replay_body: lane holds
// column lane & 7 of its warp and chunks 2cp (c0), 2cp + 1 (c1), cp = lane >> 3.
__device__ __forceinline__ float gdn_chunk_total(float c0, float c1, int lane) {
    float tot = 0.f;
#pragma unroll
    for (int p = 0; p < 4; ++p) {
        const int src = (lane & 7) + 8 * p;
        const float a = __shfl_sync(0xffffffffu, c0, src), b = __shfl_sync(0xffffffffu, c1, src);
        tot += a;
        tot += b;
    }
    return tot;
}
// One row of gdn_step's recurrence on a lane's two chunks of its value column (the layout above):
// s[r] holds chunk 2cp's rows and s[16 + r] chunk 2cp + 1's (r < R). s ·= decay, u = Σ s·k over
// the column (gdn_chunk_total), δ = β·(v − u), s += k·δ and, with OUT, the column's o = Σ s·q
// (unscaled; 0 without OUT). kr / qr: the row's normed k / q in gdn_qk_slots' layout, r0 / r1 this
// lane's chunks there. The one statement of the update for gdn_conv_step_body, the producer-warp
// kernel and gdn_replay_body: the kernel tests compare all three with gdn_step bit for bit.
template <bool OUT>
__device__ __forceinline__ float gdn_state_row(float (&s)[32], const float* kr, const float* qr, int r0, int r1,
                                               int R, float decay, float bt, float yv, int lane) {
    float u0 = 0.f, u1 = 0.f;
#pragma unroll
    for (int r = 0; r < 16; ++r)
        if (r < R) {
            s[r] *= decay;
            u0 = fmaf(s[r], kr[r0 + r], u0);
            s[16 + r] *= decay;
            u1 = fmaf(s[16 + r], kr[r1 + r], u1);
        }
    const float ut = gdn_chunk_total(u0, u1, lane);
    const float delta = bt * (yv - ut);
    float o0 = 0.f, o1 = 0.f;
#pragma unroll
    for (int r = 0; r < 16; ++r)
        if (r < R) {
            s[r] = fmaf(kr[r0 + r], delta, s[r]);
            if (OUT) o0 = fmaf(s[r], qr[r0 + r], o0);
            s[16 + r] = fmaf(kr[r1 + r], delta, s[16 + r]);
            if (OUT) o1 = fmaf(s[16 + r], qr[r1 + r], o1);
        }
    return OUT ? gdn_chunk_total(o0, o1, lane) : 0.f;
}
// The padded shared-memory slots of a row's normed q / k in the same layout (dk = 8R channels;
// 4 floats of padding after each chunk pair of 2R channels, so the 4 chunk pairs a warp reads at
// once fall in different banks, at R = 16 also for 16-byte loads): GDN_QK_SLOTS floats a row for
// dk <= 128. r0 / r1: where this lane's chunks 2cp / 2cp + 1 start; kw: where channel tid goes.
#define GDN_QK_SLOTS 144  // 128 + 4 chunk pairs × 4
struct GdnQkSlots {
    int r0, r1, kw;
};
__device__ __forceinline__ GdnQkSlots gdn_qk_slots(int tid, int cp, int R) {
    const int r0 = 2 * cp * R + 4 * cp;
    return {r0, r0 + R, tid + 4 * (tid / (2 * R))};
}
// The gated norm of every row of a batched-norm (BN) launch, after a block barrier that put every
// row's outputs in osh and gates in zsh ([row][column of the block]): warp 0's Σ o² per row
// (warp_sum's tree, rows interleaved) to osumn, one cluster exchange (the head's 4 blocks, in rank
// order), then each row's y = o·inv·w·SiLU(z) and quant32 (gated_norm_quant's operations). Every
// thread of the block calls it (the cluster barrier); warp 0 does the work.
__device__ __forceinline__ void gdn_bn_norm_rows(const float (*osh)[32], const float (*zsh)[32], float* osumn,
                                                 int n, int w, int lane, float nwj, float norm_eps, int hv, int h,
                                                 int dv, int jn, float* yf, i8* yq, float* yd, int* ys) {
    if (w == 0) {
        float os[GDN_BN_MAXN];
#pragma unroll
        for (int t = 0; t < GDN_BN_MAXN; ++t) {
            const float o = t < n ? osh[t][lane] : 0.f;
            os[t] = o * o;
        }
        warp_sum_rows(os, n);
        if (lane == 0) {
#pragma unroll
            for (int t = 0; t < GDN_BN_MAXN; ++t)
                if (t < n) osumn[t] = os[t];
        }
    }
    cluster_sync_all();
    if (w == 0) {
        for (int t = 0; t < n; ++t) {
            float ss = 0.f;
            for (unsigned rk = 0; rk < 4; ++rk) ss += ld_cluster_f32(&osumn[t], rk);
            float inv = 1.0f / sqrtf(ss / (float)dv + norm_eps);
            float yo = osh[t][lane] * inv * nwj * siluf_(zsh[t][lane]);
            size_t idx = ((size_t)t * hv + h) * dv + jn;
            if (yf) yf[idx] = yo;
            size_t bq = idx >> 5;
            quant32(yo, yq + (bq << 5), yd + bq, ys + bq);
        }
    }
}
// KC: the conv width fixed at compile time (the entries take KC = 4, the real models' width, when
// the launch's kconv is 4), 0 for kconv as given.
template <bool NORM, bool P16 = false, bool BN = false, bool SNAP = true, bool EARLY = false, int KC = 0>
__device__ __forceinline__ void gdn_conv_step_body(
    float* S, const float* mixed, float* conv_state, const float* convw, int kconv_, int hk, int hv,
    int dk, int n, float eps, const float* bb, const float* aa, const float* dt_bias,
    const float* ssm_a, unsigned* cnt, float* out, float* ko, float* vo, float* beta_out,
    float* g_out, int rec_w, float* snap_s, float* snap_conv, const float* z, const float* nw_, float norm_eps,
    float* yf, i8* yq, float* yd, int* ys, P16Out po = {}) {
    static_assert(!P16 || NORM, "P16: the gated norm's output as b1-plane activations");
    static_assert(!BN || (NORM && !P16), "BN: the int8 gated norm of all rows after the recurrence");
    static_assert(KC >= 0 && KC <= 8, "KC: a conv width of 1..8, or 0");
    const int kconv = KC > 0 ? KC : kconv_;
    // [row parity][gdn_qk_slots] normed q / k; [row parity][q warps ‖ k warps] their warp sums
    __shared__ __align__(16) float ks[2][GDN_QK_SLOTS], qs[2][GDN_QK_SLOTS];
    __shared__ float wsum[2][8], osum[2], amx[2];
    // a row's 32 outputs (per row parity), for warp 0's norm; BN: every row's, and the rows' Σ o²
    __shared__ float osr[2][32];
    __shared__ float osh[BN ? GDN_BN_MAXN : 1][32], zsh[BN ? GDN_BN_MAXN : 1][32], osumn[BN ? GDN_BN_MAXN : 1];
    __shared__ int last_s;
    const int dv = dk;
    const int h = blockIdx.x, lane = threadIdx.x & 31, w = threadIdx.x >> 5, tid = threadIdx.x;
    const int cp = lane >> 3, jj = 8 * w + (lane & 7);  // chunk pair, column within the block
    const bool owner = cp == 0;
    const int j = blockIdx.y * 32 + jj;    // this thread's value column
    const int jn = blockIdx.y * 32 + lane;  // warp 0's column in the norm (one a lane)
    const int R = dk / 8;
    const int kap = h % hk;
    const int conv_dim = 2 * hk * dk + hv * dk;
    // row strides of the side outputs: their own buffers, or the verify record's rows (rec_w)
    const size_t rs_k = rec_w > 0 ? rec_w : hk * dk, rs_v = rec_w > 0 ? rec_w : hv * dv,
                 rs_g = rec_w > 0 ? rec_w : hv;
    float* Sh = S + (size_t)h * dk * dv;
    // s[c·16 + r]: row (2cp + c)·R + r of column j (c = 0, 1; r < R)
    float s[32];
    // S before the PDL wait, as in gdn_step (only this kernel and the round's rollback write it)
#pragma unroll
    for (int c = 0; c < 2; ++c)
#pragma unroll
        for (int r = 0; r < 16; ++r)
            s[c * 16 + r] = r < R ? Sh[(size_t)((2 * cp + c) * R + r) * dv + j] : 0.f;
    // this thread's q / k conv channels (if tid < dk) and its value channel
    const bool has_qk = tid < dk;
    const int q_ch = kap * dk + tid, k_ch = hk * dk + kap * dk + tid;
    const int v_ch = 2 * hk * dk + h * dk + j;
    const bool qk_rec = has_qk && h == kap && blockIdx.y == 0;  // the one block that writes q / k
    const int km1 = kconv - 1;
    // conv weights and windows (oldest first) in registers, also before the wait: the windows are
    // written only by this kernel (at its end, a step earlier), by prefill and by the round's
    // rollback, never by the kernel just before (the same argument as for S)
    float cw_q[8], cw_k[8], cw_v[8], win_q[7], win_k[7], win_v[7];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        cw_v[i] = i < kconv ? convw[v_ch * kconv + i] : 0.f;
        cw_q[i] = i < kconv && has_qk ? convw[q_ch * kconv + i] : 0.f;
        cw_k[i] = i < kconv && has_qk ? convw[k_ch * kconv + i] : 0.f;
    }
#pragma unroll
    for (int i = 0; i < 7; ++i) {
        win_v[i] = i < km1 ? conv_state[(size_t)i * conv_dim + v_ch] : 0.f;
        win_q[i] = i < km1 && has_qk ? conv_state[(size_t)i * conv_dim + q_ch] : 0.f;
        win_k[i] = i < km1 && has_qk ? conv_state[(size_t)i * conv_dim + k_ch] : 0.f;
    }
    // the head's gate constants and (NORM) warp 0's column's norm weight
    const float dtb = dt_bias[h], sa = ssm_a[h], nwj = NORM && w == 0 ? nw_[jn] : 0.f;
    const unsigned nshare = (unsigned)((hv / hk + (kap < hv % hk)) * gridDim.y);  // blocks of k-head kap
    unsigned cnt_old = 0u;
    if (EARLY) {
        // EARLY: count this block's window loads before the PDL wait (a block barrier orders
        // every thread's loads before thread 0's release-only add), so the count's fence and
        // round trip overlap the wait instead of stalling a barrier chain after it; thread 0 of
        // the last block pairs the old value with an acquire fence before the window writes
        __syncthreads();
        if (tid == 0) cnt_old = atom_add_release_gpu(cnt + kap, 1u);
    }
    PDL_ENTRY();
    if (SNAP && snap_s) {
        // the speculative round's snapshot of what this launch reads (after the wait: the round's
        // rollback reads the snapshot): the block's S rows, its value windows (the owners) and,
        // from one block per k-head, the q / k windows
#pragma unroll
        for (int c = 0; c < 2; ++c)
#pragma unroll
            for (int r = 0; r < 16; ++r)
                if (r < R) snap_s[(size_t)h * dk * dv + (size_t)((2 * cp + c) * R + r) * dv + j] = s[c * 16 + r];
        if (owner) {
#pragma unroll
            for (int i = 0; i < 7; ++i)
                if (i < km1) snap_conv[(size_t)i * conv_dim + v_ch] = win_v[i];
        }
        if (qk_rec) {
#pragma unroll
            for (int i = 0; i < 7; ++i)
                if (i < km1) {
                    snap_conv[(size_t)i * conv_dim + q_ch] = win_q[i];
                    snap_conv[(size_t)i * conv_dim + k_ch] = win_k[i];
                }
        }
    }
    // acc = w[k-1]·x, then fma over the window oldest first (gdn_conv's order); then slide
    auto conv_silu = [&](const float* cw, float* win, float x) -> float {
        float acc = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i)
            if (i == kconv - 1) acc = cw[i] * x;
#pragma unroll
        for (int i = 0; i < 7; ++i)
            if (i < km1) acc = fmaf(cw[i], win[i], acc);
#pragma unroll
        for (int i = 0; i < 7; ++i)
            if (i < km1) win[i] = i + 1 < km1 ? win[i + 1] : x;
        return siluf_(acc);
    };
    const float scale = 1.0f / sqrtf((float)dk);
    const int nwq = dk >> 5;
    const GdnQkSlots sl = gdn_qk_slots(tid, cp, R);
    const int r0 = sl.r0, r1 = sl.r1;  // this lane's two chunks in ks / qs
    const int kw = sl.kw;              // where channel tid's q / k go (tid < dk)
    int last = 0;
    // row t's inputs, loaded a row ahead
    auto in_q = [&](int t) { return has_qk ? mixed[(size_t)t * conv_dim + q_ch] : 0.f; };
    auto in_k = [&](int t) { return has_qk ? mixed[(size_t)t * conv_dim + k_ch] : 0.f; };
    float xq = in_q(0), xk = in_k(0), xv = mixed[v_ch], xa = aa[h], xb = bb[h];
    float zt = NORM && w == 0 ? z[(size_t)h * dv + jn] : 0.f;
    for (int t = 0; t < n; ++t) {
        const int b = t & 1;
        float nq = 0.f, nk = 0.f, nv = 0.f, na = 0.f, nb = 0.f, nz = 0.f;
        if (t + 1 < n) {
            nq = in_q(t + 1);
            nk = in_k(t + 1);
            nv = mixed[(size_t)(t + 1) * conv_dim + v_ch];
            na = aa[(t + 1) * hv + h];
            nb = bb[(t + 1) * hv + h];
            if (NORM && w == 0) nz = z[((size_t)(t + 1) * hv + h) * dv + jn];
        }
        if (rec_w > 0) {
            // the record's pre-conv row (what gdn_rec_write copied): each value channel from its
            // owner, each q / k channel from one block of its k-head
            float* rm = ko - conv_dim + (size_t)t * rec_w;
            if (owner) rm[v_ch] = xv;
            if (qk_rec) {
                rm[q_ch] = xq;
                rm[k_ch] = xk;
            }
        }
        // conv + SiLU of the q / k channels and of the value column
        const float yqv = has_qk ? conv_silu(cw_q, win_q, xq) : 0.f;
        const float ykv = has_qk ? conv_silu(cw_k, win_k, xk) : 0.f;
        const float yv = conv_silu(cw_v, win_v, xv);
        const float wq = warp_sum(yqv * yqv), wk = warp_sum(ykv * ykv);
        if (lane == 0) {
            wsum[b][w] = wq;
            wsum[b][4 + w] = wk;
        }
        __syncthreads();
        if (!EARLY && t == 0 && tid == 0) {
            // every window load of this block has been consumed (the block barrier above): count
            last = atom_add_acq_rel_gpu(cnt + kap, 1u) + 1 == nshare;
        }
        if (has_qk) {
            float ssq = 0.f, ssk = 0.f;
            for (int i = 0; i < nwq; ++i) ssq += wsum[b][i];
            for (int i = 0; i < nwq; ++i) ssk += wsum[b][4 + i];
            const float qn = yqv * (1.0f / fmaxf(sqrtf(ssq), eps));
            const float kn = ykv * (1.0f / fmaxf(sqrtf(ssk), eps));
            qs[b][kw] = qn;
            ks[b][kw] = kn;
            if (ko && qk_rec) ko[(size_t)t * rs_k + kap * dk + tid] = kn;
        }
        const float a = xa + dtb;
        const float sp = a > 20.f ? a : log1pf(expf(a));
        const float gt = sa * sp;
        const float bt = sigmoidf_(xb);
        if (ko) {
            if (owner) vo[(size_t)t * rs_v + h * dv + j] = yv;
            if (blockIdx.y == 0 && tid == 0) {
                beta_out[(size_t)t * rs_g + h] = bt;
                g_out[(size_t)t * rs_g + h] = gt;
            }
        }
        __syncthreads();
        // gdn_step's row t
        const float ov = gdn_state_row<true>(s, ks[b], qs[b], r0, r1, R, expf(gt), bt, yv, lane) * scale;
        if (owner) {
            if (out) out[((size_t)t * hv + h) * dv + j] = ov;
            if (BN) osh[t][jj] = ov;
            else if (NORM) osr[b][jj] = ov;
        }
        if (BN && w == 0) zsh[t][lane] = zt;
        if (NORM && !BN) {
            // warp 0 takes the row's outputs one column a lane; the head's 4 warp sums, in rank
            // order; the slots of row t are rewritten at row t + 2, after every block has passed
            // row t + 1's barriers, i.e. finished reading them
            __syncthreads();
            float on = 0.f;
            if (w == 0) {
                on = osr[b][lane];
                const float os = warp_sum(on * on);
                if (lane == 0) osum[b] = os;
            }
            cluster_sync_all();
            float yo = 0.f;
            if (w == 0) {
                float ss = 0.f;
                for (unsigned rk = 0; rk < 4; ++rk) ss += ld_cluster_f32(&osum[b], rk);
                float inv = 1.0f / sqrtf(ss / (float)dv + norm_eps);
                yo = on * inv * nwj * siluf_(zt);
                size_t idx = ((size_t)t * hv + h) * dv + jn;
                if (yf) yf[idx] = yo;
                if (P16) {
                    const float am = warp_max(fabsf(yo));
                    if (lane == 0) amx[b] = am;
                } else {
                    size_t bq = idx >> 5;
                    quant32(yo, yq + (bq << 5), yd + bq, ys + bq);
                }
            }
            if (P16) {
                // the head is one 128-element block of the row (dv = 128), block rank y its
                // sub-block: the 4 warp maxima (slot reuse as osum's), then swiglu_quant_p16's
                // arithmetic on the same amax
                cluster_sync_all();
                if (w == 0) {
                    const float amax = fmaxf(fmaxf(ld_cluster_f32(&amx[b], 0), ld_cluster_f32(&amx[b], 1)),
                                             fmaxf(ld_cluster_f32(&amx[b], 2), ld_cluster_f32(&amx[b], 3)));
                    const size_t k = (size_t)hv * dv;
                    quant_p16_store(yo, amax, h, blockIdx.y, po.xp + t * (k >> 1), po.xu + t * (k >> 7),
                                    po.xs + t * (k >> 5), po.xv ? po.xv + t * k * 2 : nullptr);
                }
            }
        }
        xq = nq;
        xk = nk;
        xv = nv;
        xa = na;
        xb = nb;
        zt = nz;
    }
    if (BN) {
        // the gated norm of every row: warp 0's Σ o² per row (warp_sum's tree, rows interleaved),
        // one cluster exchange, then each row's y and quant32 as above (the same operations)
        __syncthreads();  // every owner's outputs are in osh
        gdn_bn_norm_rows(osh, zsh, osumn, n, w, lane, nwj, norm_eps, hv, h, dv, jn, yf, yq, yd, ys);
    }
    // no block leaves while a peer may still read its osum / amx / osumn: an execution barrier
    // (the peers' reads have returned, their values are used before they arrive), so relaxed —
    // with a release its arrive would wait behind a GPU-wide fence for the row's stores
    if (NORM) cluster_sync_relaxed();
#pragma unroll
    for (int c = 0; c < 2; ++c)
#pragma unroll
        for (int r = 0; r < 16; ++r)
            if (r < R) Sh[(size_t)((2 * cp + c) * R + r) * dv + j] = s[c * 16 + r];
    // window update: the registers hold the last km1 elements of [window ‖ rows]
    if (owner) {
#pragma unroll
        for (int i = 0; i < 7; ++i)
            if (i < km1) conv_state[(size_t)i * conv_dim + v_ch] = win_v[i];
    }
    if (tid == 0) {
        if (EARLY) {
            last = cnt_old + 1 == nshare;
            // acquire (the add was release-only): the other blocks' counted window loads come
            // before this block's window writes, which follow the barrier below
            if (last) fence_acq_rel_gpu();
        }
        last_s = last;
    }
    __syncthreads();
    if (last_s) {
        if (has_qk) {
#pragma unroll
            for (int i = 0; i < 7; ++i)
                if (i < km1) {
                    conv_state[(size_t)i * conv_dim + q_ch] = win_q[i];
                    conv_state[(size_t)i * conv_dim + k_ch] = win_k[i];
                }
        }
        if (tid == 0) cnt[kap] = 0u;
    }
}

extern "C" __global__ void __launch_bounds__(GDN_CS_THREADS) gdn_conv_step(
    float* S, const float* mixed, float* conv_state, const float* convw, int kconv, int hk, int hv,
    int dk, int n, float eps, const float* bb, const float* aa, const float* dt_bias,
    const float* ssm_a, unsigned* cnt, float* out, float* ko, float* vo, float* beta_out,
    float* g_out, int rec_w, float* snap_s, float* snap_conv) {
    gdn_conv_step_body<false>(S, mixed, conv_state, convw, kconv, hk, hv, dk, n, eps, bb, aa, dt_bias,
                              ssm_a, cnt, out, ko, vo, beta_out, g_out, rec_w, snap_s, snap_conv, nullptr,
                              nullptr, 0.f, nullptr, nullptr, nullptr, nullptr);
}

// gdn_conv_step with gated_norm_quant fused (dk = dv = 128): z [n, hv·dv] the gate input, nw the
// ssm_norm weight [dv]; yf (f32, unless 0), yq / yd / ys as gated_norm_quant writes them.
// Three entries, one parameter list (GDN_NORM_ENTRY: name, BN, SNAP):
//   gdn_conv_step_norm_d128       decode (and any launch without a snapshot): no snapshot code, so
//                                 its SASS is the one-row kernel's of before the snapshot existed
//                                 (with the code in, the H200 decode step measured 1.5 % / 3 %
//                                 slower on Q1_0 / Q2_0, in a build that also ran another compile);
//   gdn_conv_step_norm_snap_d128  verify launches that write the round's snapshot;
//   gdn_conv_step_norm_bn_d128    verify launches (2 ≤ n ≤ 8): the gated norm of all rows after the
//                                 recurrence with one cluster exchange instead of a cluster barrier
//                                 per row; the same bits.
#define GDN_NORM_ENTRY(NAME, BN, SNAP) GDN_NORM_ENTRY_E(NAME, BN, SNAP, false)
#define GDN_NORM_ENTRY_E(NAME, BN, SNAP, EARLY)                                                        \
    extern "C" __global__ void CLUSTER_DIMS(1, 4, 1) __launch_bounds__(GDN_CS_THREADS) NAME(                        \
        float* S, const float* mixed, float* conv_state, const float* convw, int kconv, int hk, int hv,  \
        int dk, int n, float eps, const float* bb, const float* aa, const float* dt_bias,                \
        const float* ssm_a, unsigned* cnt, float* out, float* ko, float* vo, float* beta_out,            \
        float* g_out, int rec_w, float* snap_s, float* snap_conv, const float* z, const float* nw, float norm_eps,  \
        float* yf, i8* yq, float* yd, int* ys) {                                                         \
        if (kconv == 4)                                                                                  \
            gdn_conv_step_body<true, false, BN, SNAP, EARLY, 4>(                                         \
                S, mixed, conv_state, convw, kconv, hk, hv, 128, n, eps, bb, aa, dt_bias, ssm_a, cnt, out,   \
                ko, vo, beta_out, g_out, rec_w, snap_s, snap_conv, z, nw, norm_eps, yf, yq, yd, ys);      \
        else                                                                                             \
            gdn_conv_step_body<true, false, BN, SNAP, EARLY>(                                            \
                S, mixed, conv_state, convw, kconv, hk, hv, 128, n, eps, bb, aa, dt_bias, ssm_a, cnt, out,   \
                ko, vo, beta_out, g_out, rec_w, snap_s, snap_conv, z, nw, norm_eps, yf, yq, yd, ys);      \
    }
GDN_NORM_ENTRY(gdn_conv_step_norm_d128, false, false)
GDN_NORM_ENTRY(gdn_conv_step_norm_snap_d128, false, true)
GDN_NORM_ENTRY(gdn_conv_step_norm_bn_d128, true, true)
// The decode kernel counting its window loads before the PDL wait (`Gpu::gdn_early_count`, the
// default for one-row launches without a snapshot): decode graph 2.504 -> 2.492 ms per token on
// Q1_0, 3.162 -> 3.144 on Q2_0 (bench/results/cuda-gdn-early-ab-27b-*.json).
GDN_NORM_ENTRY_E(gdn_conv_step_norm_early_d128, false, false, true)
// The batched-norm verify kernel with the same early count (`Gpu::gdn_early_count`, the default for
// 2–8-row launches). Without it, thread 0's acq_rel count after the first barriers of row 0 also
// waits, behind its GPU-scope fence, for the snapshot stores the thread has just issued, and the
// block's next barrier waits for thread 0.
GDN_NORM_ENTRY_E(gdn_conv_step_norm_bn_early_d128, true, true, true)

// Named barriers (bar.sync / bar.arrive with a thread count): a producer warp group arrives, the
// consumers wait; shared-memory writes before the arrive are visible after the wait.
__device__ __forceinline__ void named_bar_sync(unsigned id, unsigned nthreads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(nthreads) : "memory");
}
__device__ __forceinline__ void named_bar_arrive(unsigned id, unsigned nthreads) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(nthreads) : "memory");
}

// gdn_conv_step_norm_bn_early_d128 with a producer warp group (`Gpu::gdn_producer`; the default for
// the verify launches since 2026-12-08, BONSAI_CUDA_GDN_PW=0 off; conv width 4 only): grid (hv, 4)
// in clusters of 4 as before, block 256 (GDN_PW_THREADS). Warps 0–3 are the recurrence warps, with
// gdn_conv_step_body's thread layout (column jj = 8w + (lane & 7), chunks 2cp and 2cp + 1) and
// nothing else to do a row; warps 4–7
// run every row's S-independent work ahead of them: the q / k conv + SiLU of channel tid − 128
// (warp 4 + w's sums of squares are gdn_conv_step_body's warp w's), the norms, the value conv of
// column y·32 + lane (warp 4, once a column instead of once per chunk pair), every row's gates
// (warp 5, lane t row t, before the rows), every row's z (warp 6) and every record store. A row's
// normed q / k, value column, decay and β go to shared memory slots of their own (a launch has at
// most GDN_BN_MAXN rows, so no slot is reused), then the producers arrive on named barrier 2 + t
// and the recurrence warps wait on it; the producers' own norm exchange is named barrier 1 (128
// threads). The same float operations in the same order as the 128-thread kernel, so the same
// bits (`gdn_conv_step_equals_conv_then_step` compares them). The tail (the gated norm of all
// rows in gdn_bn_norm_rows, the window counts, the window writes) is gdn_conv_step_body's.
#define GDN_PW_THREADS 256
extern "C" __global__ void CLUSTER_DIMS(1, 4, 1) __launch_bounds__(GDN_PW_THREADS, 2) gdn_conv_step_norm_bn_pw_d128(
    float* S, const float* mixed, float* conv_state, const float* convw, int kconv_, int hk, int hv,
    int dk_, int n, float eps, const float* bb, const float* aa, const float* dt_bias,
    const float* ssm_a, unsigned* cnt, float* out, float* ko, float* vo, float* beta_out,
    float* g_out, int rec_w, float* snap_s, float* snap_conv, const float* z, const float* nw_, float norm_eps,
    float* yf, i8* yq, float* yd, int* ys) {
    constexpr int dk = 128, dv = 128, R = 16, kconv = 4, km1 = 3;
    // [row] normed q / k (gdn_qk_slots); [row parity][q warps ‖ k warps] the producers' warp sums
    __shared__ __align__(16) float ks[GDN_BN_MAXN][GDN_QK_SLOTS], qs[GDN_BN_MAXN][GDN_QK_SLOTS];
    __shared__ float wsum[2][8];
    // [row] the value column's conv output, the decay exp(g) and β
    __shared__ float vsh[GDN_BN_MAXN][32], dsh[GDN_BN_MAXN], bsh[GDN_BN_MAXN];
    __shared__ float osh[GDN_BN_MAXN][32], zsh[GDN_BN_MAXN][32], osumn[GDN_BN_MAXN];
    __shared__ int last_s;
    const int h = blockIdx.x, tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    const bool prod = w >= 4;
    const int pt = tid & 127, pw = w & 3;  // producers: channel pt, warp pw; recurrence: warp pw
    const int cp = lane >> 3, jj = 8 * pw + (lane & 7);
    const bool owner = !prod && cp == 0;
    const int j = blockIdx.y * 32 + jj;     // a recurrence thread's value column
    const int jn = blockIdx.y * 32 + lane;  // warp 0's column in the norm, warp 4's value column
    const int kap = h % hk;
    const int conv_dim = 2 * hk * dk + hv * dk;
    const size_t rs_k = rec_w > 0 ? rec_w : hk * dk, rs_v = rec_w > 0 ? rec_w : hv * dv,
                 rs_g = rec_w > 0 ? rec_w : hv;
    float* Sh = S + (size_t)h * dk * dv;
    // recurrence: s[c·16 + r] = row (2cp + c)·R + r of column j, loaded before the PDL wait
    float s[32];
    if (!prod) {
#pragma unroll
        for (int c = 0; c < 2; ++c)
#pragma unroll
            for (int r = 0; r < R; ++r) s[c * 16 + r] = Sh[(size_t)((2 * cp + c) * R + r) * dv + j];
    }
    // producers: q / k channel pt, warp 4 also value column jn; weights and windows (oldest first)
    const int q_ch = kap * dk + pt, k_ch = hk * dk + kap * dk + pt;
    const int v_ch = 2 * hk * dk + h * dk + jn;
    const bool vown = prod && pw == 0;
    const bool qk_rec = prod && h == kap && blockIdx.y == 0;  // the one block that writes q / k
    float cw_q[kconv], cw_k[kconv], cw_v[kconv], win_q[km1], win_k[km1], win_v[km1];
    if (prod) {
#pragma unroll
        for (int i = 0; i < kconv; ++i) {
            cw_q[i] = convw[q_ch * kconv + i];
            cw_k[i] = convw[k_ch * kconv + i];
            cw_v[i] = vown ? convw[v_ch * kconv + i] : 0.f;
        }
#pragma unroll
        for (int i = 0; i < km1; ++i) {
            win_q[i] = conv_state[(size_t)i * conv_dim + q_ch];
            win_k[i] = conv_state[(size_t)i * conv_dim + k_ch];
            win_v[i] = vown ? conv_state[(size_t)i * conv_dim + v_ch] : 0.f;
        }
    }
    const float nwj = w == 0 ? nw_[jn] : 0.f;
    const unsigned nshare = (unsigned)((hv / hk + (kap < hv % hk)) * gridDim.y);  // blocks of k-head kap
    // the early count (gdn_conv_step_body's EARLY): every window load of the block is ordered
    // before thread 0's release-only add by this barrier
    unsigned cnt_old = 0u;
    __syncthreads();
    if (tid == 0) cnt_old = atom_add_release_gpu(cnt + kap, 1u);
    PDL_ENTRY();
    if (snap_s) {
        if (!prod) {
#pragma unroll
            for (int c = 0; c < 2; ++c)
#pragma unroll
                for (int r = 0; r < R; ++r)
                    snap_s[(size_t)h * dk * dv + (size_t)((2 * cp + c) * R + r) * dv + j] = s[c * 16 + r];
        }
        if (vown) {
#pragma unroll
            for (int i = 0; i < km1; ++i) snap_conv[(size_t)i * conv_dim + v_ch] = win_v[i];
        }
        if (qk_rec) {
#pragma unroll
            for (int i = 0; i < km1; ++i) {
                snap_conv[(size_t)i * conv_dim + q_ch] = win_q[i];
                snap_conv[(size_t)i * conv_dim + k_ch] = win_k[i];
            }
        }
    }
    if (prod) {
        // acc = w[k-1]·x, then fma over the window oldest first (gdn_conv's order); then slide
        auto conv_silu = [&](const float* cw, float* win, float x) -> float {
            float acc = cw[kconv - 1] * x;
#pragma unroll
            for (int i = 0; i < km1; ++i) acc = fmaf(cw[i], win[i], acc);
#pragma unroll
            for (int i = 0; i < km1; ++i) win[i] = i + 1 < km1 ? win[i + 1] : x;
            return siluf_(acc);
        };
        const int kw = gdn_qk_slots(pt, 0, R).kw;  // where channel pt's q / k go
        if (pw == 1 && lane < n) {
            // every row's gates at once, lane t row t (off the rows' critical path), before the
            // warp's first arrive
            const int t = lane;
            const float a = aa[t * hv + h] + dt_bias[h];
            const float sp = a > 20.f ? a : log1pf(expf(a));
            const float gt = ssm_a[h] * sp;
            const float bt = sigmoidf_(bb[t * hv + h]);
            dsh[t] = expf(gt);
            bsh[t] = bt;
            if (ko && blockIdx.y == 0) {
                beta_out[(size_t)t * rs_g + h] = bt;
                g_out[(size_t)t * rs_g + h] = gt;
            }
        } else if (pw == 2) {
            // every row's z (the gated norm's gate), read in the tail
            for (int t = 0; t < n; ++t) zsh[t][lane] = z[((size_t)t * hv + h) * dv + jn];
        }
        float xq = mixed[q_ch], xk = mixed[k_ch], xv = vown ? mixed[v_ch] : 0.f;
        for (int t = 0; t < n; ++t) {
            const int b = t & 1;
            float nq = 0.f, nk = 0.f, nv = 0.f;
            if (t + 1 < n) {
                nq = mixed[(size_t)(t + 1) * conv_dim + q_ch];
                nk = mixed[(size_t)(t + 1) * conv_dim + k_ch];
                if (vown) nv = mixed[(size_t)(t + 1) * conv_dim + v_ch];
            }
            if (rec_w > 0) {
                // the record's pre-conv row (what gdn_rec_write copied)
                float* rm = ko - conv_dim + (size_t)t * rec_w;
                if (vown) rm[v_ch] = xv;
                if (qk_rec) {
                    rm[q_ch] = xq;
                    rm[k_ch] = xk;
                }
            }
            const float yqv = conv_silu(cw_q, win_q, xq);
            const float ykv = conv_silu(cw_k, win_k, xk);
            if (vown) {
                const float yv = conv_silu(cw_v, win_v, xv);
                vsh[t][lane] = yv;
                if (ko) vo[(size_t)t * rs_v + h * dv + jn] = yv;
            }
            const float wq = warp_sum(yqv * yqv), wk = warp_sum(ykv * ykv);
            if (lane == 0) {
                wsum[b][pw] = wq;
                wsum[b][4 + pw] = wk;
            }
            named_bar_sync(1, 128);
            float ssq = 0.f, ssk = 0.f;
            for (int i = 0; i < 4; ++i) ssq += wsum[b][i];
            for (int i = 0; i < 4; ++i) ssk += wsum[b][4 + i];
            const float qn = yqv * (1.0f / fmaxf(sqrtf(ssq), eps));
            const float kn = ykv * (1.0f / fmaxf(sqrtf(ssk), eps));
            qs[t][kw] = qn;
            ks[t][kw] = kn;
            if (ko && qk_rec) ko[(size_t)t * rs_k + kap * dk + pt] = kn;
            named_bar_arrive(2 + t, GDN_PW_THREADS);
            xq = nq;
            xk = nk;
            xv = nv;
        }
        // the value window (the q / k windows after the count, below)
        if (vown) {
#pragma unroll
            for (int i = 0; i < km1; ++i) conv_state[(size_t)i * conv_dim + v_ch] = win_v[i];
        }
    } else {
        const float scale = 1.0f / sqrtf((float)dk);
        const GdnQkSlots sl = gdn_qk_slots(tid, cp, R);
        const int r0 = sl.r0, r1 = sl.r1;  // this lane's two chunks in ks / qs
        for (int t = 0; t < n; ++t) {
            named_bar_sync(2 + t, GDN_PW_THREADS);
            // gdn_step's row t
            const float ov =
                gdn_state_row<true>(s, ks[t], qs[t], r0, r1, R, dsh[t], bsh[t], vsh[t][jj], lane) * scale;
            if (owner) {
                if (out) out[((size_t)t * hv + h) * dv + j] = ov;
                osh[t][jj] = ov;
            }
        }
#pragma unroll
        for (int c = 0; c < 2; ++c)
#pragma unroll
            for (int r = 0; r < R; ++r) Sh[(size_t)((2 * cp + c) * R + r) * dv + j] = s[c * 16 + r];
    }
    // the gated norm of every row (gdn_bn_norm_rows, as gdn_conv_step_body's BN tail)
    __syncthreads();  // every owner's outputs are in osh, every row's z in zsh
    gdn_bn_norm_rows(osh, zsh, osumn, n, w, lane, nwj, norm_eps, hv, h, dv, jn, yf, yq, yd, ys);
    // no block leaves while a peer may still read its osumn (see gdn_conv_step_body)
    cluster_sync_relaxed();
    if (tid == 0) {
        const int last = cnt_old + 1 == nshare;
        if (last) fence_acq_rel_gpu();
        last_s = last;
    }
    __syncthreads();
    if (last_s) {
        if (prod) {
#pragma unroll
            for (int i = 0; i < km1; ++i) {
                conv_state[(size_t)i * conv_dim + q_ch] = win_q[i];
                conv_state[(size_t)i * conv_dim + k_ch] = win_k[i];
            }
        }
        if (tid == 0) cnt[kap] = 0u;
    }
}

// gdn_conv_step_norm_d128 with the gated norm's output written as b1-plane activations (xp, xu, xs
// and, unless null, xv: P16Out's layout over rows of hv·128) instead of int8 codes: the input of
// the b1-plane ssm_out. Same values as gated_norm_quant; the codes as swiglu_quant_p16 /
// rmsnorm_quant would write them for those values (quant_p16_store).
extern "C" __global__ void CLUSTER_DIMS(1, 4, 1) __launch_bounds__(GDN_CS_THREADS) gdn_conv_step_norm_p16_d128(
    float* S, const float* mixed, float* conv_state, const float* convw, int kconv, int hk, int hv,
    int dk, int n, float eps, const float* bb, const float* aa, const float* dt_bias,
    const float* ssm_a, unsigned* cnt, float* out, float* ko, float* vo, float* beta_out,
    float* g_out, int rec_w, float* snap_s, float* snap_conv, const float* z, const float* nw, float norm_eps,
    float* yf, u32* xp, float* xu, int* xs, u8* xv) {
    if (kconv == 4)
        gdn_conv_step_body<true, true, false, true, false, 4>(
            S, mixed, conv_state, convw, kconv, hk, hv, 128, n, eps, bb, aa, dt_bias, ssm_a, cnt, out, ko, vo,
            beta_out, g_out, rec_w, snap_s, snap_conv, z, nw, norm_eps, yf, nullptr, nullptr, nullptr,
            P16Out{xp, xu, xs, xv});
    else
        gdn_conv_step_body<true, true>(S, mixed, conv_state, convw, kconv, hk, hv, 128, n, eps, bb, aa, dt_bias,
                                       ssm_a, cnt, out, ko, vo, beta_out, g_out, rec_w, snap_s, snap_conv, z, nw,
                                       norm_eps, yf, nullptr, nullptr, nullptr, P16Out{xp, xu, xs, xv});
}

// y = rmsnorm(o_h) ⊙ ssm_norm ⊙ SiLU(z_h) per head, written f32 (yf, may be null) and quantized.
// grid (hv, n), block dv (a multiple of 32).
extern "C" __global__ void gated_norm_quant(const float* o, const float* z, const float* w, float eps,
                                            int hv, int dv, float* yf, i8* q, float* d, int* s) {
    PDL_ENTRY();
    __shared__ float red[32];
    int h = blockIdx.x, t = blockIdx.y, j = threadIdx.x;
    size_t k = (size_t)hv * dv;
    size_t idx = t * k + (size_t)h * dv + j;
    float x = o[idx];
    float ss = block_sum(x * x, red);
    float inv = 1.0f / sqrtf(ss / (float)dv + eps);
    float y = x * inv * w[j] * siluf_(z[idx]);
    if (yf) yf[idx] = y;
    size_t b = idx >> 5;
    quant32(y, q + (b << 5), d + b, s + b);
}

// gated_norm_quant for long launches (prefill), dv = 128: one warp per (row, head), 4 consecutive
// elements per lane (16-byte loads, 8 warps per block instead of one 128-thread block per head)
// and the same bits as gated_norm_quant. Σ x² follows block_sum's tree over the 128 threads: within
// a 32-element group the xor levels j^16, j^8, j^4 are lane xor 4, 2, 1 here, then j^2, j^1 are
// the in-lane pairs (e, e^2), (e, e^1) (addition commutes, so every element's partner sums alike);
// the four group sums are then added to 0 in group order. The quantization is quant32's on 8-lane
// groups (exact max, exact integer sum), as in swiglu_quant_v4.
// grid ceil(n·hv / 8), block 256; o / z / yf / w 16-byte aligned.
extern "C" __global__ void __launch_bounds__(256) gated_norm_quant_v4(const float* o, const float* z,
                                                                      const float* w, float eps, int n,
                                                                      int hv, float* yf, i8* q, float* d,
                                                                      int* s) {
    PDL_ENTRY();
    int lane = threadIdx.x & 31;
    int p = blockIdx.x * 8 + (threadIdx.x >> 5);  // p = t·hv + h
    if (p >= n * hv) return;
    size_t i = (size_t)p * 128 + 4 * lane;
    float4 x4 = *(const float4*)(o + i);
    float x[4] = {x4.x, x4.y, x4.z, x4.w};
    float sq[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) sq[e] = x[e] * x[e];
#pragma unroll
    for (int l = 4; l > 0; l >>= 1)
#pragma unroll
        for (int e = 0; e < 4; ++e) sq[e] += __shfl_xor_sync(0xffffffffu, sq[e], l);
    float r = (sq[0] + sq[2]) + (sq[1] + sq[3]);  // this lane's 32-element group (lane >> 3)
    float ss = 0.f;
#pragma unroll
    for (int gi = 0; gi < 4; ++gi) ss += __shfl_sync(0xffffffffu, r, 8 * gi);
    float inv = 1.0f / sqrtf(ss / (float)128 + eps);
    float4 z4 = *(const float4*)(z + i), w4 = *(const float4*)(w + 4 * lane);
    float zz[4] = {z4.x, z4.y, z4.z, z4.w}, ww[4] = {w4.x, w4.y, w4.z, w4.w};
    float v[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) v[e] = x[e] * inv * ww[e] * siluf_(zz[e]);
    if (yf) *(float4*)(yf + i) = make_float4(v[0], v[1], v[2], v[3]);
    quant32_x4(v, q + i, d + (i >> 5), s + (i >> 5));
}

// ---- gated attention ----------------------------------------------------------------------------

// Split q ‖ gate, per-head RMSNorm (q_norm / k_norm), partial NEOX RoPE, K/V append (f16).
// grid (nh + nkv, n), block hd. qf [n, nh, 2, hd]; kf/vf [n, nkv·hd]; qo [n, nh, hd] f32;
// kc/vc [n_ctx, nkv·hd] f16. The step's first position is read from device memory (*pos0).
extern "C" __global__ void attn_prep(const float* qf, const float* kf, const float* vf, const float* qn,
                                     const float* kn, float eps, int nh, int nkv, int hd, int n_rot,
                                     float rope_base, const int* pos0, float* qo, u16* kc, u16* vc) {
    __shared__ float red[32], buf[1024];
    int h = blockIdx.x, t = blockIdx.y, j = threadIdx.x;
    bool isq = h < nh;
    int kvw = nkv * hd;
    // Before the PDL wait: the norm weight, the position and the rotation (double pow / sincos).
    // The position is written by step_advance or a host copy, never by the kernel just before (a
    // kernel starts only after every block of its predecessor has passed its own wait, i.e. after
    // the one before that has finished, and no attention layer comes that early in a forward).
    float nw = isq ? qn[j] : kn[j];
    int pos = *pos0 + t;
    int half = n_rot / 2, dd = j < half ? j : j - half;
    double sn = 0.0, cs = 1.0;
    if (j < n_rot) {
        double theta = (double)pos * pow((double)rope_base, -2.0 * dd / (double)n_rot);
        sincos(theta, &sn, &cs);
    }
    PDL_ENTRY();
    float x = isq ? qf[((size_t)t * nh + h) * 2 * hd + j] : kf[(size_t)t * kvw + (h - nh) * hd + j];
    float ss = block_sum(x * x, red);
    float inv = 1.0f / sqrtf(ss / (float)hd + eps);
    float y = x * inv * nw;
    buf[j] = y;
    __syncthreads();
    if (j < n_rot) {
        double a = buf[dd], b = buf[dd + half];
        y = j < half ? (float)(a * cs - b * sn) : (float)(a * sn + b * cs);
    }
    if (isq) {
        qo[((size_t)t * nh + h) * hd + j] = y;
    } else {
        int g = h - nh;
        kc[(size_t)pos * kvw + g * hd + j] = f2h(y);
        vc[(size_t)pos * kvw + g * hd + j] = f2h(vf[(size_t)t * kvw + g * hd + j]);
    }
}

// Flash-decode, phase 1. Positions are cut into fixed chunks of AT_CHUNK (independent of the
// launch), so results do not depend on the grid or on n. grid (nh, gy, n), block AT_WARPS warps;
// block (h, y, t) handles chunks c = y, y + gy, ... below ceil(L_t / AT_CHUNK), L_t = *pos0 + t + 1.
// Warp w of a chunk takes its AT_PW positions one at a time: lanes split the head dim (EPL
// consecutive elements each, vector loads of f16 K/V), the score is a warp xor-tree sum, and the
// warp keeps an online softmax (m, l, acc). The block merges its warps in a fixed order and writes
// part[t, h, c] = (acc[0..hd), m, l). No atomics.
#define AT_WARPS 4
#define AT_PW 8
#define AT_CHUNK (AT_WARPS * AT_PW)

template <int EPL>
__device__ __forceinline__ void ld_h(const u16* p, u32* w) {
    if (EPL == 8) {
        uint4 v = *(const uint4*)p;
        w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
    } else if (EPL == 4) {
        uint2 v = *(const uint2*)p;
        w[0] = v.x; w[1] = v.y;
    } else {
        w[0] = *(const u32*)p;
    }
}
__device__ __forceinline__ float lo_h(u32 w) { return h2f((u16)(w & 0xffffu)); }
__device__ __forceinline__ float hi_h(u32 w) { return h2f((u16)(w >> 16)); }

// qrow: this block's first q row (hd floats; global or shared memory); the block serves HPB
// consecutive q heads h0 = blockIdx.x·HPB .. h0 + HPB − 1, all of one kv head (the host picks HPB
// dividing nh / nkv), whose rows follow qrow at hd floats apart. Each head's operations are the
// one-head kernel's (HPB = 1) in the same order, so any HPB gives the same bits; a block loads each
// K / V row once for its HPB heads (a sixth of the L2 traffic at HPB = 6 on the 27B's 24 / 4 heads)
// and its warps run HPB independent chains.
template <int EPL, int HPB>
__device__ __forceinline__ void attn_chunks(const float* qrow, const u16* kc, const u16* vc, int nh, int nkv,
                                            const int* pos0, int nchunk, float* part) {
    const int HD = EPL * 32, NW = EPL / 2;
    __shared__ float sm[HPB][AT_WARPS][HD + 2];
    int h0 = blockIdx.x * HPB, t = blockIdx.z, lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    int L = *pos0 + t + 1;
    int nc = (L + AT_CHUNK - 1) / AT_CHUNK;
    int g = h0 / (nh / nkv), kvw = nkv * HD;
    float scale = 1.0f / sqrtf((float)HD);
    float qv[HPB][EPL];
#pragma unroll
    for (int hh = 0; hh < HPB; ++hh)
#pragma unroll
        for (int e = 0; e < EPL; ++e) qv[hh][e] = qrow[hh * HD + lane * EPL + e];
    for (int c = blockIdx.y; c < nc; c += gridDim.y) {
        float m[HPB], l[HPB], acc[HPB][EPL];
#pragma unroll
        for (int hh = 0; hh < HPB; ++hh) {
            m[hh] = NEG_INF;
            l[hh] = 0.f;
#pragma unroll
            for (int e = 0; e < EPL; ++e) acc[hh][e] = 0.f;
        }
        int pb = c * AT_CHUNK + w * AT_PW;
        int pe = min(pb + AT_PW, L);
        for (int p = pb; p < pe; p += 4) {
            u32 kw[4][NW], vw[4][NW];
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                if (p + u < pe) {
                    size_t off = (size_t)(p + u) * kvw + g * HD + lane * EPL;
                    ld_h<EPL>(kc + off, kw[u]);
                    ld_h<EPL>(vc + off, vw[u]);
                }
            }
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                if (p + u < pe) {
#pragma unroll
                    for (int hh = 0; hh < HPB; ++hh) {
                        float a = 0.f;
#pragma unroll
                        for (int e = 0; e < NW; ++e) {
                            a = fmaf(qv[hh][2 * e], lo_h(kw[u][e]), a);
                            a = fmaf(qv[hh][2 * e + 1], hi_h(kw[u][e]), a);
                        }
                        float sc = warp_sum(a) * scale;
                        float mn = fmaxf(m[hh], sc);
                        float corr = expf(m[hh] - mn), pe_ = expf(sc - mn);
                        l[hh] = fmaf(l[hh], corr, pe_);
#pragma unroll
                        for (int e = 0; e < NW; ++e) {
                            acc[hh][2 * e] = fmaf(acc[hh][2 * e], corr, pe_ * lo_h(vw[u][e]));
                            acc[hh][2 * e + 1] = fmaf(acc[hh][2 * e + 1], corr, pe_ * hi_h(vw[u][e]));
                        }
                        m[hh] = mn;
                    }
                }
            }
        }
        __syncthreads();
#pragma unroll
        for (int hh = 0; hh < HPB; ++hh) {
#pragma unroll
            for (int e = 0; e < EPL; ++e) sm[hh][w][lane * EPL + e] = acc[hh][e];
            if (lane == 0) {
                sm[hh][w][HD] = m[hh];
                sm[hh][w][HD + 1] = l[hh];
            }
        }
        __syncthreads();
#pragma unroll
        for (int hh = 0; hh < HPB; ++hh) {
            // warp 0 always has a position (c·AT_CHUNK < L), so M is finite
            float M = sm[hh][0][HD];
#pragma unroll
            for (int i = 1; i < AT_WARPS; ++i) M = fmaxf(M, sm[hh][i][HD]);
            float* pp = part + (((size_t)t * nh + h0 + hh) * nchunk + c) * (HD + 2);
            for (int i = threadIdx.x; i < HD + 2; i += blockDim.x) {
                float o = 0.f;
#pragma unroll
                for (int ww = 0; ww < AT_WARPS; ++ww) {
                    float f = expf(sm[hh][ww][HD] - M);
                    float v = i < HD ? sm[hh][ww][i] : sm[hh][ww][HD + 1];
                    o = fmaf(v, f, o);
                }
                if (i == HD) o = M;
                pp[i] = o;
            }
        }
    }
}

#define ATTN_CHUNKS_ENTRY(NAME, EPL, HPB)                                                             \
    extern "C" __global__ void __launch_bounds__(AT_WARPS * 32) NAME(                                 \
        const float* qo, const u16* kc, const u16* vc, int nh, int nkv, const int* pos0, int nchunk,  \
        float* part) {                                                                                \
        PDL_ENTRY();                                                                                  \
        attn_chunks<EPL, HPB>(qo + ((size_t)blockIdx.z * nh + blockIdx.x * HPB) * (EPL * 32), kc, vc, \
                              nh, nkv, pos0, nchunk, part);                                           \
    }
ATTN_CHUNKS_ENTRY(attn_chunks_hd64, 2, 1)
ATTN_CHUNKS_ENTRY(attn_chunks_hd128, 4, 1)
ATTN_CHUNKS_ENTRY(attn_chunks_hd256, 8, 1)
ATTN_CHUNKS_ENTRY(attn_chunks_hd256_h2, 8, 2)
ATTN_CHUNKS_ENTRY(attn_chunks_hd256_h3, 8, 3)
ATTN_CHUNKS_ENTRY(attn_chunks_hd256_h6, 8, 6)

// A chunk partial's float. A call rather than p[i] in the two helpers below: that is how they
// read before the fused decode kernel (ld.cg loads of the same partials) was removed on
// 2026-12-07; with plain indexing NVRTC 13.5 compiles the merge kernels a little differently
// (other registers, a few other address and move instructions), with the call to the same SASS.
__device__ __forceinline__ float attn_part_ld(const float* p) { return *p; }

// The merge's maximum over nc chunk partials (pp: the row's first, W floats apart).
__device__ __forceinline__ float attn_merge_max(const float* pp, size_t W, int hd, int nc) {
    float M = NEG_INF;
    for (int c = 0; c < nc; ++c) M = fmaxf(M, attn_part_ld(pp + (size_t)c * W + hd));
    return M;
}

// The merge's chunk-order chains, one dependent L2 load after another: ls = Σ l_c·f_c and
// o = Σ acc_c[j]·f_c with f_c = expf(m_c − M), in chunk order.
__device__ __forceinline__ void attn_merge_sums(const float* pp, size_t W, int hd, int nc, int j, float M,
                                                float& ls, float& o) {
    for (int c = 0; c < nc; ++c) {
        const float* pc = pp + (size_t)c * W;
        float f = expf(attn_part_ld(pc + hd) - M);
        ls = fmaf(attn_part_ld(pc + hd + 1), f, ls);
        o = fmaf(attn_part_ld(pc + j), f, o);
    }
}

// Both: the serial merge of (h, t)'s chunks for output j.
__device__ __forceinline__ void attn_merge_chain(const float* pp, size_t W, int hd, int nc, int j, float& ls,
                                                 float& o) {
    attn_merge_sums(pp, W, hd, nc, j, attn_merge_max(pp, W, hd, nc), ls, o);
}

// The merge's output for (h, t, j): o / ls ⊙ σ(gate), f32 (out, may be null) and quant32.
__device__ __forceinline__ void attn_merge_out(float o, float ls, const float* qf, int nh, int hd, int h, int t,
                                               int j, float* out, i8* q, float* d, int* s) {
    float gate = qf[((size_t)t * nh + h) * 2 * hd + hd + j];
    float y = o / ls * sigmoidf_(gate);
    size_t idx = ((size_t)t * nh + h) * hd + j;
    if (out) out[idx] = y;
    size_t b = idx >> 5;
    quant32(y, q + (b << 5), d + b, s + b);
}

// Flash-decode, phase 2: merge the chunk partials of (h, t) in chunk order, ⊙ σ(gate), write f32
// (out, may be null) and quantize (head dims are multiples of 32, so quant blocks never straddle
// heads). grid (nh, n), block hd. part as above; out/q [n, nh·hd]; d/s [n, nh·hd/32].
// The same float operations in the same order as attn_merge_quant_serial, so the same bits; only
// the loads are arranged so that a thread does not wait on one L2 round trip per chunk (at 4,000
// positions, 125 chunks a row). Warp 0 reads the chunk maxima, 32 chunks a lane step, and takes
// their maximum (it does not depend on the order: fmaxf skips NaN, and where it picks +0 or −0,
// x − M and so expf(x − M) are the same for every x); then per tile of AT_MT chunks warp 0 writes
// the tile's factors expf(m_c − M) and its l_c to shared memory, every thread issues its AT_MT
// partial loads together, and the fmaf chains run over the tile in chunk order. One block barrier
// per tile (two from the second on). Rows of at most AT_MS chunks take the serial loop (no barrier).
#define AT_MT 32
#define AT_MS 2
extern "C" __global__ void attn_merge_quant(const float* part, const float* qf, int nh, int hd,
                                            const int* pos0, int nchunk, float* out, i8* q, float* d,
                                            int* s) {
    __shared__ float fs[AT_MT], lv[AT_MT];
    PDL_ENTRY();
    int h = blockIdx.x, t = blockIdx.y, j = threadIdx.x;
    int L = *pos0 + t + 1;
    int nc = (L + AT_CHUNK - 1) / AT_CHUNK;
    const size_t W = (size_t)hd + 2;  // floats per chunk partial
    const float* pp = part + ((size_t)t * nh + h) * nchunk * W;
    float ls = 0.f, o = 0.f;
    if (nc <= AT_MS) {  // block-uniform
        attn_merge_chain(pp, W, hd, nc, j, ls, o);
    } else {
        float M = NEG_INF;  // warp 0's only
        if (j < 32) {
            for (int c = j; c < nc; c += 32) M = fmaxf(M, pp[(size_t)c * W + hd]);
            M = warp_max(M);
        }
        for (int c0 = 0; c0 < nc; c0 += AT_MT) {
            int m = min(AT_MT, nc - c0);
            if (c0 > 0) __syncthreads();  // the previous tile's factors are consumed
            if (j < m) {
                const float* pc = pp + (size_t)(c0 + j) * W;
                fs[j] = expf(pc[hd] - M);
                lv[j] = pc[hd + 1];
            }
            __syncthreads();
            float v[AT_MT];
#pragma unroll
            for (int i = 0; i < AT_MT; ++i) v[i] = i < m ? pp[(size_t)(c0 + i) * W + j] : 0.f;
#pragma unroll
            for (int i = 0; i < AT_MT; ++i) {
                if (i < m) {
                    ls = fmaf(lv[i], fs[i], ls);
                    o = fmaf(v[i], fs[i], o);
                }
            }
        }
    }
    attn_merge_out(o, ls, qf, nh, hd, h, t, j, out, q, d, s);
}

// Flash-decode, phase 2, the first form (`Gpu::set_attn_merge_serial`, kept for the bit-equality
// test and A/B runs): merge the chunk partials of (h, t) in chunk order, ⊙ σ(gate), write f32
// (out, may be null) and quantize (head dims are multiples of 32, so quant blocks never straddle
// heads). grid (nh, n), block hd. part as above; out/q [n, nh·hd]; d/s [n, nh·hd/32].
extern "C" __global__ void attn_merge_quant_serial(const float* part, const float* qf, int nh, int hd,
                                            const int* pos0, int nchunk, float* out, i8* q, float* d,
                                            int* s) {
    PDL_ENTRY();
    int h = blockIdx.x, t = blockIdx.y, j = threadIdx.x;
    int L = *pos0 + t + 1;
    int nc = (L + AT_CHUNK - 1) / AT_CHUNK;
    const size_t W = (size_t)hd + 2;
    float ls = 0.f, o = 0.f;
    attn_merge_chain(part + ((size_t)t * nh + h) * nchunk * W, W, hd, nc, j, ls, o);
    attn_merge_out(o, ls, qf, nh, hd, h, t, j, out, q, d, s);
}

// Busy-wait about `ns` nanoseconds (profiling: lets the host queue the next launches first).
extern "C" __global__ void spin_ns(long long ns) {
    long long t0;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    for (;;) {
        long long t1;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
        if (t1 - t0 >= ns) break;
    }
}

// One link of a chain of dependent launches (measuring what a kernel boundary costs in a captured
// graph): block 0's thread 0 adds 1 to *p once the previous kernel of the stream has finished, so
// a lost increment would show a broken dependency. The other blocks only wait.
extern "C" __global__ void launch_chain_step(int* p) {
    PDL_ENTRY();
    if (blockIdx.x == 0 && threadIdx.x == 0) *p += 1;
}

// ---- MLP and head -------------------------------------------------------------------------------

// h = SiLU(g) ⊙ u, written f32 (hf, may be null) and quantized. grid (ceil(k/256), n), block 256.
extern "C" __global__ void swiglu_quant(const float* gt, const float* up, int k, float* hf, i8* q, float* d,
                                        int* s) {
    PDL_ENTRY();
    int t = blockIdx.y, b = blockIdx.x * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    int nb = k >> 5;
    if (b >= nb) return;
    size_t i = (size_t)t * k + b * 32 + lane;
    float v = siluf_(gt[i]) * up[i];
    if (hf) hf[i] = v;
    quant32(v, q + (size_t)t * k + b * 32, d + (size_t)t * nb + b, s + (size_t)t * nb + b);
}

// swiglu_quant's values written as b1-plane activations instead of int8 codes (the input of the
// b1-plane ffn_down: `mvbp_q1_*`, and with `o.xv` the int8 tensor-core verify `mvbq_q1_*`):
// grid (k / 128, n), block 128 (warp j: sub-block j of 128-element block blockIdx.x); k % 256 == 0.
// The SwiGLU-fused b1-plane gate‖up launch writes the same bits.
extern "C" __global__ void __launch_bounds__(128) swiglu_quant_p16(const float* gt, const float* up, int k,
                                                                   float* hf, u32* xp, float* xu, int* xs,
                                                                   u8* xv) {
    __shared__ float sm[16];
    const P16Out o{xp, xu, xs, xv};
    PDL_ENTRY();
    const int t = blockIdx.y, blk = blockIdx.x;
    const size_t i = (size_t)t * k + (size_t)blk * 128 + threadIdx.x;
    const float v = siluf_(gt[i]) * up[i];
    if (hf) hf[i] = v;
    quant_p16_part(v, blk, 0, sm, o.xp + (size_t)t * (k >> 1), o.xu + (size_t)t * (k >> 7),
                   o.xs + (size_t)t * (k >> 5), o.xv ? o.xv + (size_t)t * k * 2 : nullptr);
}

// swiglu_quant for long launches (prefill): 4 elements per thread with 16-byte loads, 8 lanes per
// 32-element block (xor shuffles 1, 2, 4), the same per-element operations as swiglu_quant and
// quant32 (exact max, exact integer sum), so the same bits. grid (ceil(k/1024), n), block 256;
// k % 32 == 0, gt / up / hf rows 16-byte aligned.
extern "C" __global__ void swiglu_quant_v4(const float* gt, const float* up, int k, float* hf, i8* q, float* d,
                                           int* s) {
    PDL_ENTRY();
    int t = blockIdx.y, c = blockIdx.x * blockDim.x + threadIdx.x;  // 4-element piece of the row
    int nb = k >> 5;
    int b = c >> 3;  // the 8 lanes of a group share b (a warp is 4 whole groups)
    if (b >= nb) return;
    size_t i = (size_t)t * k + 4 * (size_t)c;
    float4 g4 = *(const float4*)(gt + i), u4 = *(const float4*)(up + i);
    float v[4] = {siluf_(g4.x) * u4.x, siluf_(g4.y) * u4.y, siluf_(g4.z) * u4.z, siluf_(g4.w) * u4.w};
    if (hf) *(float4*)(hf + i) = make_float4(v[0], v[1], v[2], v[3]);
    quant32_x4(v, q + i, d + (size_t)t * nb + b, s + (size_t)t * nb + b);
}

// ---- row statistics over the vocabulary (argmax, log-sum-exp) -----------------------------------
//
// grid (nb, rows), block 256: block b of row t scans the slice [b·chunk, (b+1)·chunk) of the row
// (chunk = ⌈nv / 4 / nb⌉·4, so a slice starts 16-byte aligned when the row does), each thread its
// indices in increasing order, then merges with its warp (fixed xor tree) and the block's warps
// (in warp order). The block writes its partial to `part [rows, nb, 4]` and counts itself in
// `cnt[t]`; the last block of the row to arrive merges the nb partials in a fixed order (lane l
// takes partials l and l + 32, then the xor tree) and resets the counter for the next launch. nb
// depends on nv alone (the launcher), so a row's result never depends on how many rows a launch
// has. nb <= 64.

// Visits slice [i0, i1) of row `l` in increasing index order per thread: f(v, i) per element.
// `vec` (every row 16-byte aligned: an aligned base and nv % 4 == 0) takes float4 loads; either
// way the path is a property of the launch's nv and base alone, the same for every row.
template <typename F>
__device__ __forceinline__ void visit_slice(const float* l, int i0, int i1, bool vec, F f) {
    if (vec) {
        int n4 = (i1 - i0) >> 2;
        const float4* l4 = (const float4*)(l + i0);
#pragma unroll 4
        for (int c = threadIdx.x; c < n4; c += blockDim.x) {
            float4 v = l4[c];
            int i = i0 + 4 * c;
            f(v.x, i);
            f(v.y, i + 1);
            f(v.z, i + 2);
            f(v.w, i + 3);
        }
        for (int i = i0 + 4 * n4 + threadIdx.x; i < i1; i += blockDim.x) f(l[i], i);
    } else {
        for (int i = i0 + threadIdx.x; i < i1; i += blockDim.x) f(l[i], i);
    }
}

// Last-block handshake: publish this block's partial (written by thread 0 before the call), count
// the block; true in the block that arrives last (which then sees every partial).
__device__ __forceinline__ bool last_block_of_row(unsigned* cnt, int nb) {
    __shared__ bool last;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        unsigned old = atomicAdd(cnt, 1u);
        last = old == (unsigned)(nb - 1);
        if (last) *cnt = 0u;  // every block of the row has counted: ready for the next launch
    }
    __syncthreads();
    if (last) __threadfence();
    return last;
}

__device__ __forceinline__ void argmax_merge(float& b, int& bi, float v, int i) {
    if (v > b || (v == b && i < bi)) { b = v; bi = i; }
}

// ids[t] = argmax logits[t] (lowest index on ties; NaN never wins; 0x7fffffff when nothing beats
// −inf). grid (nb, rows), block 256; part [rows, nb, 4] u32, cnt [rows] (zero between launches).
extern "C" __global__ void argmax_rows(const float* logits, int nv, int* ids, u32* part, unsigned* cnt) {
    PDL_ENTRY();
    __shared__ float bv[32];
    __shared__ int bi[32];
    int t = blockIdx.y, nb = gridDim.x, b = blockIdx.x;
    int chunk = ((nv + 3) / 4 + nb - 1) / nb * 4;
    int i0 = min(nv, b * chunk), i1 = min(nv, i0 + chunk);
    const float* l = logits + (size_t)t * nv;
    float best = NEG_INF;
    int bidx = 0x7fffffff;
    visit_slice(l, i0, i1, (nv & 3) == 0 && (((size_t)logits) & 15) == 0, [&](float v, int i) {
        if (v > best) { best = v; bidx = i; }
    });
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        argmax_merge(best, bidx, __shfl_xor_sync(0xffffffffu, best, o), __shfl_xor_sync(0xffffffffu, bidx, o));
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    if (lane == 0) { bv[w] = best; bi[w] = bidx; }
    __syncthreads();
    u32* pr = part + (size_t)t * nb * 4;
    if (threadIdx.x == 0) {
        for (int i = 1; i < (int)(blockDim.x >> 5); ++i) argmax_merge(best, bidx, bv[i], bi[i]);
        pr[4 * b] = __float_as_uint(best);
        pr[4 * b + 1] = (u32)bidx;
    }
    if (!last_block_of_row(cnt + t, nb) || w != 0) return;
    best = NEG_INF;
    bidx = 0x7fffffff;
    for (int j = lane; j < nb; j += 32)
        argmax_merge(best, bidx, __uint_as_float(__ldcg(pr + 4 * j)), (int)__ldcg(pr + 4 * j + 1));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        argmax_merge(best, bidx, __shfl_xor_sync(0xffffffffu, best, o), __shfl_xor_sync(0xffffffffu, bidx, o));
    if (lane == 0) ids[t] = bidx;
}

// merge (m, s, i) with (m2, s2, i2) of an online (max, Σ exp(v − max), first argmax): the larger
// max wins, ties to the lower index
__device__ __forceinline__ void lse_merge(float& m, float& s, int& i, float m2, float s2, int i2) {
    if (m2 == NEG_INF) return;
    if (m == NEG_INF) {
        m = m2; s = s2; i = i2;
        return;
    }
    float M = fmaxf(m, m2);
    s = s * expf(m - M) + s2 * expf(m2 - M);
    if (m2 > m || (m2 == m && i2 < i)) i = i2;
    m = M;
}

__device__ __forceinline__ void lse_warp_merge(float& m, float& s, int& i) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float m2 = __shfl_xor_sync(0xffffffffu, m, o);
        float s2 = __shfl_xor_sync(0xffffffffu, s, o);
        int i2 = __shfl_xor_sync(0xffffffffu, i, o);
        lse_merge(m, s, i, m2, s2, i2);
    }
}

// Per logits row: the first maximum (NaN never wins, like the host sampler's NaN → −inf), its
// value, and the log-sum-exp. grid (nb, rows), block 256; part [rows, nb, 4] u32, cnt [rows].
// out [rows, 4] u32: argmax (0x7fffffff when no finite maximum), max (f32 bits), lse (f64 bits,
// low word first). Each thread keeps an online (max, Σ exp(v − max)) over its indices in
// increasing order; warps, the block and then the row's blocks merge in a fixed order, so the
// result is deterministic.
extern "C" __global__ void logit_stats_rows(const float* logits, int nv, u32* out, u32* part, unsigned* cnt) {
    PDL_ENTRY();
    __shared__ float bm[32], bs[32];
    __shared__ int bi[32];
    int t = blockIdx.y, nb = gridDim.x, b = blockIdx.x;
    int chunk = ((nv + 3) / 4 + nb - 1) / nb * 4;
    int i0 = min(nv, b * chunk), i1 = min(nv, i0 + chunk);
    const float* l = logits + (size_t)t * nv;
    float best = NEG_INF, sum = 0.f;
    int bidx = 0x7fffffff;
    visit_slice(l, i0, i1, (nv & 3) == 0 && (((size_t)logits) & 15) == 0, [&](float v, int i) {
        if (v > best) {
            sum = (best == NEG_INF ? 0.f : sum * expf(best - v)) + 1.0f;
            best = v;
            bidx = i;
        } else if (v > NEG_INF) {
            sum += expf(v - best);
        }
    });
    lse_warp_merge(best, sum, bidx);
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    if (lane == 0) { bm[w] = best; bs[w] = sum; bi[w] = bidx; }
    __syncthreads();
    u32* pr = part + (size_t)t * nb * 4;
    if (threadIdx.x == 0) {
        for (int k = 1; k < (int)(blockDim.x >> 5); ++k) lse_merge(best, sum, bidx, bm[k], bs[k], bi[k]);
        pr[4 * b] = __float_as_uint(best);
        pr[4 * b + 1] = __float_as_uint(sum);
        pr[4 * b + 2] = (u32)bidx;
    }
    if (!last_block_of_row(cnt + t, nb) || w != 0) return;
    float m = NEG_INF, s = 0.f;
    int i = 0x7fffffff;
    for (int j = lane; j < nb; j += 32)
        lse_merge(m, s, i, __uint_as_float(__ldcg(pr + 4 * j)), __uint_as_float(__ldcg(pr + 4 * j + 1)),
                  (int)__ldcg(pr + 4 * j + 2));
    lse_warp_merge(m, s, i);
    if (lane == 0) {
        double lse = m == NEG_INF ? (double)NEG_INF : (double)m + log((double)s);
        unsigned long long lb = (unsigned long long)__double_as_longlong(lse);
        u32* o = out + (size_t)t * 4;
        o[0] = (u32)(m == NEG_INF ? 0x7fffffff : i);
        o[1] = __float_as_uint(m);
        o[2] = (u32)(lb & 0xffffffffull);
        o[3] = (u32)(lb >> 32);
    }
}

// ---- the sampler's candidates: a row's best TOPK_N logits ----
#define TOPK_N 64       // entries per row (Gpu::TOPK_ROW)
#define TOPK_BUF 4096   // keys one block reduces at once (a power of two)

// Sort key of one logit, larger = better in the host sampler's order (value descending, then the
// lower id): the value with NaN → −inf and −0 → +0 (the host compares with partial_cmp, where the
// zeros tie) as order-preserving bits, above the complemented id. 0 is below every real key.
__device__ __forceinline__ unsigned long long topk_key(float v, int i) {
    if (v != v) v = NEG_INF;
    if (v == 0.f) v = 0.f;
    u32 u = __float_as_uint(v);
    u32 o = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return ((unsigned long long)o << 32) | (unsigned long long)(~(u32)i);
}

// The selection is a bitonic top-k reduction (block TK_THREADS). Keys sit in shared memory at
// tk_sw(a), a swizzle within aligned groups of 16 so that a thread's 8 consecutive keys and a
// pass's consecutive pairs fall in different banks. A block sorts runs of 64 (alternating
// direction; the first three stages and every stage's last three passes on 8 keys in registers),
// then halves the keys until 64 are left: the larger of each descending run's and the next
// (ascending) run's i-th key is a bitonic run holding the best 64 of the two, sorted again by one
// merge. About 40 barriers and a third of the exchanges of sorting all 4,096 keys
// (27 us against 68 us per 248,320-entry row on the H200).
#define TK_THREADS 512

__device__ __forceinline__ int tk_sw(int a) { return a ^ ((a >> 3) & 15); }

__device__ __forceinline__ void tk_cas(unsigned long long& x, unsigned long long& y, bool desc) {
    if (desc ? x < y : x > y) {
        unsigned long long t = x;
        x = y;
        y = t;
    }
}

// One network pass over keys [0, n): pairs (a, a + j), descending where (a & k) == 0.
__device__ __forceinline__ void tk_pass(unsigned long long* s, int n, int j, int k) {
    for (int p = threadIdx.x; p < n / 2; p += TK_THREADS) {
        int a = 2 * p - (p & (j - 1)), b = a + j;
        int pa = tk_sw(a), pb = tk_sw(b);
        unsigned long long x = s[pa], y = s[pb];
        if ((a & k) == 0 ? x < y : x > y) {
            s[pa] = y;
            s[pb] = x;
        }
    }
    __syncthreads();
}

// Thread t's keys 8t .. 8t + 8 (of [0, n)) in registers: with sort8, network stages 2, 4 and 8;
// else stage k's passes j = 4, 2, 1 (k >= 16: one direction for all 8).
__device__ __forceinline__ void tk_chunk(unsigned long long* s, int n, int k, bool sort8) {
    int t = threadIdx.x;
    if (8 * t < n) {
        unsigned long long v[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = s[tk_sw(8 * t + i)];
        if (sort8) {
#pragma unroll
            for (int kk = 2; kk <= 8; kk <<= 1)
#pragma unroll
                for (int j = kk >> 1; j > 0; j >>= 1)
#pragma unroll
                    for (int i = 0; i < 8; ++i)
                        if ((i & j) == 0) tk_cas(v[i], v[i + j], ((8 * t + i) & kk) == 0);
        } else {
            bool d = ((8 * t) & k) == 0;
#pragma unroll
            for (int j = 4; j > 0; j >>= 1)
#pragma unroll
                for (int i = 0; i < 8; ++i)
                    if ((i & j) == 0) tk_cas(v[i], v[i + j], d);
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) s[tk_sw(8 * t + i)] = v[i];
    }
    __syncthreads();
}

// The best TOPK_N of s's TOPK_BUF keys, descending, in logical slots [0, TOPK_N).
__device__ __forceinline__ void tk_reduce(unsigned long long* s) {
    tk_chunk(s, TOPK_BUF, 0, true);
    for (int k = 16; k <= TOPK_N; k <<= 1) {
        for (int j = k >> 1; j >= 8; j >>= 1) tk_pass(s, TOPK_BUF, j, k);
        tk_chunk(s, TOPK_BUF, k, false);
    }
    for (int n = TOPK_BUF; n > TOPK_N; n >>= 1) {
        unsigned long long r[TOPK_BUF / 2 / TK_THREADS];
#pragma unroll
        for (int u = 0; u < TOPK_BUF / 2 / TK_THREADS; ++u) {
            int q = threadIdx.x + u * TK_THREADS;
            if (q < n / 2) {
                int run = q / TOPK_N, i = q % TOPK_N;
                unsigned long long x = s[tk_sw(2 * TOPK_N * run + i)];
                unsigned long long y = s[tk_sw(2 * TOPK_N * run + TOPK_N + i)];
                r[u] = x > y ? x : y;
            }
        }
        __syncthreads();
#pragma unroll
        for (int u = 0; u < TOPK_BUF / 2 / TK_THREADS; ++u) {
            int q = threadIdx.x + u * TK_THREADS;
            if (q < n / 2) s[tk_sw(q)] = r[u];
        }
        __syncthreads();
        for (int j = TOPK_N / 2; j >= 8; j >>= 1) tk_pass(s, n / 2, j, TOPK_N);
        tk_chunk(s, n / 2, TOPK_N, false);
    }
}

// The best TOPK_N of keys src(0 .. n) into best [TOPK_N], descending (0 keys pad when n < TOPK_N):
// tk_reduce per TOPK_BUF batch, each later batch's best merged with the best so far by one bitonic
// merge.
template <typename Src>
__device__ __forceinline__ void tk_select(unsigned long long* s, unsigned long long* best, int n, Src src) {
    int base = 0;
    bool first = true;
    do {
        int take = min(TOPK_BUF, n - base);
        for (int j = threadIdx.x; j < TOPK_BUF; j += TK_THREADS) s[tk_sw(j)] = j < take ? src(base + j) : 0ull;
        __syncthreads();
        tk_reduce(s);
        if (!first) {
            unsigned long long x = 0ull;
            if (threadIdx.x < TOPK_N) {
                unsigned long long a = best[threadIdx.x], b = s[tk_sw(TOPK_N - 1 - threadIdx.x)];
                x = a > b ? a : b;
            }
            __syncthreads();
            if (threadIdx.x < TOPK_N) s[tk_sw(threadIdx.x)] = x;
            __syncthreads();
            for (int j = TOPK_N / 2; j >= 8; j >>= 1) tk_pass(s, TOPK_N, j, 2 * TOPK_N);
            tk_chunk(s, TOPK_N, 2 * TOPK_N, false);
        }
        if (threadIdx.x < TOPK_N) best[threadIdx.x] = s[tk_sw(threadIdx.x)];
        __syncthreads();
        base += take;
        first = false;
    } while (base < n);
}

// Per logits row: its TOPK_N best entries in the host sampler's order, best first, as
// out [rows, TOPK_N, 2] u32 (id, f32 bits; NaN reads as −inf, −0 as +0; id 0xffffffff pads rows
// shorter than TOPK_N). grid (nb, rows) with the row split of logit_stats_rows, block TK_THREADS;
// part [rows, nb, TOPK_N] u64, cnt [rows] (zero between launches). Each block selects the best
// of its slice, the row's last block the best of the blocks' selections: a selection under a
// total order, so the result does not depend on the split.
extern "C" __global__ void topk_rows(const float* logits, int nv, u32* out, unsigned long long* part,
                                     unsigned* cnt) {
    PDL_ENTRY();
    __shared__ unsigned long long s[TOPK_BUF];
    __shared__ unsigned long long best[TOPK_N];
    int t = blockIdx.y, nb = gridDim.x, b = blockIdx.x;
    int chunk = ((nv + 3) / 4 + nb - 1) / nb * 4;
    int i0 = min(nv, b * chunk), i1 = min(nv, i0 + chunk);
    const float* l = logits + (size_t)t * nv;
    tk_select(s, best, i1 - i0, [&](int j) { return topk_key(l[i0 + j], i0 + j); });
    unsigned long long* pr = part + (size_t)t * nb * TOPK_N;
    if (threadIdx.x < TOPK_N) {
        pr[b * TOPK_N + threadIdx.x] = best[threadIdx.x];
        __threadfence();
    }
    if (!last_block_of_row(cnt + t, nb)) return;
    tk_select(s, best, nb * TOPK_N, [&](int j) { return __ldcg(pr + j); });
    if (threadIdx.x < TOPK_N) {
        unsigned long long k = best[threadIdx.x];
        u32 o = (u32)(k >> 32);
        u32* w = out + ((size_t)t * TOPK_N + threadIdx.x) * 2;
        w[0] = ~(u32)k;
        w[1] = (o & 0x80000000u) ? (o & 0x7fffffffu) : ~o;
    }
}

// End of a captured greedy decode step: hist[pos] = token; pos += 1. grid 1, block 1.
extern "C" __global__ void step_advance(int* pos, const int* tok, int* hist, int hist_len) {
    PDL_ENTRY();
    int p = *pos;
    if (p >= 0 && p < hist_len) hist[p] = *tok;
    *pos = p + 1;
}
