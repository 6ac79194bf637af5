// ---- "blk" mat-vec family (`mvk_*`: one scale block per lane) ----------------------------------
// The plain dp4a kernel (`mv_lowbit`) gives lane l the 32-element sub-blocks l, l + 32, ..., so
// every sub-block costs the lane its own 4-byte code load, f16 scale load and conversion, the
// f32 product of the two scales and the predicated zeroing of all of them: in its SASS those
// outnumber the 8 dp4a of the sub-block. Here a lane takes whole scale blocks (Q1_0 and Q2_0:
// 128 elements, Q2_0 g64: 64): one 16-byte code load (two for Q2_0 g128) and one scale per block,
// the activation scales and code sums of the block's sub-blocks as one vector load each.
//
// Float order, for weight row o and activation row t (the same for every n, so an n-row launch
// equals the one-row launch bit for bit; it is NOT the order of the other families):
//   block b:  P_b = Σ_j dt_t,j · isum_j  (sub-blocks j of b in order, fma from 0; isum_j the exact
//             integer Σ code·q of the sub-block as in `sub_dot`)
//   lane p of an 8-lane group takes blocks b ≡ p (mod 8) of its K part (chunk c = b / 8 belongs to
//             part c mod KS), in increasing order: A = fma(dw_b, P_b, A) from 0
//   the group's 8 lanes: the xor-butterfly 4, 2, 1; the row is part 0 + part 1 + ... in order.
// A warp is 4 lane groups of RR weight rows each (4·RR rows per warp unit, KS warps per unit).
// The launcher needs codes, d and s 16-byte aligned (8 for Q2_0 g64's d and s) and q 16-byte
// aligned; n_in a multiple of the block.

// Σ(code·q) − s of sub-block j of a block held as BV uint4 (Q1: one u32 per sub-block; Q2: two).
template <int KIND, int BV>
__device__ __forceinline__ uint2 blk_sub_words(const uint4 (&c)[BV], int j) {
    if (KIND == 1) {
        u32 w = j == 0 ? c[0].x : j == 1 ? c[0].y : j == 2 ? c[0].z : c[0].w;
        return make_uint2(w, 0u);
    }
    // Q2: sub-block j is words 2j, 2j + 1 of the block
    const uint4& v = c[j >> 1];
    return (j & 1) ? make_uint2(v.z, v.w) : make_uint2(v.x, v.y);
}

// a[k] <- a[(k + rot) mod N] for N = 1, 2 or 4 (selects, no local memory).
template <typename T, int N>
__device__ __forceinline__ void rot_left(T (&a)[N], int rot) {
    if (N >= 2) {
        T b[N];
#pragma unroll
        for (int k = 0; k < N; ++k) b[k] = (rot & 1) ? a[(k + 1) % N] : a[k];
#pragma unroll
        for (int k = 0; k < N; ++k) a[k] = b[k];
    }
    if (N >= 4) {
        T b[N];
#pragma unroll
        for (int k = 0; k < N; ++k) b[k] = (rot & 2) ? a[(k + 2) % N] : a[k];
#pragma unroll
        for (int k = 0; k < N; ++k) a[k] = b[k];
    }
}

// The activation scales d and code sums s of one block's SPB sub-blocks (one vector load each).
template <int SPB>
__device__ __forceinline__ void blk_scales(const float* dp, const int* sp, float (&d)[4], int (&s)[4]) {
    if (SPB == 4) {
        float4 d4 = __ldg((const float4*)dp);
        int4 s4 = __ldg((const int4*)sp);
        d[0] = d4.x, d[1] = d4.y, d[2] = d4.z, d[3] = d4.w;
        s[0] = s4.x, s[1] = s4.y, s[2] = s4.z, s[3] = s4.w;
    } else {
        float2 d2 = __ldg((const float2*)dp);
        int2 s2 = __ldg((const int2*)sp);
        d[0] = d2.x, d[1] = d2.y, d[2] = 0.f, d[3] = 0.f;
        s[0] = s2.x, s[1] = s2.y, s[2] = 0, s[3] = 0;
    }
}

template <int KIND, int NT, int RR, int U, int KS>
__device__ __forceinline__ void mv_blk(MvSeg s0, MvSeg s1, MvSeg s2, MvSeg s3, const i8* __restrict__ q,
                                       const float* __restrict__ da, const int* __restrict__ sa, int n_in,
                                       int n, int accumulate, int pre) {
    const int BE = KIND == 3 ? 64 : 128;  // elements per scale block
    const int SPB = BE / 32;              // sub-blocks per scale block
    const int BV = KIND == 2 ? 2 : 1;     // uint4 code vectors per block
    const int R = 4 * RR;                 // rows per warp unit
    const int G = MV_WARPS / KS;          // warp units per block
    // per-warp partial sums of the K split: [warp][row of the unit][activation row]
    __shared__ float part[KS > 1 ? MV_WARPS : 1][R][NT];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    int gq = lane >> 3, p = lane & 7;
    int kp = w % KS;
    // The warp's 4 lane groups read the same activation blocks. Group gq starts each block at its
    // sub-block gq mod SPB (step j takes sub-block (j + gq) mod SPB), so one load instruction
    // covers every 32-byte sector of the 8 blocks' 128-byte lines instead of one sector 4 times
    // (measured: without the rotation the kernel took 2x the plain kernel's time at n = 1, 4.5x
    // at n = 5). The integer sums go back to sub-block order before any float operation.
    const int rot = gq & (SPB - 1);
    MvSeg sg = s0;
    int u0 = 0;
    bool valid = mv_seg_group<R>(blockIdx.x * G + w / KS, s0, s1, s2, s3, sg, u0);
    if (!valid && KS == 1) return;  // no block barrier below when KS == 1
    int o0 = u0 + gq * RR;          // this lane group's first row
    int nblk = n_in / BE, nsb = n_in >> 5;
    // per-row bases: codes [n_out, nblk, BV] uint4, scales [n_out, nblk] f16
    const uint4* cp[RR];
    const u16* sp[RR];
#pragma unroll
    for (int r = 0; r < RR; ++r) {
        size_t ro = valid ? (size_t)min(o0 + r, sg.n_out - 1) : 0;
        cp[r] = (const uint4*)sg.codes + ro * nblk * BV;
        sp[r] = sg.scales + ro * nblk;
    }
    float acc[RR][NT];
#pragma unroll
    for (int r = 0; r < RR; ++r)
#pragma unroll
        for (int t = 0; t < NT; ++t) acc[r][t] = 0.f;
    const int STEP = 8 * KS;  // blocks between a lane's consecutive blocks
    uint4 c[U][RR][BV];
    float dw[U][RR];
    auto load_w = [&](int b0) {
        unsigned ub0 = (unsigned)b0;
#pragma unroll
        for (int u = 0; u < U; ++u) {
#pragma unroll
            for (int r = 0; r < RR; ++r) {
                if (b0 + STEP * u < nblk) {
#pragma unroll
                    for (int v = 0; v < BV; ++v) c[u][r][v] = __ldg(cp[r] + (ub0 + STEP * u) * BV + v);
                    dw[u][r] = h2f(__ldg(sp[r] + ub0 + STEP * u));
                }
            }
        }
    };
    int bfirst = 8 * kp + p;
    // weights are never written on the device: with `pre` the first batch is loaded before
    // PDL_WAIT, overlapping the previous kernel's tail
    if (pre) {
        if (valid) load_w(bfirst);
        PDL_ENTRY();
    } else {
        PDL_ENTRY();
        if (valid) load_w(bfirst);
    }
    for (int b0 = bfirst; valid && b0 < nblk; b0 += STEP * U) {
        if (b0 != bfirst) load_w(b0);
#pragma unroll
        for (int u = 0; u < U; ++u) {
            int b = b0 + STEP * u;
            if (b < nblk) {
                unsigned sb0 = (unsigned)b * SPB;     // the block's first sub-block
                const i8* qb = q + (size_t)sb0 * 32;  // its activation codes (row 0)
                // the RR rows' sub-block code words, in this group's rotated order
                uint2 cw[RR][SPB];
#pragma unroll
                for (int r = 0; r < RR; ++r) {
#pragma unroll
                    for (int k = 0; k < SPB; ++k) cw[r][k] = blk_sub_words<KIND, BV>(c[u][r], k);
                    rot_left(cw[r], rot);
                }
                // exact integer sums Σ code·q per (row, activation row, rotated sub-block)
                int isr[RR][NT][SPB];
#pragma unroll
                for (int j = 0; j < SPB; ++j) {
                    // unpack the RR code words once for all activation rows
                    SubOps ops[RR];
#pragma unroll
                    for (int r = 0; r < RR; ++r) ops[r] = sub_unpack<KIND>(cw[r][j]);
                    int jj = (j + rot) & (SPB - 1);  // the sub-block this step
#pragma unroll
                    for (int t = 0; t < NT; ++t) {
                        if (NT == 1 || t < n) {
                            const int4* qa4 = (const int4*)(qb + (size_t)t * n_in) + 2 * jj;
                            int4 qa0 = __ldg(qa4), qa1 = __ldg(qa4 + 1);
                            int qa[8] = {qa0.x, qa0.y, qa0.z, qa0.w, qa1.x, qa1.y, qa1.z, qa1.w};
#pragma unroll
                            for (int r = 0; r < RR; ++r) isr[r][t][j] = sub_dot_ops<KIND>(ops[r], qa, 0);
                        }
                    }
                }
                // back in sub-block order: P = Σ_k dt_k · (isum_k − s_k), k increasing
                float pb[RR][NT];
#pragma unroll
                for (int t = 0; t < NT; ++t) {
                    if (NT == 1 || t < n) {
                        float dts[4];
                        int sts[4];
                        blk_scales<SPB>(da + (size_t)t * nsb + sb0, sa + (size_t)t * nsb + sb0, dts, sts);
#pragma unroll
                        for (int r = 0; r < RR; ++r) {
                            rot_left(isr[r][t], (SPB - rot) & (SPB - 1));
                            float v = 0.f;
#pragma unroll
                            for (int k = 0; k < SPB; ++k) v = fmaf(dts[k], (float)(isr[r][t][k] - sts[k]), v);
                            pb[r][t] = v;
                        }
                    } else {
#pragma unroll
                        for (int r = 0; r < RR; ++r) pb[r][t] = 0.f;
                    }
                }
#pragma unroll
                for (int r = 0; r < RR; ++r)
#pragma unroll
                    for (int t = 0; t < NT; ++t) acc[r][t] = fmaf(dw[u][r], pb[r][t], acc[r][t]);
            }
        }
    }
    // the group's 8 lanes (xor 4, 2, 1), then the K parts in order kp = 0, 1, .. (fixed)
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        if (t < n) {
#pragma unroll
            for (int r = 0; r < RR; ++r) {
                float v = acc[r][t];
                v += __shfl_xor_sync(0xffffffffu, v, 4);
                v += __shfl_xor_sync(0xffffffffu, v, 2);
                v += __shfl_xor_sync(0xffffffffu, v, 1);
                if (KS == 1) {
                    if (valid && p == 0 && o0 + r < sg.n_out) {
                        float* yp = sg.y + (size_t)t * sg.n_out + o0 + r;
                        *yp = accumulate ? *yp + v : v;
                    }
                } else if (p == 0) {
                    part[w][gq * RR + r][t] = v;
                }
            }
        }
    }
    if (KS > 1) {
        __syncthreads();
        if (valid && kp == 0 && lane < R) {
            int o = u0 + lane;
            if (o < sg.n_out) {
                for (int t = 0; t < n; ++t) {
                    float v = part[w][lane][t];
#pragma unroll
                    for (int k2 = 1; k2 < KS; ++k2) v += part[w + k2][lane][t];
                    float* yp = sg.y + (size_t)t * sg.n_out + o;
                    *yp = accumulate ? *yp + v : v;
                }
            }
        }
    }
}

#define MVK_ENTRY(NAME, KIND, NT, RR, U, KS, MINB) \
    MV_SEG_ENTRY(NAME, MV_WARPS, MINB, const i8*, q, \
                 mv_blk<KIND, NT, RR, U, KS>(s0, s1, s2, s3, q, da, sa, n_in, n, accumulate, pre))
// `_n1_rRR` (decode, one activation row, RR rows per lane group) and `_n8` (verify, up to 8 rows,
// one row per lane group); `_kKS` the K split. U blocks per lane in flight (one-row / n-row): 4 / 2
// for the 16-byte blocks, 2 / 1 for Q2_0 g128's 32-byte ones.
#define MVK_KIND_ENTRIES(K, KIND, U, U8)               \
    MVK_ENTRY(mvk_##K##_n8_k1, KIND, MAXN, 1, U8, 1, 2) \
    MVK_ENTRY(mvk_##K##_n8_k2, KIND, MAXN, 1, U8, 2, 2) \
    MVK_ENTRY(mvk_##K##_n8_k4, KIND, MAXN, 1, U8, 4, 2) \
    MVK_ENTRY(mvk_##K##_n1_r1_k1, KIND, 1, 1, U, 1, 6) \
    MVK_ENTRY(mvk_##K##_n1_r1_k2, KIND, 1, 1, U, 2, 6) \
    MVK_ENTRY(mvk_##K##_n1_r1_k4, KIND, 1, 1, U, 4, 6) \
    MVK_ENTRY(mvk_##K##_n1_r2_k1, KIND, 1, 2, U, 1, 5) \
    MVK_ENTRY(mvk_##K##_n1_r2_k2, KIND, 1, 2, U, 2, 5) \
    MVK_ENTRY(mvk_##K##_n1_r2_k4, KIND, 1, 2, U, 4, 5)
MVK_KIND_ENTRIES(q1, 1, 4, 2)
MVK_KIND_ENTRIES(q2, 2, 2, 1)
MVK_KIND_ENTRIES(q2g64, 3, 4, 2)
