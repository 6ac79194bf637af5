// ---- pipelined persistent decode mat-vec (`mvp_*`, n = 1, dp4a) ------------------------------
// A decode mat-vec streams every weight byte once. In `mv_lowbit` a warp loads a batch of its
// rows' code words, waits a whole memory round trip, computes, and only then loads the next batch,
// and a block exits after one row group: per warp, memory latency and the unpack/dp4a work add up
// instead of overlapping (the H200 sweep: the 248k-row head, long enough to have no launch or tail
// effects, streams at ~1.9 TB/s of 4.5).
//
// Here the launcher gives a fixed grid that fits on the GPU at once (`Gpu::mv_lowbit_multi`), and
// warp `wid` of `nw` walks row groups g = wid, wid + nw, wid + 2·nw, ... (R rows each, groups never
// straddle two matrices) as ONE stream of chunks: chunk c of a group is sub-blocks 32c .. 32c + 31
// of its R rows, sub-block 32c + lane on lane `lane`. A ring of D chunks lives in registers: the
// loads of chunk i + D are issued right after chunk i is consumed, so D chunks (D·R·128 bytes of
// Q1 codes per warp) are always in flight while the warp computes.
//
// Float order: per row, lane l sums its sub-blocks in increasing order into part p = c mod KS
// (the chunks a K-split mv_lowbit warp kp = p would take), each part is warp-reduced by the same
// xor-tree, and the parts are added in order p = 0, 1, ... That is `mv_lowbit<KIND, NT, *, *, KS>`
// exactly, so an mvp launch equals the mv_lowbit launch with the same KS (any n, any R) bit for
// bit, and decode rows stay batch-invariant against the verify (n <= 8) kernels.

// Segment and first row of row group g (groups of R rows, in segment order); false past the end.
// Used by mv_pipe (the o8 kernels of mvo.cu that shared it were removed on 2026-12-06).
template <int R>
__device__ __forceinline__ bool mv_seg_group(int g, MvSeg s0, MvSeg s1, MvSeg s2, MvSeg s3, MvSeg& sg,
                                          int& o0) {
    int g0 = (s0.n_out + R - 1) / R, g1 = (s1.n_out + R - 1) / R, g2 = (s2.n_out + R - 1) / R,
        g3 = (s3.n_out + R - 1) / R;
    if (g < g0) {
        sg = s0;
    } else if ((g -= g0) < g1) {
        sg = s1;
    } else if ((g -= g1) < g2) {
        sg = s2;
    } else if ((g -= g2) < g3) {
        sg = s3;
    } else {
        return false;
    }
    o0 = g * R;
    return true;
}

template <int KIND, int R, int D, int KS>
__device__ __forceinline__ void mv_pipe(MvSeg s0, MvSeg s1, MvSeg s2, MvSeg s3, const i8* __restrict__ q,
                                        const float* __restrict__ da, const int* __restrict__ sa,
                                        int n_in, int accumulate, int pre) {
    const int BE = KIND == 3 ? 64 : 128;  // elements per scale block
    const int SPB = BE / 32;              // sub-blocks per scale block
    int lane = threadIdx.x & 31;
    int wid = blockIdx.x * MV_WARPS + (threadIdx.x >> 5);
    int nw = gridDim.x * MV_WARPS;
    int G = (s0.n_out + R - 1) / R + (s1.n_out + R - 1) / R + (s2.n_out + R - 1) / R +
            (s3.n_out + R - 1) / R;
    int nsb = n_in >> 5, nblk = n_in / BE, nch = (nsb + 31) >> 5;
    int S = wid < G ? ((G - 1 - wid) / nw + 1) * nch : 0;  // chunks of this warp's stream

    // loader: group lg, chunk lc; row pointers of group lg (rows past n_out clamped to the last)
    int lg = wid, lc = 0;
    const u32* cp1[R];
    const uint2* cp2[R];
    const u16* sp[R];
    auto set_rows = [&](int g) {
        MvSeg sg = s0;
        int o0 = 0;
        mv_seg_group<R>(g, s0, s1, s2, s3, sg, o0);
#pragma unroll
        for (int r = 0; r < R; ++r) {
            size_t ro = (size_t)min(o0 + r, sg.n_out - 1);
            cp1[r] = (const u32*)sg.codes + ro * nsb;
            cp2[r] = (const uint2*)sg.codes + ro * nsb;
            sp[r] = sg.scales + ro * nblk;
        }
    };
    // the ring: code words and raw f16 scales of D chunks
    uint2 cw[D][R];
    u16 sw[D][R];
    auto issue = [&](int d) {
        if (lg < G) {
            int j = lc * 32 + lane;
            if (j < nsb) {
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    if (KIND == 1) {
                        cw[d][r].x = __ldg(cp1[r] + j);
                    } else {
                        cw[d][r] = __ldg(cp2[r] + j);
                    }
                    sw[d][r] = __ldg(sp[r] + j / SPB);
                }
            }
            if (++lc == nch) {
                lc = 0;
                lg += nw;
                if (lg < G) set_rows(lg);
            }
        }
    };
    if (S > 0) set_rows(lg);
    // weights are never written on the device: with `pre` the ring is filled before PDL_WAIT
    if (pre) {
#pragma unroll
        for (int d = 0; d < D; ++d) issue(d);
        PDL_ENTRY();
    } else {
        PDL_ENTRY();
#pragma unroll
        for (int d = 0; d < D; ++d) issue(d);
    }

    // consumer: group cg, chunk cc; per row, KS partial sums
    int cg = wid, cc = 0;
    float acc[KS][R];
#pragma unroll
    for (int p = 0; p < KS; ++p)
#pragma unroll
        for (int r = 0; r < R; ++r) acc[p][r] = 0.f;
    auto consume = [&](int d) {
        int j = cc * 32 + lane;
        if (j < nsb) {
            const int4* qa4 = (const int4*)(q + (size_t)j * 32);
            int4 qa0 = __ldg(qa4), qa1 = __ldg(qa4 + 1);
            int qa[8] = {qa0.x, qa0.y, qa0.z, qa0.w, qa1.x, qa1.y, qa1.z, qa1.w};
            float dt = __ldg(da + j);
            int st = __ldg(sa + j);
            int part = cc & (KS - 1);
#pragma unroll
            for (int r = 0; r < R; ++r) {
                int isum = sub_dot<KIND>(cw[d][r], qa, st);
                float pr = h2f(sw[d][r]) * dt;
#pragma unroll
                for (int p = 0; p < KS; ++p)
                    if (p == part) acc[p][r] = fmaf(pr, (float)isum, acc[p][r]);
            }
        }
        if (++cc == nch) {
            MvSeg sg = s0;
            int o0 = 0;
            mv_seg_group<R>(cg, s0, s1, s2, s3, sg, o0);
#pragma unroll
            for (int r = 0; r < R; ++r) {
                float v = warp_sum(acc[0][r]);
#pragma unroll
                for (int p = 1; p < KS; ++p) v += warp_sum(acc[p][r]);
                if (lane == r && o0 + r < sg.n_out) {
                    float* yp = sg.y + o0 + r;
                    *yp = accumulate ? *yp + v : v;
                }
#pragma unroll
                for (int p = 0; p < KS; ++p) acc[p][r] = 0.f;
            }
            cc = 0;
            cg += nw;
        }
    };
    for (int s = 0; s < S; s += D) {
#pragma unroll
        for (int d = 0; d < D; ++d) {
            if (s + d < S) {
                consume(d);
                issue(d);
            }
        }
    }
}

// Variants: R = 2 or 4 rows per group (1 was never the fastest in the H200 sweep) with a ring of
// D chunks (D·R = 16 code words per lane in flight), K
// split emulation KS (the mv_lowbit KS whose float order to reproduce). `n` must be 1; the
// launcher sizes the grid to the resident capacity.
#define MVP_ENTRY(NAME, KIND, R, D, KS, MINB)        \
    MV_SEG_ENTRY(NAME, MV_WARPS, MINB, const i8*, q, \
                 mv_pipe<KIND, R, D, KS>(s0, s1, s2, s3, q, da, sa, n_in, accumulate, pre))
#define MVP_KIND_ENTRIES(K, KIND)                 \
    MVP_ENTRY(mvp_##K##_r2_k1, KIND, 2, 8, 1, 4)  \
    MVP_ENTRY(mvp_##K##_r2_k2, KIND, 2, 8, 2, 4)  \
    MVP_ENTRY(mvp_##K##_r2_k4, KIND, 2, 8, 4, 4)  \
    MVP_ENTRY(mvp_##K##_r4_k1, KIND, 4, 4, 1, 4)  \
    MVP_ENTRY(mvp_##K##_r4_k2, KIND, 4, 4, 2, 4)  \
    MVP_ENTRY(mvp_##K##_r4_k4, KIND, 4, 4, 4, 4)
MVP_KIND_ENTRIES(q1, 1)
MVP_KIND_ENTRIES(q2, 2)
MVP_KIND_ENTRIES(q2g64, 3)
