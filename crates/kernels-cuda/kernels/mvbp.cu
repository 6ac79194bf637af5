// ---- b1-plane Q1_0 mat-vec (`mvbp_q1_*`, n <= 5 rows) -------------------------------------------
// The Q1_0 code words are the A fragments of `mma.m16n8k128.row.col.s32.b1.b1.s32.and.popc` as
// stored (no unpacking); the activations are int16 codes per 128-element block (one f32 scale u
// per block: x ≈ u·a) given as 16 bit planes, which are the B columns: one MMA for planes 0..7, one
// for 8..15. For weight row r, activation row t and block b (c the code bits, sign 2c − 1):
//   Σ_k (2c_k − 1)·a_k = 2·Σ_p w_p·popc(W_rb AND P_tbp) − Σ_k a_k,
// w_p = 2^p for p < 15 and −2^15 for the sign plane. Lane (g, tg) holds the popcounts of planes
// 2tg, 2tg + 1, 8 + 2tg, 9 + 2tg for rows g and g + 8 and folds them with its own multipliers
// (2·w_p; lane tg also subtracts the code sum of sub-block tg, so the four lanes' integers add up
// to 2·Σ_p w_p·popc − Σa) into an exact int32, then keeps a float partial per row:
//   acc = fmaf(dw·u, (float)S, acc), blocks in increasing order.
// At the end the 4 lanes of a row are added as (tg0 + tg1) + (tg2 + tg3), then the KS K parts in
// order. Every activation row has its own MMAs and the same float operations, and KS is chosen
// from the shape alone (`mvbp_ks`), so row t of an n-row launch equals the one-row launch bit for
// bit. Measured as a prototype first (bench/micro/b1plane.cu, bench/results/
// cuda-b1plane-proto-27b-q1.json): 0.81× the dp4a kernels' time summed over a Q1_0 27B token at
// n = 1, 0.63× at n = 5, in one harness on the H200.
//
// Layouts (a segment's n_out a multiple of 16 and n_in a multiple of 256 — `Gpu::mv_b1p` checks):
//   codes  [n_out / 16][n_in / 256][32 lanes] uint4 {a0(b), a1(b), a0(b + 1), a1(b + 1)}, b = 2·pair:
//          a0 = code word tg (elements 32tg .. 32tg + 31, bit i = element 32tg + i) of row 16·tile + g
//          in block b, a1 = the same of row + 8.
//   scales [n_out / 16][n_in / 128][8] u32: f16 scale of row g (low half), row g + 8 (high half).
//   xp     [n][n_in / 256][32 lanes] uint4 {lo(b), hi(b), lo(b + 1), hi(b + 1)}: lo = plane g word
//          tg, hi = plane 8 + g word tg (plane p word tg: bit i = bit p of code 32tg + i).
//   xu     [n][n_in / 128] f32 block scales;  xs [n][n_in / 128][4] i32: the code sums of the
//          block's four 32-element sub-blocks.

__device__ __forceinline__ void mma_b1_k128(int* d, u32 a0, u32 a1, u32 b) {
    asm volatile(
        "mma.sync.aligned.m16n8k128.row.col.s32.b1.b1.s32.and.popc {%0,%1,%2,%3}, {%4,%5}, {%6}, "
        "{%7,%7,%7,%7};\n"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a0), "r"(a1), "r"(b), "r"(0));
}

// One block of one 16-row tile and one activation row: the folded sums of rows g and g + 8.
__device__ __forceinline__ void mvbp_fold(u32 a0, u32 a1, u32 blo, u32 bhi, int sa, const int* m, int& sg,
                                          int& sg8) {
    int c[4], e[4];
    mma_b1_k128(c, a0, a1, blo);
    mma_b1_k128(e, a0, a1, bhi);
    sg = c[0] * m[0] + c[1] * m[1] + e[0] * m[2] + e[1] * m[3] - sa;
    sg8 = c[2] * m[0] + c[3] * m[1] + e[2] * m[2] + e[3] * m[3] - sa;
}

// Block: RGW row tiles × KS K parts (warp w: part w % KS, tile w / KS). A warp walks its
// contiguous range of block pairs UNR pairs at a time, the next UNR pairs' weights and activations
// loaded before the current ones are used; with `pre` the first weights are loaded before the PDL
// wait (weights are never written on the device).
// SWI (KS = 1, RGW = 4, NT = 1; the SwiGLU-fused decode gate‖up launch): block c's warps 0, 1 take
// gate tiles 2c, 2c + 1 (s0) and warps 2, 3 the same up tiles (s1), each exactly as the plain
// launch computes them; then warp 0 writes SiLU(gate)·up of the block's 32 outputs as
// swiglu_quant does (f32 unless null, quant32), so the verify rows' mat-vec + swiglu_quant give
// the same bits.
// XS (one row): the block first copies the whole activation row (planes, sums, units: 2.1 bytes
// an element, the launcher sizes the dynamic shared memory with `mvbp_xs_bytes`) into shared
// memory after the PDL wait, and the warps read it from there; only the weights go through the
// register stages, so more of them fit in flight (UNR pairs) at the same register count. The
// float operations are the plain kernel's.
template <int NT, int KS, int RGW, int UNR, bool SWI = false, bool XS = false>
__device__ __forceinline__ void mvbp_q1(MvSeg s0, MvSeg s1, MvSeg s2, MvSeg s3, const uint4* __restrict__ xp,
                                        const float* __restrict__ xu, const int* __restrict__ xs, int n_in,
                                        int n, int accumulate, int pre, SwiOut so = {}) {
    static_assert(!SWI || (KS == 1 && RGW == 4 && NT == 1), "SWI: one K part, 4 tiles, one row");
    static_assert(!XS || NT == 1, "XS: one activation row");
    __shared__ float red[KS][RGW][16][NT];
    // XS: planes [n_in / 256][32] uint4, then sums [n_in / 128] uint4 (4 sub-blocks), units
    // [n_in / 128] f32
    extern __shared__ __align__(16) uint4 mvbp_xsm[];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, tg = lane & 3;
    const int kp = w % KS, rg = w / KS;
    // find the segment of this warp's tile (tiles never straddle two matrices)
    int tile = blockIdx.x * RGW + rg;
    const int t0 = s0.n_out >> 4, t1 = s1.n_out >> 4, t2 = s2.n_out >> 4, t3 = s3.n_out >> 4;
    MvSeg sg = s0;
    bool tile_ok = true;
    if (SWI) {
        sg = rg < 2 ? s0 : s1;
        tile = 2 * blockIdx.x + (rg & 1);
        tile_ok = tile < t0;
    } else if (tile < t0) {
        sg = s0;
    } else if ((tile -= t0) < t1) {
        sg = s1;
    } else if ((tile -= t1) < t2) {
        sg = s2;
    } else if ((tile -= t2) < t3) {
        sg = s3;
    } else {
        tile_ok = false;
    }
    const int nblk = n_in >> 7, npair = n_in >> 8;
    const int p0 = kp * npair / KS, p1 = (kp + 1) * npair / KS;
    const bool live = tile_ok && p0 < p1;  // a warp with no pairs still joins the block barrier
    const uint4* wa = (const uint4*)sg.codes + (size_t)(live ? tile : 0) * npair * 32 + lane;
    const u32* wd = (const u32*)sg.scales + (size_t)(live ? tile : 0) * nblk * 8 + g;
    // fold multipliers: 2·w_p of planes 2tg, 2tg + 1, 8 + 2tg, 9 + 2tg (plane 15 is the sign)
    int m[4];
    m[0] = 1 << (2 * tg + 1), m[1] = 1 << (2 * tg + 2), m[2] = 1 << (2 * tg + 9);
    m[3] = tg == 3 ? -(1 << 16) : (1 << (2 * tg + 10));
    float acc[2][NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[0][t] = acc[1][t] = 0.f;
    // stage registers for UNR pairs: weights, their scales, activation planes, scales and sums
    uint4 na[UNR], nb[UNR][NT];
    u32 nd[UNR][2];
    float2 nu[UNR][NT];
    int ns[UNR][NT][2];
    auto load_w = [&](int p) {
#pragma unroll
        for (int u = 0; u < UNR; ++u) {
            const int pp = min(p + u, p1 - 1);
            na[u] = __ldg(wa + (size_t)pp * 32);
            nd[u][0] = __ldg(wd + (size_t)(2 * pp) * 8);
            nd[u][1] = __ldg(wd + (size_t)(2 * pp + 1) * 8);
        }
    };
    const uint4* sxp = mvbp_xsm;
    const int* sxs = (const int*)(mvbp_xsm + npair * 32);
    const float2* sxu = (const float2*)(mvbp_xsm + npair * 32 + nblk);
    auto load_x = [&](int p) {
        if (XS) return;
#pragma unroll
        for (int u = 0; u < UNR; ++u) {
            const int pp = min(p + u, p1 - 1);
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                if (NT == 1 || t < n) {
                    nb[u][t] = __ldg(xp + ((size_t)t * npair + pp) * 32 + lane);
                    nu[u][t] = __ldg((const float2*)(xu + (size_t)t * nblk) + pp);
                    ns[u][t][0] = __ldg(xs + ((size_t)t * nblk + 2 * pp) * 4 + tg);
                    ns[u][t][1] = __ldg(xs + ((size_t)t * nblk + 2 * pp + 1) * 4 + tg);
                }
            }
        }
    };
    if (pre) {
        if (live) load_w(p0);
        PDL_ENTRY();
    } else {
        PDL_ENTRY();
        if (live) load_w(p0);
    }
    if (XS) {
        // the activation row into shared memory, by the whole block
        uint4* dxp = mvbp_xsm;
        for (int i = threadIdx.x; i < npair * 32; i += blockDim.x) cp_async16(dxp + i, xp + i);
        for (int i = threadIdx.x; i < nblk; i += blockDim.x) cp_async16(dxp + npair * 32 + i, (const uint4*)xs + i);
        cp_async_commit();
        float* dxu = (float*)(mvbp_xsm + npair * 32 + nblk);
        for (int i = threadIdx.x; i < nblk; i += blockDim.x) dxu[i] = __ldg(xu + i);
        cp_async_wait<0>();
        __syncthreads();
    }
    if (live) load_x(p0);
    for (int p = p0; live && p < p1; p += UNR) {
        uint4 ca[UNR], cb[UNR][NT];
        u32 cd[UNR][2];
        float2 cu[UNR][NT];
        int cs[UNR][NT][2];
#pragma unroll
        for (int u = 0; u < UNR; ++u) {
            ca[u] = na[u], cd[u][0] = nd[u][0], cd[u][1] = nd[u][1];
            if (XS) continue;  // read where they are used, below
#pragma unroll
            for (int t = 0; t < NT; ++t) cb[u][t] = nb[u][t], cu[u][t] = nu[u][t], cs[u][t][0] = ns[u][t][0], cs[u][t][1] = ns[u][t][1];
        }
        if (p + UNR < p1) {
            load_w(p + UNR);
            load_x(p + UNR);
        }
#pragma unroll
        for (int u = 0; u < UNR; ++u) {
            if (p + u < p1) {
                if (XS) {
                    const int pp = p + u;
                    cb[u][0] = sxp[pp * 32 + lane];
                    cu[u][0] = sxu[pp];
                    cs[u][0][0] = sxs[(2 * pp) * 4 + tg];
                    cs[u][0][1] = sxs[(2 * pp + 1) * 4 + tg];
                }
                const float d00 = h2f((u16)(cd[u][0] & 0xffffu)), d01 = h2f((u16)(cd[u][0] >> 16));
                const float d10 = h2f((u16)(cd[u][1] & 0xffffu)), d11 = h2f((u16)(cd[u][1] >> 16));
#pragma unroll
                for (int t = 0; t < NT; ++t) {
                    if (NT == 1 || t < n) {
                        int s0_, s08, s1_, s18;
                        mvbp_fold(ca[u].x, ca[u].y, cb[u][t].x, cb[u][t].y, cs[u][t][0], m, s0_, s08);
                        mvbp_fold(ca[u].z, ca[u].w, cb[u][t].z, cb[u][t].w, cs[u][t][1], m, s1_, s18);
                        acc[0][t] = fmaf(d00 * cu[u][t].x, (float)s0_, acc[0][t]);
                        acc[1][t] = fmaf(d01 * cu[u][t].x, (float)s08, acc[1][t]);
                        acc[0][t] = fmaf(d10 * cu[u][t].y, (float)s1_, acc[0][t]);
                        acc[1][t] = fmaf(d11 * cu[u][t].y, (float)s18, acc[1][t]);
                    }
                }
            }
        }
    }
    // the 4 lanes of a row: (tg0 + tg1) + (tg2 + tg3); then the K parts in order
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            float v = acc[h][t];
            v += __shfl_xor_sync(0xffffffffu, v, 1);
            v += __shfl_xor_sync(0xffffffffu, v, 2);
            if (SWI) {
                if (tg == 0) red[0][rg][h * 8 + g][0] = v;
            } else if (KS == 1) {
                if (tile_ok && tg == 0 && (NT == 1 || t < n)) {
                    float* yp = sg.y + (size_t)t * sg.n_out + tile * 16 + h * 8 + g;
                    *yp = accumulate ? *yp + v : v;
                }
            } else if (tg == 0) {
                red[kp][rg][h * 8 + g][t] = v;
            }
        }
    if (SWI) {
        __syncthreads();
        const int o = 32 * blockIdx.x + lane;
        if (w == 0 && 32 * blockIdx.x < s0.n_out) {
            const float gv = red[0][lane >> 4][lane & 15][0], uv = red[0][2 + (lane >> 4)][lane & 15][0];
            const float v = siluf_(gv) * uv;
            if (so.hf) so.hf[o] = v;
            quant32(v, so.q + (size_t)blockIdx.x * 32, so.d + blockIdx.x, so.s + blockIdx.x);
        }
    } else if (KS > 1) {
        __syncthreads();
        // warp kp == 0 of each tile writes its 16 rows: lane = row (16 lanes), all n columns
        if (kp == 0 && tile_ok && lane < 16) {
            for (int t = 0; t < n; ++t) {
                float v = red[0][rg][lane][t];
#pragma unroll
                for (int k2 = 1; k2 < KS; ++k2) v += red[k2][rg][lane][t];
                float* yp = sg.y + (size_t)t * sg.n_out + tile * 16 + lane;
                *yp = accumulate ? *yp + v : v;
            }
        }
    }
}

#define MVBP_ENTRY(NAME, NT, KS, RGW, UNR, MINB)                                                \
    MV_SEG_ENTRY(NAME, (KS) * (RGW), MINB, const uint4*, xp,                                    \
                 mvbp_q1<NT, KS, RGW, UNR>(s0, s1, s2, s3, xp, da, sa, n_in, n, accumulate, pre))
// Variants: `_n1` decode, `_n5` verify (n <= 5); `_kKS` the K split (4 warps per block up to
// KS = 4, then KS warps). Measured on the H200 (Q1_0 decode graph, alternating builds): two
// pairs per stage and no register cap (96 registers) 2.593 ms/token; one pair per stage (66
// registers) 3.004; four (154 registers) 2.826; two with the one-row kernels capped at 80
// registers (6 blocks of 4 warps per SM) 2.686. The launcher's table is `Gpu::mvbp_func`.
// 5 blocks of 4 warps per SM for the one-row kernels of 4 warps (at most 102 registers, so 96
// allocated): left alone the compiler takes some of them to 98 (104 allocated, 4 blocks per SM).
#define MVBP_N1_MINB 5
MVBP_ENTRY(mvbp_q1_n1_k1, 1, 1, 4, 2, MVBP_N1_MINB)
MVBP_ENTRY(mvbp_q1_n1_k2, 1, 2, 2, 2, MVBP_N1_MINB)
MVBP_ENTRY(mvbp_q1_n1_k4, 1, 4, 1, 2, MVBP_N1_MINB)
MVBP_ENTRY(mvbp_q1_n1_k8, 1, 8, 1, 2, 1)
MVBP_ENTRY(mvbp_q1_n1_k16, 1, 16, 1, 1, 1)
// `_n1x`: the one-row kernels with the activation row in shared memory (XS) and 4 pairs of
// weights in flight per warp at the same register count (the launcher's default; `Gpu::b1p_xs`).
// Q1_0 decode graph on the H200, same process, alternating: 2.573 ms/token with `_n1` → 2.474
// (bench/results/cuda-b1p-xs-27b-q1.json; carveouts of 58 and 100 % for every kernel: 2.481,
// 2.641). Measured and not kept there too (cuda-b1p-stage-27b-q1.json, branch
// exp/b1p-smem-stage): each warp's weights copied into shared memory before the PDL wait, with
// or without a norm that lets this kernel be scheduled early — 2.78 to 3.08 ms/token: weight
// traffic during the latency-bound kernels ahead lengthens them more than it saves.
#define MVBP_X_UNR 4
#define MVBP_X_ENTRY(NAME, KS, RGW)                                                             \
    MV_SEG_ENTRY(NAME, (KS) * (RGW), (KS) * (RGW) == 4 ? MVBP_N1_MINB : 1, const uint4*, xp,        \
                 mvbp_q1<1, KS, RGW, MVBP_X_UNR, false, true>(s0, s1, s2, s3, xp, da, sa, n_in, n, \
                                                              accumulate, pre))
MVBP_X_ENTRY(mvbp_q1_n1x_k1, 1, 4)
MVBP_X_ENTRY(mvbp_q1_n1x_k2, 2, 2)
MVBP_X_ENTRY(mvbp_q1_n1x_k4, 4, 1)
MVBP_X_ENTRY(mvbp_q1_n1x_k8, 8, 1)
MVBP_X_ENTRY(mvbp_q1_n1x_k16, 16, 1)
MVBP_ENTRY(mvbp_q1_n5_k1, 5, 1, 4, 1, 1)
MVBP_ENTRY(mvbp_q1_n5_k2, 5, 2, 2, 1, 1)
MVBP_ENTRY(mvbp_q1_n5_k4, 5, 4, 1, 1, 1)
MVBP_ENTRY(mvbp_q1_n5_k8, 5, 8, 1, 1, 1)
MVBP_ENTRY(mvbp_q1_n5_k16, 5, 16, 1, 1, 1)

// The SwiGLU-fused decode gate‖up launch on b1-planes (grid n_out / 32, 128 threads; the
// parameter list of MV_SWI_ENTRY with the b1-plane activations in place of q, d, s).
extern "C" __global__ void __launch_bounds__(128) mvbp_q1_n1_k1_swi(const void* c0, const u16* sc0, const void* c1,
                                                                   const u16* sc1, int n_out, const uint4* xp,
                                                                   const float* xu, const int* xs, int n_in,
                                                                   int pre, float* hf, i8* hq, float* hd, int* hs) {
    MvSeg g0 = {c0, sc0, nullptr, n_out}, u0 = {c1, sc1, nullptr, n_out}, none = {nullptr, nullptr, nullptr, 0};
    mvbp_q1<1, 1, 4, 2, true>(g0, u0, none, none, xp, xu, xs, n_in, 1, 0, pre, SwiOut{hf, hq, hd, hs});
}
// The same with the activation row in shared memory (XS).
extern "C" __global__ void __launch_bounds__(128) mvbp_q1_n1x_k1_swi(const void* c0, const u16* sc0, const void* c1,
                                                                    const u16* sc1, int n_out, const uint4* xp,
                                                                    const float* xu, const int* xs, int n_in,
                                                                    int pre, float* hf, i8* hq, float* hd, int* hs) {
    MvSeg g0 = {c0, sc0, nullptr, n_out}, u0 = {c1, sc1, nullptr, n_out}, none = {nullptr, nullptr, nullptr, 0};
    mvbp_q1<1, 1, 4, MVBP_X_UNR, true, true>(g0, u0, none, none, xp, xu, xs, n_in, 1, 0, pre,
                                             SwiOut{hf, hq, hd, hs});
}
