// ---- int8 tensor-core verify with each K part's blocks split over KI warps (`mvbq_*_i*`) ---------
// `mvbq_mv` (mvbp.cu) gives each warp a group of R = 2 tiles and one K part of the shape's K split
// (`mvbp_ks`), and the warp runs the float chain acc = fmaf(d·u, (float)S, acc) over the part's
// blocks in increasing order. The chain fixes the order of the float operations, but not where
// the exact block integers S come from: here the KI warps of a part each compute S (the same
// MMAs, the same integer operations) for one block pair of every chunk of KI pairs, and leave S,
// the row scales d (f32) and the column units u in shared memory; after one block barrier per
// chunk the same warps run the chain over the chunk's blocks in increasing order, each warp for
// NC = 4·R / KI of a lane's 4·R accumulators (tile r = c / 4, value i = c % 4 of combination c:
// row g + 8·(i >> 1), column 2tg + (i & 1)). So row t of a launch equals `mvbq_mv`'s and the
// one-row b1-plane launch's bit for bit, with KI times the warps per tile group and KI pairs of
// weights in flight per part instead of one.
// Block: KS × KI warps (warp w: part w / KI, sub-warp w % KI) over one group of R tiles; the K
// parts' sums are added in order at the end as `mvbq_mv` adds them. The weights of the warp's next
// pair (KI pairs on) are loaded while the current one is used, without allocating in L1, and each
// block's activation operands one block ahead (the AHEAD form).
// Shared memory per chunk buffer and K part: S [2·KI slots][R][32 lanes] int4, d [slots][R][16],
// u [slots][MAXN]; two buffers, so one barrier per chunk: the chain of chunk c reads buffer c & 1
// while no warp writes it before it has passed chunk c + 1's barrier.
template <int KS, int KI, int R, int PL, int RGW = 1>
__device__ __forceinline__ void mvbqi_mv(MvSeg s0, MvSeg s1, MvSeg s2, MvSeg s3, const uint4* __restrict__ xv,
                                         const float* __restrict__ xu, const int* __restrict__ xs, int n_in, int n,
                                         int accumulate, int pre) {
    constexpr int SL = 2 * KI, NC = 4 * R / KI;
    static_assert(KI >= 2 && NC >= 1 && NC * KI == 4 * R, "KI (≥ 2) divides the 4·R accumulators of a lane");
    // RGW: tile groups per block, each with its own KS × KI warps ("parts" below: group × K part)
    __shared__ int4 ssm[2][RGW * KS][SL][R][32];
    __shared__ float dsm[2][RGW * KS][SL][R][16];
    __shared__ float usm[2][RGW * KS][SL][MAXN];
    __shared__ float red[KS > 1 ? KS : 1][KS > 1 ? RGW : 1][KS > 1 ? R : 1][16][MAXN];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, tg = lane & 3;
    const int kp = (w / KI) % KS, sw = w % KI, rg = w / (KI * KS), pq = rg * KS + kp;
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
    // chunks of KI pairs; every warp of the block runs the same count (the longest part's)
    const int nch = ((npair + KS - 1) / KS + KI - 1) / KI;
    const uint4* wa[R];
    const u32* wd[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        wa[r] = (const uint4*)sg[r].codes + (size_t)tl[r] * npair * 32 * PL + lane;
        wd[r] = (const u32*)sg[r].scales + (size_t)tl[r] * nblk * 8 + g;
    }
    const bool bok = g < n;
    const uint4* xb = xv + (size_t)(bok ? g : 0) * nblk * 16 + tg;
    const int c0 = 2 * tg < n ? 2 * tg : 0, c1 = 2 * tg + 1 < n ? 2 * tg + 1 : 0;
    uint4 na[R][PL];
    u32 nd[R][2];
    auto load_w = [&](int p) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
#pragma unroll
            for (int q = 0; q < PL; ++q) na[r][q] = ldg_na_u4(wa[r] + ((size_t)p * PL + q) * 32);
            nd[r][0] = ldg_na_u32(wd[r] + (size_t)(2 * p) * 8);
            nd[r][1] = ldg_na_u32(wd[r] + (size_t)(2 * p + 1) * 8);
        }
    };
    // this warp's pair of chunk c (valid when < p1)
    auto pair_of = [&](int c) { return p0 + c * KI + sw; };
    if (pre) {
        if (any && pair_of(0) < p1) load_w(pair_of(0));
        PDL_ENTRY();
    } else {
        PDL_ENTRY();
        if (any && pair_of(0) < p1) load_w(pair_of(0));
    }
    const u32 M = 0x01010101u;
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
    Act nx;
    if (any && pair_of(0) < p1) nx = load_act(2 * pair_of(0));
    float acc[NC];
#pragma unroll
    for (int c = 0; c < NC; ++c) acc[c] = 0.f;
    for (int ch = 0; ch < nch; ++ch) {
        const int buf = ch & 1, p = pair_of(ch);
        if (any && p < p1) {
            uint4 ca[R][PL];
            u32 cd[R][2];
#pragma unroll
            for (int r = 0; r < R; ++r) {
#pragma unroll
                for (int q = 0; q < PL; ++q) ca[r][q] = na[r][q];
                cd[r][0] = nd[r][0], cd[r][1] = nd[r][1];
            }
            const int pn = pair_of(ch + 1);
            if (pn < p1) load_w(pn);
#pragma unroll
            for (int hb = 0; hb < 2; ++hb) {
                const Act cur = nx;
                if (hb == 0)
                    nx = load_act(2 * p + 1);
                else if (pn < p1)
                    nx = load_act(2 * pn);
                const int slot = 2 * sw + hb;
                const u32 bh[8] = {cur.bh01.x, cur.bh01.y, cur.bh01.z, cur.bh01.w,
                                   cur.bh23.x, cur.bh23.y, cur.bh23.z, cur.bh23.w};
                const u32 bl[8] = {cur.bl01.x, cur.bl01.y, cur.bl01.z, cur.bl01.w,
                                   cur.bl23.x, cur.bl23.y, cur.bl23.z, cur.bl23.w};
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    const u32 w0 = hb ? ca[r][0].z : ca[r][0].x, w1 = hb ? ca[r][0].w : ca[r][0].y;
                    const u32 v0 = hb ? ca[r][PL - 1].z : ca[r][PL - 1].x,
                              v1 = hb ? ca[r][PL - 1].w : ca[r][PL - 1].y;
                    auto code = [&](u32 q0, u32 q1, int i) -> u32 {
                        return PL == 1 ? (q0 >> i) & M : ((q0 >> i) & M) | (((q1 >> i) & M) << 1);
                    };
                    int chi[4] = {0, 0, 0, 0}, clo[4] = {0, 0, 0, 0};
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        const u32 a[4] = {code(w0, v0, 2 * j), code(w1, v1, 2 * j), code(w0, v0, 2 * j + 1),
                                          code(w1, v1, 2 * j + 1)};
                        mma_u8s8_k32(chi, a, bh[2 * j], bh[2 * j + 1]);
                        mma_u8u8_k32(clo, a, bl[2 * j], bl[2 * j + 1]);
                    }
                    // mvbq_mv's exact block integers: Q1_0 Σ (2c − 1)·a, Q2_0 Σ (c − 1)·a
                    constexpr int F = PL == 1 ? 2 : 1;
                    ssm[buf][pq][slot][r][lane] =
                        make_int4(F * (chi[0] * 256 + clo[0]) + cur.na0, F * (chi[1] * 256 + clo[1]) + cur.na1,
                                  F * (chi[2] * 256 + clo[2]) + cur.na0, F * (chi[3] * 256 + clo[3]) + cur.na1);
                    if (tg == 0) {
                        dsm[buf][pq][slot][r][g] = h2f((u16)(cd[r][hb] & 0xffffu));
                        dsm[buf][pq][slot][r][g + 8] = h2f((u16)(cd[r][hb] >> 16));
                    }
                }
                if (g == 0) {
                    usm[buf][pq][slot][2 * tg] = cur.u0;
                    usm[buf][pq][slot][2 * tg + 1] = cur.u1;
                }
            }
        }
        __syncthreads();
        // the chain of this part's chunk, blocks in increasing order: this warp's NC combinations
        const int nsl = min(SL, 2 * (p1 - (p0 + ch * KI)));
        for (int sl = 0; sl < nsl; ++sl) {
#pragma unroll
            for (int cc = 0; cc < NC; ++cc) {
                const int c = sw * NC + cc, r = c >> 2, i = c & 3;
                const int4 sv = ssm[buf][pq][sl][r][lane];
                const int S = i == 0 ? sv.x : i == 1 ? sv.y : i == 2 ? sv.z : sv.w;
                const float d = dsm[buf][pq][sl][r][g + 8 * (i >> 1)];
                const float u = usm[buf][pq][sl][2 * tg + (i & 1)];
                acc[cc] = fmaf(d * u, (float)S, acc[cc]);
            }
        }
    }
    // C (row g + 8·(i >> 1), column 2tg + (i & 1)); then the K parts in order. The tiles are
    // walked with constant indices (sg / tl / ok stay in registers)
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int cc = 0; cc < NC; ++cc) {
            const int c = sw * NC + cc, i = c & 3;
            const int row = g + 8 * (i >> 1), col = 2 * tg + (i & 1);
            if ((c >> 2) != r || col >= n) continue;
            if (KS == 1) {
                if (ok[r]) {
                    float* yp = sg[r].y + (size_t)col * sg[r].n_out + tl[r] * 16 + row;
                    *yp = accumulate ? *yp + acc[cc] : acc[cc];
                }
            } else {
                red[KS > 1 ? kp : 0][KS > 1 ? rg : 0][KS > 1 ? r : 0][row][col] = acc[cc];
            }
        }
    if (KS > 1) {
        __syncthreads();
        // the first warp of each group: lane = row
        if (kp == 0 && sw == 0 && lane < 16) {
#pragma unroll
            for (int r = 0; r < R; ++r) {
                if (!ok[r]) continue;
                for (int t = 0; t < n; ++t) {
                    float v = red[0][KS > 1 ? rg : 0][KS > 1 ? r : 0][lane][t];
#pragma unroll
                    for (int k2 = 1; k2 < KS; ++k2) v += red[k2][KS > 1 ? rg : 0][KS > 1 ? r : 0][lane][t];
                    float* yp = sg[r].y + (size_t)t * sg[r].n_out + tl[r] * 16 + lane;
                    *yp = accumulate ? *yp + v : v;
                }
            }
        }
    }
}

// Variants `_iW_kKS`: W = KS × KI warps per block, 2 tiles per block, 16 warps per SM (128
// registers); KI ≥ 2 only (with one
// warp per part the plain AHEAD kernel `mvbq_*_r2a_kKS` is this computation, and the launcher
// takes it). Launcher: `Gpu::mv_b1q` when `Gpu::b1q_ki` is 4 or 8.
#define MVBQI_ENTRY(NAME, KS, KI, PL) \
    MV_SEG_ENTRY(NAME, (KS) * (KI), 16 / ((KS) * (KI)), const uint4*, xv, \
                 mvbqi_mv<KS, KI, 2, PL>(s0, s1, s2, s3, xv, da, sa, n_in, n, accumulate, pre))
MVBQI_ENTRY(mvbq_q1_i4_k1, 1, 4, 1)
MVBQI_ENTRY(mvbq_q1_i4_k2, 2, 2, 1)
MVBQI_ENTRY(mvbq_q1_i8_k1, 1, 8, 1)
MVBQI_ENTRY(mvbq_q1_i8_k2, 2, 4, 1)
MVBQI_ENTRY(mvbq_q1_i8_k4, 4, 2, 1)
MVBQI_ENTRY(mvbq_q2_i4_k1, 1, 4, 2)
MVBQI_ENTRY(mvbq_q2_i4_k2, 2, 2, 2)
MVBQI_ENTRY(mvbq_q2_i8_k1, 1, 8, 2)
MVBQI_ENTRY(mvbq_q2_i8_k2, 2, 4, 2)
MVBQI_ENTRY(mvbq_q2_i8_k4, 4, 2, 2)
// `_g8`: 8 warps, 2 warps per K part (KI = 2) and 8 / (2·KS) tile groups per block, so the
// groups' warps walk the same activation blocks together as `mvbq_mv`'s 4 groups do
#define MVBQG_ENTRY(NAME, KS, PL) \
    MV_SEG_ENTRY(NAME, 8, 2, const uint4*, xv, \
                 mvbqi_mv<KS, 2, 2, PL, 4 / (KS)>(s0, s1, s2, s3, xv, da, sa, n_in, n, accumulate, pre))
MVBQG_ENTRY(mvbq_q1_g8_k1, 1, 1)
MVBQG_ENTRY(mvbq_q1_g8_k2, 2, 1)
