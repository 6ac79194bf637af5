// ---- b1-plane Q1_0 / Q2_0 mat-vec (`mvbp_q1_*`, `mvbp_q2_*`, n <= 5 rows) -------------------------
// The Q1_0 code words are the A fragments of `mma.m16n8k128.row.col.s32.b1.b1.s32.and.popc` as
// stored (no unpacking); the activations are int16 codes per 128-element block (one f32 scale u
// per block: x ≈ u·a) given as 16 bit planes, which are the B columns: one MMA for planes 0..7, one
// for 8..15. For weight row r, activation row t and block b (c the code bits, sign 2c − 1):
//   Σ_k (2c_k − 1)·a_k = 2·Σ_p w_p·popc(W_rb AND P_tbp) − Σ_k a_k,
// w_p = 2^p for p < 15 and −2^15 for the sign plane. Lane (g, tg) holds the popcounts of planes
// 2tg, 2tg + 1, 8 + 2tg, 9 + 2tg for rows g and g + 8 and folds them with its own multipliers
// (2·w_p; lane tg also subtracts the code sum of sub-block tg, so the four lanes' integers add up
// to 2·Σ_p w_p·popc − Σa) into an exact int32. The four lanes' integers are then added with
// shuffles (`mvbp_lane_sum`), so every lane holds the block's exact S of one row (g + 8·(tg & 1)),
// and keeps one float partial for it:
//   acc = fmaf(dw·u, (float)S, acc), blocks in increasing order,
// then the KS K parts are added in order. The float operations see only exact block integers, so
// any exact way of computing S gives the same bits: the int8 tensor-core verify kernel below
// (`mvbq_q1_*`) computes it for up to 8 activation rows at once. Every activation row of these
// kernels has its own MMAs and the same float operations, and KS is chosen from the shape alone
// (`mvbp_ks`), so row t of an n-row launch equals the one-row launch bit for bit. Measured as a
// prototype first (bench/micro/b1plane.cu, bench/results/cuda-b1plane-proto-27b-q1.json): 0.81×
// the dp4a kernels' time summed over a Q1_0 27B token at n = 1, 0.63× at n = 5, in one harness on
// the H200.
//
// Layouts (a segment's n_out a multiple of 16 and n_in a multiple of 256 — `Gpu::mv_b1p` checks):
//   codes  [n_out / 16][n_in / 256][32 lanes] uint4 {a0(b), a1(b), a0(b + 1), a1(b + 1)}, b = 2·pair:
//          a0 = code word tg (elements 32tg .. 32tg + 31, bit i = element 32tg + i) of row 16·tile + g
//          in block b, a1 = the same of row + 8.
//          Q2_0 g128 / PQ2_0 (`mvbp_q2_*`, `mvbq_q2_*`): [n_out / 16][n_in / 256][2 planes][32 lanes]
//          uint4, the same words of code bit plane 0 (c & 1), then of plane 1 (c >> 1).
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

// The same for Q2_0 (`PL` = 2 code planes: c = c0 + 2·c1, weight (c − 1)·d): plane 0 (a0, a1) and
// plane 1 (v0, v1) each meet both activation MMAs, and
//   Σ_k (c_k − 1)·a_k = Σ_p w_p·(popc(C0 AND P_p) + 2·popc(C1 AND P_p)) − Σ_k a_k,
// so plane 0 folds with w_p (`mh`, half of Q1_0's multipliers) and plane 1 with 2·w_p (`m`).
__device__ __forceinline__ void mvbp_fold_q2(u32 a0, u32 a1, u32 v0, u32 v1, u32 blo, u32 bhi, int sa, const int* mh,
                                             const int* m, int& sg, int& sg8) {
    int c[4], e[4], c2[4], e2[4];
    mma_b1_k128(c, a0, a1, blo);
    mma_b1_k128(e, a0, a1, bhi);
    mma_b1_k128(c2, v0, v1, blo);
    mma_b1_k128(e2, v0, v1, bhi);
    sg = c[0] * mh[0] + c[1] * mh[1] + e[0] * mh[2] + e[1] * mh[3] + c2[0] * m[0] + c2[1] * m[1] + e2[0] * m[2] +
         e2[1] * m[3] - sa;
    sg8 = c[2] * mh[0] + c[3] * mh[1] + e[2] * mh[2] + e[3] * mh[3] + c2[2] * m[0] + c2[3] * m[1] + e2[2] * m[2] +
          e2[3] * m[3] - sa;
}

// The exact block sum S of the row this lane keeps (g + 8·odd) from the four lanes' partials of
// rows g (sg) and g + 8 (sg8): each lane sends its pair lane (tg ^ 1) the row that lane keeps, then
// the two halves are added across tg ^ 2. Integer adds, so any order gives the same S.
__device__ __forceinline__ int mvbp_lane_sum(int sg, int sg8, int odd) {
    const int keep = odd ? sg8 : sg, send = odd ? sg : sg8;
    int v = keep + __shfl_xor_sync(0xffffffffu, send, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
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
// PL: code planes, 1 for Q1_0, 2 for Q2_0 g128 / PQ2_0 (the codes of a pair are then plane 0's
// 32 uint4 followed by plane 1's; see the layout above).
template <int NT, int KS, int RGW, int UNR, bool SWI = false, bool XS = false, bool SWP = false, int PL = 1>
__device__ __forceinline__ void mvbp_mv(MvSeg s0, MvSeg s1, MvSeg s2, MvSeg s3, const uint4* __restrict__ xp,
                                        const float* __restrict__ xu, const int* __restrict__ xs, int n_in,
                                        int n, int accumulate, int pre, SwiOut so = {}) {
    static_assert(!SWI || (KS == 1 && RGW == 4 && NT == 1), "SWI: one K part, 4 tiles, one row");
    static_assert(!XS || NT == 1, "XS: one activation row");
    static_assert(!SWP || SWI, "SWP: the SwiGLU output as b1-plane activations");
    static_assert(PL == 1 || PL == 2, "one (Q1_0) or two (Q2_0) code planes");
    __shared__ float red[KS][RGW][16][NT];
    __shared__ float swamx;  // SWP: this block's max |SiLU(gate)·up| (read by the cluster's blocks)
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
    const uint4* wa = (const uint4*)sg.codes + (size_t)(live ? tile : 0) * npair * 32 * PL + lane;
    const u32* wd = (const u32*)sg.scales + (size_t)(live ? tile : 0) * nblk * 8 + g;
    // fold multipliers: 2·w_p of planes 2tg, 2tg + 1, 8 + 2tg, 9 + 2tg (plane 15 is the sign);
    // Q2_0's plane 0 takes w_p (mh)
    int m[4], mh[4];
    m[0] = 1 << (2 * tg + 1), m[1] = 1 << (2 * tg + 2), m[2] = 1 << (2 * tg + 9);
    m[3] = tg == 3 ? -(1 << 16) : (1 << (2 * tg + 10));
#pragma unroll
    for (int i = 0; i < 4; ++i) mh[i] = m[i] / 2;
    const int odd = tg & 1;
    float acc[NT];  // row g + 8·odd, activation row t
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[t] = 0.f;
    // stage registers for UNR pairs: weights, their scales, activation planes, scales and sums
    uint4 na[UNR][PL], nb[UNR][NT];
    u32 nd[UNR][2];
    float2 nu[UNR][NT];
    int ns[UNR][NT][2];
    auto load_w = [&](int p) {
#pragma unroll
        for (int u = 0; u < UNR; ++u) {
            const int pp = min(p + u, p1 - 1);
#pragma unroll
            for (int q = 0; q < PL; ++q) na[u][q] = __ldg(wa + ((size_t)pp * PL + q) * 32);
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
        uint4 ca[UNR][PL], cb[UNR][NT];
        u32 cd[UNR][2];
        float2 cu[UNR][NT];
        int cs[UNR][NT][2];
#pragma unroll
        for (int u = 0; u < UNR; ++u) {
#pragma unroll
            for (int q = 0; q < PL; ++q) ca[u][q] = na[u][q];
            cd[u][0] = nd[u][0], cd[u][1] = nd[u][1];
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
                // this lane's row: g + 8·odd; its half of each block's scale word
                const float da = h2f((u16)(cd[u][0] >> (16 * odd))), db = h2f((u16)(cd[u][1] >> (16 * odd)));
#pragma unroll
                for (int t = 0; t < NT; ++t) {
                    if (NT == 1 || t < n) {
                        int s0_, s08, s1_, s18;
                        const uint4 a = ca[u][0], v = ca[u][PL - 1];
                        if (PL == 1) {
                            mvbp_fold(a.x, a.y, cb[u][t].x, cb[u][t].y, cs[u][t][0], m, s0_, s08);
                            mvbp_fold(a.z, a.w, cb[u][t].z, cb[u][t].w, cs[u][t][1], m, s1_, s18);
                        } else {
                            mvbp_fold_q2(a.x, a.y, v.x, v.y, cb[u][t].x, cb[u][t].y, cs[u][t][0], mh, m, s0_, s08);
                            mvbp_fold_q2(a.z, a.w, v.z, v.w, cb[u][t].z, cb[u][t].w, cs[u][t][1], mh, m, s1_, s18);
                        }
                        const int S0 = mvbp_lane_sum(s0_, s08, odd), S1 = mvbp_lane_sum(s1_, s18, odd);
                        acc[t] = fmaf(da * cu[u][t].x, (float)S0, acc[t]);
                        acc[t] = fmaf(db * cu[u][t].y, (float)S1, acc[t]);
                    }
                }
            }
        }
    }
    // lanes tg = 0, 1 hold rows g, g + 8 (tg = 2, 3 the same values); then the K parts in order
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        const float v = acc[t];
        if (tg >= 2) continue;
        if (SWI) {
            red[0][rg][tg * 8 + g][0] = v;
        } else if (KS == 1) {
            if (tile_ok && (NT == 1 || t < n)) {
                float* yp = sg.y + (size_t)t * sg.n_out + tile * 16 + tg * 8 + g;
                *yp = accumulate ? *yp + v : v;
            }
        } else {
            red[kp][rg][tg * 8 + g][t] = v;
        }
    }
    if (SWP) {
        // the cluster's 4 blocks hold the 128-element block blockIdx.x / 4 of the output, block
        // rank blockIdx.x % 4 its sub-block: the 4 maxima through distributed shared memory,
        // then swiglu_quant_p16's arithmetic on the same amax (the launcher: n_out % 256 == 0)
        __syncthreads();
        float v = 0.f;
        if (w == 0) {
            const float gv = red[0][lane >> 4][lane & 15][0], uv = red[0][2 + (lane >> 4)][lane & 15][0];
            v = siluf_(gv) * uv;
            if (so.hf) so.hf[32 * blockIdx.x + lane] = v;
            const float am = warp_max(fabsf(v));
            if (lane == 0) swamx = am;
        }
        cluster_sync_all();
        if (w == 0) {
            const float amax = fmaxf(fmaxf(ld_cluster_f32(&swamx, 0), ld_cluster_f32(&swamx, 1)),
                                     fmaxf(ld_cluster_f32(&swamx, 2), ld_cluster_f32(&swamx, 3)));
            quant_p16_store(v, amax, blockIdx.x >> 2, blockIdx.x & 3, so.p.xp, so.p.xu, so.p.xs, so.p.xv);
        }
        cluster_sync_relaxed();  // no block leaves while a peer may still read its swamx
    } else if (SWI) {
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

#define MVBP_ENTRY(NAME, NT, KS, RGW, UNR, MINB, PL)                                                \
    MV_SEG_ENTRY(NAME, (KS) * (RGW), MINB, const uint4*, xp,                                        \
                 mvbp_mv<NT, KS, RGW, UNR, false, false, false, PL>(s0, s1, s2, s3, xp, da, sa, n_in, n, \
                                                                    accumulate, pre))
// Variants: `_n1` decode, `_n5` verify (n <= 5); `_kKS` the K split (4 warps per block up to
// KS = 4, then KS warps). Measured on the H200 (Q1_0 decode graph, alternating builds): two
// pairs per stage and no register cap (96 registers) 2.593 ms/token; one pair per stage (66
// registers) 3.004; four (154 registers) 2.826; two with the one-row kernels capped at 80
// registers (6 blocks of 4 warps per SM) 2.686. The launcher's table is `Gpu::mvbp_func`.
// 5 blocks of 4 warps per SM for the one-row kernels of 4 warps (at most 102 registers, so 96
// allocated): left alone the compiler takes some of them to 98 (104 allocated, 4 blocks per SM).
#define MVBP_N1_MINB 5
MVBP_ENTRY(mvbp_q1_n1_k1, 1, 1, 4, 2, MVBP_N1_MINB, 1)
MVBP_ENTRY(mvbp_q1_n1_k2, 1, 2, 2, 2, MVBP_N1_MINB, 1)
MVBP_ENTRY(mvbp_q1_n1_k4, 1, 4, 1, 2, MVBP_N1_MINB, 1)
MVBP_ENTRY(mvbp_q1_n1_k8, 1, 8, 1, 2, 1, 1)
MVBP_ENTRY(mvbp_q1_n1_k16, 1, 16, 1, 1, 1, 1)
// `_n1x`: the one-row kernels with the activation row in shared memory (XS) and 4 pairs of
// weights in flight per warp at the same register count (the launcher's default; `Gpu::b1p_xs`).
// Q1_0 decode graph on the H200, same process, alternating: 2.573 ms/token with `_n1` → 2.474
// (bench/results/cuda-b1p-xs-27b-q1.json; carveouts of 58 and 100 % for every kernel: 2.481,
// 2.641). Measured and not kept there too (cuda-b1p-stage-27b-q1.json, branch
// exp/b1p-smem-stage): each warp's weights copied into shared memory before the PDL wait, with
// or without a norm that lets this kernel be scheduled early — 2.78 to 3.08 ms/token: weight
// traffic during the latency-bound kernels ahead lengthens them more than it saves.
#define MVBP_X_UNR 4
#define MVBP_X_ENTRY(NAME, KS, RGW, UNR, PL)                                                    \
    MV_SEG_ENTRY(NAME, (KS) * (RGW), (KS) * (RGW) == 4 ? MVBP_N1_MINB : 1, const uint4*, xp,        \
                 mvbp_mv<1, KS, RGW, UNR, false, true, false, PL>(s0, s1, s2, s3, xp, da, sa, n_in, n, \
                                                                  accumulate, pre))
MVBP_X_ENTRY(mvbp_q1_n1x_k1, 1, 4, MVBP_X_UNR, 1)
MVBP_X_ENTRY(mvbp_q1_n1x_k2, 2, 2, MVBP_X_UNR, 1)
MVBP_X_ENTRY(mvbp_q1_n1x_k4, 4, 1, MVBP_X_UNR, 1)
MVBP_X_ENTRY(mvbp_q1_n1x_k8, 8, 1, MVBP_X_UNR, 1)
MVBP_X_ENTRY(mvbp_q1_n1x_k16, 16, 1, MVBP_X_UNR, 1)
MVBP_ENTRY(mvbp_q1_n5_k1, 5, 1, 4, 1, 1, 1)
MVBP_ENTRY(mvbp_q1_n5_k2, 5, 2, 2, 1, 1, 1)
MVBP_ENTRY(mvbp_q1_n5_k4, 5, 4, 1, 1, 1, 1)
MVBP_ENTRY(mvbp_q1_n5_k8, 5, 8, 1, 1, 1, 1)
MVBP_ENTRY(mvbp_q1_n5_k16, 5, 16, 1, 1, 1, 1)
// Q2_0 g128 / PQ2_0 (two code planes): the same launches with half the pairs per stage, so a
// warp has as many weight bytes in flight as the Q1_0 kernels.
MVBP_ENTRY(mvbp_q2_n1_k1, 1, 1, 4, 1, MVBP_N1_MINB, 2)
MVBP_ENTRY(mvbp_q2_n1_k2, 1, 2, 2, 1, MVBP_N1_MINB, 2)
MVBP_ENTRY(mvbp_q2_n1_k4, 1, 4, 1, 1, MVBP_N1_MINB, 2)
MVBP_ENTRY(mvbp_q2_n1_k8, 1, 8, 1, 1, 1, 2)
MVBP_ENTRY(mvbp_q2_n1_k16, 1, 16, 1, 1, 1, 2)
#define MVBP_X_UNR_Q2 2
MVBP_X_ENTRY(mvbp_q2_n1x_k1, 1, 4, MVBP_X_UNR_Q2, 2)
MVBP_X_ENTRY(mvbp_q2_n1x_k2, 2, 2, MVBP_X_UNR_Q2, 2)
MVBP_X_ENTRY(mvbp_q2_n1x_k4, 4, 1, MVBP_X_UNR_Q2, 2)
MVBP_X_ENTRY(mvbp_q2_n1x_k8, 8, 1, MVBP_X_UNR_Q2, 2)
MVBP_X_ENTRY(mvbp_q2_n1x_k16, 16, 1, MVBP_X_UNR_Q2, 2)
MVBP_ENTRY(mvbp_q2_n5_k1, 5, 1, 4, 1, 1, 2)
MVBP_ENTRY(mvbp_q2_n5_k2, 5, 2, 2, 1, 1, 2)
MVBP_ENTRY(mvbp_q2_n5_k4, 5, 4, 1, 1, 1, 2)
MVBP_ENTRY(mvbp_q2_n5_k8, 5, 8, 1, 1, 1, 2)
MVBP_ENTRY(mvbp_q2_n5_k16, 5, 16, 1, 1, 1, 2)

// The SwiGLU-fused decode gate‖up launch on b1-planes (grid n_out / 32, 128 threads; the
// parameter list of MV_SWI_ENTRY with the b1-plane activations in place of q, d, s): UNR pairs
// per stage, XS the activation row in shared memory, PL code planes.
#define MVBP_SWI_ENTRY(NAME, UNR, XS, PL)                                                                  \
    extern "C" __global__ void __launch_bounds__(128)                                                      \
        NAME(const void* c0, const u16* sc0, const void* c1, const u16* sc1, int n_out, const uint4* xp,   \
             const float* xu, const int* xs, int n_in, int pre, float* hf, i8* hq, float* hd, int* hs) {   \
        MvSeg g0 = {c0, sc0, nullptr, n_out}, u0 = {c1, sc1, nullptr, n_out},                             \
              none = {nullptr, nullptr, nullptr, 0};                                                       \
        mvbp_mv<1, 1, 4, UNR, true, XS, false, PL>(g0, u0, none, none, xp, xu, xs, n_in, 1, 0, pre,        \
                                                   SwiOut{hf, hq, hd, hs, {}});                            \
    }
MVBP_SWI_ENTRY(mvbp_q1_n1_k1_swi, 2, false, 1)
MVBP_SWI_ENTRY(mvbp_q1_n1x_k1_swi, MVBP_X_UNR, true, 1)
MVBP_SWI_ENTRY(mvbp_q2_n1_k1_swi, 1, false, 2)
MVBP_SWI_ENTRY(mvbp_q2_n1x_k1_swi, MVBP_X_UNR_Q2, true, 2)
// The XS launch writing the SwiGLU as b1-plane activations (xp, xu, xs, xv: P16Out's layout, one
// row): the input of the b1-plane ffn_down. A cluster of 4 blocks per 128 outputs.
#define MVBP_SWP_ENTRY(NAME, UNR, PL)                                                                      \
    extern "C" __global__ void CLUSTER_DIMS(4, 1, 1) __launch_bounds__(128)                                \
        NAME(const void* c0, const u16* sc0, const void* c1, const u16* sc1, int n_out, const uint4* xp,   \
             const float* xu, const int* xs, int n_in, int pre, float* hf, u32* op, float* ou, int* os,    \
             u8* ov) {                                                                                     \
        MvSeg g0 = {c0, sc0, nullptr, n_out}, u0 = {c1, sc1, nullptr, n_out},                             \
              none = {nullptr, nullptr, nullptr, 0};                                                       \
        mvbp_mv<1, 1, 4, UNR, true, true, true, PL>(g0, u0, none, none, xp, xu, xs, n_in, 1, 0, pre,       \
                                                    SwiOut{hf, nullptr, nullptr, nullptr, P16Out{op, ou, os, ov}}); \
    }
MVBP_SWP_ENTRY(mvbp_q1_n1x_k1_swi_p16, MVBP_X_UNR, 1)
MVBP_SWP_ENTRY(mvbp_q2_n1x_k1_swi_p16, MVBP_X_UNR_Q2, 2)

// ---- int8 tensor-core verify on the b1-plane layout (`mvbq_q1_*`, n <= 8 rows) -----------------
// The same weights (the b1-plane tiles above) and the same int16 activation codes, but the
// activation rows are the 8 columns of `mma.m16n8k32` instead of each row having its own MMAs.
// Thread (g, tg) holds code word tg of rows g and g + 8 (elements 32tg .. 32tg + 31 of the block);
// in k-step j its A registers are (word >> i) & 0x01010101 for i = 2j (k 4tg .. 4tg + 3) and
// i = 2j + 1 (k 16 + 4tg ..): bytes c ∈ {0, 1} of elements 32tg + i + 8m, m = 0..3. The activations
// come in the same element order (`xv`, written by the norm): each code a = 256·hi + lo split into
// a signed high byte (`u8.s8` MMA) and an unsigned low byte (`u8.u8` MMA), so per block
//   Σ_k c_k·a_k = 256·Chi + Clo,  S = 2·(256·Chi + Clo) − Σ_k a_k,
// exact in int32 and the same S as the b1-plane kernels' lane sum. Then the b1-plane kernels'
// float operations: acc = fmaf(d·u, (float)S, acc) over the K part's blocks in increasing order,
// then the K parts in order (`mvbp_ks` of the shape). So row t of this launch equals the one-row
// b1-plane launch of that row bit for bit.
// xv layout: [n][n_in / 128][4 quarters {hi(j 0, 1), lo(j 0, 1), hi(j 2, 3), lo(j 2, 3)}][4
// sub-blocks tg] uint4; within a sub-block's 16 bytes, byte 8·(j & 1) + 4h + m is element
// 2j + h + 8m of the sub-block (h = 0: the b0 register, k 4tg + m; h = 1: b1, k 16 + 4tg + m). So
// each of a lane's four loads of a block reads, over the warp, 64 contiguous bytes per activation
// row (the sub-block-major order before 2026-12-06 spread them over four 64-byte chunks: twice the
// L1 sectors per load).
__device__ __forceinline__ void mma_u8s8_k32(int* d, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma_u8u8_k32(int* d, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.u8.u8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Weight loads that do not allocate in L1 (the AHEAD form of the verify below): each weight word
// is read once per launch, so caching it in L1 only evicts the activation rows, which every warp
// of the SM reads again for each block. The same values as __ldg.
__device__ __forceinline__ uint4 ldg_na_u4(const uint4* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}
__device__ __forceinline__ u32 ldg_na_u32(const u32* p) {
    u32 v;
    asm("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}

// Block: RGW tile groups × KS K parts (warp w: part w % KS, group w / KS); a group is R
// consecutive 16-row tiles, which share each block's activation loads. The weights of the next
// block pair are loaded while the current one is used.
// PL = 2 (Q2_0): the A bytes are the codes c = c0 + 2·c1 ∈ 0..3 built from both planes' words,
// and S = 256·Chi + Clo − Σ_k a_k (the weight is c − 1), the b1-plane kernels' exact block sum.
// AHEAD (`_r2a`, the default; `Gpu::b1q_ahead`): each block's activation B fragments, code sums
// and units are loaded one block ahead of their use, so the MMAs of block b no longer wait on an
// L1 / L2 round trip for them, and the weights and scales are loaded without allocating in L1
// (ldg_na_*), so they do not evict the activation rows. The same values and float operations, so
// the same bits. 27B rejected round on an H100, alternating in one process: Q1_0 6.56–6.71 →
// 6.32–6.36 ms, Q2_0 7.78–7.91 → 7.36–7.46 (bench/results/cuda-h100-verify-loads-ab*-27b-*.json:
// the no-allocate loads alone gave 6.57 / 7.63–7.72; the activations a pair ahead, the weights two
// pairs ahead, or both, took 146–242 registers and were slower than AHEAD, 6.43–7.54 / 8.0–8.2).
template <int KS, int RGW, int R, int PL = 1, bool AHEAD = false>
__device__ __forceinline__ void mvbq_mv(MvSeg s0, MvSeg s1, MvSeg s2, MvSeg s3, const uint4* __restrict__ xv,
                                        const float* __restrict__ xu, const int* __restrict__ xs, int n_in,
                                        int n, int accumulate, int pre) {
    __shared__ float red[KS][KS > 1 ? RGW * R : 1][16][MAXN];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, tg = lane & 3;
    const int kp = w % KS, rg = w / KS;
    const int t1 = s0.n_out >> 4, t2 = t1 + (s1.n_out >> 4), t3 = t2 + (s2.n_out >> 4), t4 = t3 + (s3.n_out >> 4);
    MvSeg sg[R];
    int tl[R];
    bool ok[R];
    bool any = false;
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int tile = (blockIdx.x * RGW + rg) * R + r;
        ok[r] = tile < t4;
        // a tile past the last segment reads tile 0 of segment 0 (and writes nothing)
        sg[r] = !ok[r] || tile < t1 ? s0 : tile < t2 ? s1 : tile < t3 ? s2 : s3;
        tl[r] = !ok[r] ? 0 : tile - (tile < t1 ? 0 : tile < t2 ? t1 : tile < t3 ? t2 : t3);
        any |= ok[r];
    }
    const int nblk = n_in >> 7, npair = n_in >> 8;
    const int p0 = kp * npair / KS, p1 = (kp + 1) * npair / KS;
    const bool live = any && p0 < p1;
    const uint4* wa[R];
    const u32* wd[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        wa[r] = (const uint4*)sg[r].codes + (size_t)tl[r] * npair * 32 * PL + lane;
        wd[r] = (const u32*)sg[r].scales + (size_t)tl[r] * nblk * 8 + g;
    }
    // this lane's B column (activation row g) and its two C columns 2tg, 2tg + 1
    const bool bok = g < n, cok0 = 2 * tg < n, cok1 = 2 * tg + 1 < n;
    const uint4* xb = xv + (size_t)(bok ? g : 0) * nblk * 16 + tg;
    const int c0 = cok0 ? 2 * tg : 0, c1 = cok1 ? 2 * tg + 1 : 0;
    float acc[R][4];  // rows g, g, g + 8, g + 8 × columns 2tg, 2tg + 1, 2tg, 2tg + 1
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = 0.f;
    uint4 na[R][PL];
    u32 nd[R][2];
    auto load_w = [&](int p) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
#pragma unroll
            for (int q = 0; q < PL; ++q) {
                const uint4* a = wa[r] + ((size_t)p * PL + q) * 32;
                na[r][q] = AHEAD ? ldg_na_u4(a) : __ldg(a);
            }
            const u32 *d0 = wd[r] + (size_t)(2 * p) * 8, *d1 = wd[r] + (size_t)(2 * p + 1) * 8;
            nd[r][0] = AHEAD ? ldg_na_u32(d0) : __ldg(d0);
            nd[r][1] = AHEAD ? ldg_na_u32(d1) : __ldg(d1);
        }
    };
    if (pre) {
        if (live) load_w(p0);
        PDL_ENTRY();
    } else {
        PDL_ENTRY();
        if (live) load_w(p0);
    }
    const u32 M = 0x01010101u;
    // one block's activation operands: B fragments (hi, lo bytes of j 0..3), the two C columns'
    // code sums (negated) and units
    struct Act {
        uint4 bh01, bl01, bh23, bl23;
        int na0, na1;
        float u0, u1;
    };
    auto load_act = [&](int blk) {
        Act a;
        a.bh01 = a.bl01 = a.bh23 = a.bl23 = make_uint4(0u, 0u, 0u, 0u);
        if (bok) {
            const uint4* b = xb + (size_t)blk * 16;
            a.bh01 = __ldg(b), a.bl01 = __ldg(b + 4), a.bh23 = __ldg(b + 8), a.bl23 = __ldg(b + 12);
        }
        const int4 sa = __ldg((const int4*)(xs + ((size_t)c0 * nblk + blk) * 4));
        const int4 sb = __ldg((const int4*)(xs + ((size_t)c1 * nblk + blk) * 4));
        a.na0 = -((sa.x + sa.y) + (sa.z + sa.w)), a.na1 = -((sb.x + sb.y) + (sb.z + sb.w));
        a.u0 = __ldg(xu + (size_t)c0 * nblk + blk), a.u1 = __ldg(xu + (size_t)c1 * nblk + blk);
        return a;
    };
    Act nx;  // AHEAD: the next block's operands
    if (AHEAD && live) nx = load_act(2 * p0);
    for (int p = p0; live && p < p1; ++p) {
        uint4 ca[R][PL];
        u32 cd[R][2];
#pragma unroll
        for (int r = 0; r < R; ++r) {
#pragma unroll
            for (int q = 0; q < PL; ++q) ca[r][q] = na[r][q];
            cd[r][0] = nd[r][0], cd[r][1] = nd[r][1];
        }
        if (p + 1 < p1) load_w(p + 1);
#pragma unroll
        for (int hb = 0; hb < 2; ++hb) {
            const int blk = 2 * p + hb;
            Act cur;
            if (AHEAD) {
                cur = nx;
                if (blk + 1 < 2 * p1) nx = load_act(blk + 1);
            } else {
                cur = load_act(blk);
            }
            const int na0 = cur.na0, na1 = cur.na1;
            const float u0 = cur.u0, u1 = cur.u1;
            const u32 bh[8] = {cur.bh01.x, cur.bh01.y, cur.bh01.z, cur.bh01.w,
                               cur.bh23.x, cur.bh23.y, cur.bh23.z, cur.bh23.w};
            const u32 bl[8] = {cur.bl01.x, cur.bl01.y, cur.bl01.z, cur.bl01.w,
                               cur.bl23.x, cur.bl23.y, cur.bl23.z, cur.bl23.w};
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const u32 w0 = hb ? ca[r][0].z : ca[r][0].x, w1 = hb ? ca[r][0].w : ca[r][0].y;
                const u32 v0 = hb ? ca[r][PL - 1].z : ca[r][PL - 1].x, v1 = hb ? ca[r][PL - 1].w : ca[r][PL - 1].y;
                // the bytes of elements 32tg + i + 8m: bit i of each byte of plane 0, plus plane 1's at bit 1
                auto code = [&](u32 p0, u32 p1, int i) -> u32 {
                    return PL == 1 ? (p0 >> i) & M : ((p0 >> i) & M) | (((p1 >> i) & M) << 1);
                };
                int ch[4] = {0, 0, 0, 0}, cl[4] = {0, 0, 0, 0};
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const u32 a[4] = {code(w0, v0, 2 * j), code(w1, v1, 2 * j), code(w0, v0, 2 * j + 1),
                                      code(w1, v1, 2 * j + 1)};
                    mma_u8s8_k32(ch, a, bh[2 * j], bh[2 * j + 1]);
                    mma_u8u8_k32(cl, a, bl[2 * j], bl[2 * j + 1]);
                }
                const float d0 = h2f((u16)(cd[r][hb] & 0xffffu)), d1 = h2f((u16)(cd[r][hb] >> 16));
                // Q1_0: Σ (2c − 1)·a; Q2_0: Σ (c − 1)·a
                constexpr int F = PL == 1 ? 2 : 1;
                const int S0 = F * (ch[0] * 256 + cl[0]) + na0, S1 = F * (ch[1] * 256 + cl[1]) + na1;
                const int S2 = F * (ch[2] * 256 + cl[2]) + na0, S3 = F * (ch[3] * 256 + cl[3]) + na1;
                acc[r][0] = fmaf(d0 * u0, (float)S0, acc[r][0]);
                acc[r][1] = fmaf(d0 * u1, (float)S1, acc[r][1]);
                acc[r][2] = fmaf(d1 * u0, (float)S2, acc[r][2]);
                acc[r][3] = fmaf(d1 * u1, (float)S3, acc[r][3]);
            }
        }
    }
    // C (row g + 8·(i >> 1), column 2tg + (i & 1)); then the K parts in order
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int row = g + 8 * (i >> 1), col = 2 * tg + (i & 1);
            if (col >= n) continue;
            if (KS == 1) {
                if (ok[r]) {
                    float* yp = sg[r].y + (size_t)col * sg[r].n_out + tl[r] * 16 + row;
                    *yp = accumulate ? *yp + acc[r][i] : acc[r][i];
                }
            } else {
                red[kp][KS > 1 ? rg * R + r : 0][row][col] = acc[r][i];
            }
        }
    if (KS > 1) {
        __syncthreads();
        // warp kp == 0 of each group writes its tiles: lane = row (16 lanes), all n columns
        if (kp == 0 && lane < 16) {
#pragma unroll
            for (int r = 0; r < R; ++r) {
                if (!ok[r]) continue;
                for (int t = 0; t < n; ++t) {
                    float v = red[0][rg * R + r][lane][t];
#pragma unroll
                    for (int k2 = 1; k2 < KS; ++k2) v += red[k2][rg * R + r][lane][t];
                    float* yp = sg[r].y + (size_t)t * sg[r].n_out + tl[r] * 16 + lane;
                    *yp = accumulate ? *yp + v : v;
                }
            }
        }
    }
}

// Variants `_rR_kKS`: R tiles per warp, the K split KS (4 warps per block up to KS = 4, then KS
// warps); `_r2a_kKS` the AHEAD form of `_r2` (the default). Launcher: `Gpu::mv_b1q`.
// Measured slower on an H100 and removed (2026-12-07; the kernels README has the numbers): 4 tiles
// per warp in the AHEAD form (`_r4a`, one tile group per block; last in d231dca), and the AHEAD
// form with each warp's weights and scales through a 3- or 4-stage shared-memory ring filled by
// cp.async 2–3 pairs ahead (`_r2w3` / `_r2w4`, `Gpu::b1q_ring`; last in 6ddfa80).
#define MVBQ_ENTRY(NAME, R, KS, RGW, PL) MVBQ_AHEAD_ENTRY(NAME, R, KS, RGW, PL, false)
#define MVBQ_AHEAD_ENTRY(NAME, R, KS, RGW, PL, AHEAD)                                        \
    MV_SEG_ENTRY(NAME, (KS) * (RGW), 1, const uint4*, xv,                                    \
                 mvbq_mv<KS, RGW, R, PL, AHEAD>(s0, s1, s2, s3, xv, da, sa, n_in, n, accumulate, pre))
MVBQ_ENTRY(mvbq_q1_r1_k1, 1, 1, 4, 1)
MVBQ_ENTRY(mvbq_q1_r1_k2, 1, 2, 2, 1)
MVBQ_ENTRY(mvbq_q1_r1_k4, 1, 4, 1, 1)
MVBQ_ENTRY(mvbq_q1_r1_k8, 1, 8, 1, 1)
MVBQ_ENTRY(mvbq_q1_r1_k16, 1, 16, 1, 1)
MVBQ_ENTRY(mvbq_q1_r2_k1, 2, 1, 4, 1)
MVBQ_ENTRY(mvbq_q1_r2_k2, 2, 2, 2, 1)
MVBQ_ENTRY(mvbq_q1_r2_k4, 2, 4, 1, 1)
MVBQ_ENTRY(mvbq_q1_r2_k8, 2, 8, 1, 1)
MVBQ_ENTRY(mvbq_q1_r2_k16, 2, 16, 1, 1)
MVBQ_ENTRY(mvbq_q2_r1_k1, 1, 1, 4, 2)
MVBQ_ENTRY(mvbq_q2_r1_k2, 1, 2, 2, 2)
MVBQ_ENTRY(mvbq_q2_r1_k4, 1, 4, 1, 2)
MVBQ_ENTRY(mvbq_q2_r1_k8, 1, 8, 1, 2)
MVBQ_ENTRY(mvbq_q2_r1_k16, 1, 16, 1, 2)
MVBQ_ENTRY(mvbq_q2_r2_k1, 2, 1, 4, 2)
MVBQ_ENTRY(mvbq_q2_r2_k2, 2, 2, 2, 2)
MVBQ_ENTRY(mvbq_q2_r2_k4, 2, 4, 1, 2)
MVBQ_ENTRY(mvbq_q2_r2_k8, 2, 8, 1, 2)
MVBQ_ENTRY(mvbq_q2_r2_k16, 2, 16, 1, 2)
MVBQ_AHEAD_ENTRY(mvbq_q1_r2a_k1, 2, 1, 4, 1, true)
MVBQ_AHEAD_ENTRY(mvbq_q1_r2a_k2, 2, 2, 2, 1, true)
MVBQ_AHEAD_ENTRY(mvbq_q1_r2a_k4, 2, 4, 1, 1, true)
MVBQ_AHEAD_ENTRY(mvbq_q1_r2a_k8, 2, 8, 1, 1, true)
MVBQ_AHEAD_ENTRY(mvbq_q1_r2a_k16, 2, 16, 1, 1, true)
MVBQ_AHEAD_ENTRY(mvbq_q2_r2a_k1, 2, 1, 4, 2, true)
MVBQ_AHEAD_ENTRY(mvbq_q2_r2a_k2, 2, 2, 2, 2, true)
MVBQ_AHEAD_ENTRY(mvbq_q2_r2a_k4, 2, 4, 1, 2, true)
MVBQ_AHEAD_ENTRY(mvbq_q2_r2a_k8, 2, 8, 1, 2, true)
MVBQ_AHEAD_ENTRY(mvbq_q2_r2a_k16, 2, 16, 1, 2, true)
