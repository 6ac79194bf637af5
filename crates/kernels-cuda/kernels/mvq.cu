// ---- integer sub-scale one-row mat-vec (`mvq_*`; not used by the engine yet) --------------------
// Activations in the sub-scale format of quant_rows_sub: codes q, a unit u per weight scale block
// (BE = 128 elements; Q2_0 g64: 64), a sub-scale m_j in 1..16 and the code sum s_j per sub-block.
// A block's products add up exactly in int32, isum_B = Σ_j m_j · isum_j, before one float rescale.
//
// Layout: a warp holds MVQ_LG row groups of 8 lanes, each group R consecutive rows of the matrix;
// the warps of a block split K into KS parts (warp w: part w mod KS). Lane q of a group takes the
// blocks B = BPC·c + 8h + q of every chunk c of its K part (chunks c ≡ kp mod KS, BPC = 8 blocks
// per chunk; 16 for g64, where each lane owns two partials h = 0, 1), so the lane owns partial
// p = 8h + q: a single fma chain acc = fma(dw_B · u_B, isum_B, acc) over its chunks in increasing
// order. Then the butterfly over the group's lanes (xor 1, 2, 4) and, for g64, the lane's two
// partials; then the K parts in order. That is sub_emu::row_dp4a's order (src/sub_emu.rs) bit for
// bit: mv_sub_host replays it, gpu_kernels::mv_sub_equals_host checks the kernel against it.
// Each 16-byte activation load serves the group's R rows.

#define MVQ_LG 4

template <int KIND, int R, int KS>
__device__ __forceinline__ void mvq_lowbit(const void* __restrict__ codes, const u16* __restrict__ scales,
                                           float* y, int n_out, const i8* __restrict__ q,
                                           const float* __restrict__ ua, const int* __restrict__ ma,
                                           const int* __restrict__ sa, int n_in, int accumulate) {
    constexpr int SPB = KIND == 3 ? 2 : 4;  // sub-blocks per block
    constexpr int NPL = KIND == 3 ? 2 : 1;  // partials per lane
    constexpr int BPC = 8 * NPL;            // blocks per chunk
    __shared__ float part[KS > 1 ? MV_WARPS : 1][MVQ_LG][R];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, ql = lane & 7, lg = lane >> 3;
    int kp = w % KS;
    int rg = (blockIdx.x * (MV_WARPS / KS) + w / KS) * MVQ_LG + lg;
    int o0 = rg * R;
    bool valid = o0 < n_out;
    int nsb = n_in >> 5, nblk = nsb / SPB, nch = (nblk + BPC - 1) / BPC;
    // per-row base pointers (rows past n_out clamped: loaded, never stored)
    const u32* cp1[R];
    const uint2* cp2[R];
    const u16* sp[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        size_t ro = valid ? (size_t)min(o0 + r, n_out - 1) : 0;
        cp1[r] = (const u32*)codes + ro * nsb;
        cp2[r] = (const uint2*)codes + ro * nsb;
        sp[r] = scales + ro * nblk;
    }
    float acc[NPL][R];
#pragma unroll
    for (int h = 0; h < NPL; ++h)
#pragma unroll
        for (int r = 0; r < R; ++r) acc[h][r] = 0.f;
    PDL_ENTRY();
    for (int c = kp; valid && c < nch; c += KS) {
#pragma unroll
        for (int h = 0; h < NPL; ++h) {
            const int B = c * BPC + 8 * h + ql;
            if (B < nblk) {
                const float ub = __ldg(ua + B);
                int isum[R];
#pragma unroll
                for (int r = 0; r < R; ++r) isum[r] = 0;
#pragma unroll
                for (int jj = 0; jj < SPB; ++jj) {
                    const int j = B * SPB + jj;
                    const int4* qa4 = (const int4*)(q + (size_t)j * 32);
                    int4 qa0 = __ldg(qa4), qa1 = __ldg(qa4 + 1);
                    int qa[8] = {qa0.x, qa0.y, qa0.z, qa0.w, qa1.x, qa1.y, qa1.z, qa1.w};
                    const int mj = __ldg(ma + j), sj = __ldg(sa + j);
#pragma unroll
                    for (int r = 0; r < R; ++r) {
                        uint2 cw;
                        if (KIND == 1) {
                            cw.x = __ldg(cp1[r] + j);
                            cw.y = 0u;
                        } else {
                            cw = __ldg(cp2[r] + j);
                        }
                        isum[r] += mj * sub_dot<KIND>(cw, qa, sj);
                    }
                }
#pragma unroll
                for (int r = 0; r < R; ++r)
                    acc[h][r] = fmaf(__fmul_rn(h2f(__ldg(sp[r] + B)), ub), (float)isum[r], acc[h][r]);
            }
        }
    }
    // butterfly over the group's 8 lanes, then (g64) the lane's two partials
    float v[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int h = 0; h < NPL; ++h)
#pragma unroll
            for (int o = 1; o < 8; o <<= 1) acc[h][r] += __shfl_xor_sync(0xffffffffu, acc[h][r], o);
        v[r] = NPL == 2 ? acc[0][r] + acc[NPL - 1][r] : acc[0][r];
    }
    if (KS == 1) {
        if (valid && ql < R && o0 + ql < n_out) {
            float vr = 0.f;
#pragma unroll
            for (int r = 0; r < R; ++r)
                if (r == ql) vr = v[r];
            float* yp = y + o0 + ql;
            *yp = accumulate ? *yp + vr : vr;
        }
    } else {
        if (ql == 0) {
#pragma unroll
            for (int r = 0; r < R; ++r) part[w][lg][r] = v[r];
        }
        __syncthreads();
        if (valid && kp == 0 && ql < R && o0 + ql < n_out) {
            float vr = part[w][lg][ql];
#pragma unroll
            for (int k2 = 1; k2 < KS; ++k2) vr += part[w + k2][lg][ql];
            float* yp = y + o0 + ql;
            *yp = accumulate ? *yp + vr : vr;
        }
    }
}

// codes / scales (a re-tiled matrix of n_out rows), y [n_out], activations q [n_in], u
// [n_in / BE], m / s [n_in / 32]. grid ceil(n_out / (MV_WARPS / KS · MVQ_LG · R)), block
// MV_WARPS warps.
#define MVQ_ENTRY(NAME, KIND, R, KS)                                                                   \
    extern "C" __global__ void __launch_bounds__(MV_WARPS * 32) NAME(                                 \
        const void* codes, const u16* scales, float* y, int n_out, const i8* q, const float* u,       \
        const int* m, const int* s, int n_in, int accumulate) {                                       \
        mvq_lowbit<KIND, R, KS>(codes, scales, y, n_out, q, u, m, s, n_in, accumulate);               \
    }
MVQ_ENTRY(mvq_q1_r4_k1, 1, 4, 1)
MVQ_ENTRY(mvq_q1_r4_k2, 1, 4, 2)
MVQ_ENTRY(mvq_q2_r4_k1, 2, 4, 1)
MVQ_ENTRY(mvq_q2_r4_k2, 2, 4, 2)
MVQ_ENTRY(mvq_q2g64_r4_k1, 3, 4, 1)
MVQ_ENTRY(mvq_q2g64_r4_k2, 3, 4, 2)

// The tensor-core verify kernel of the same order (n ≤ 8 activation rows; sub_emu::tile_mma):
// a warp owns one m16 tile of weight rows and all n rows (one n8 tile; columns ≥ n compute on a
// clamped row and are not stored), K part w mod KS. Per sub-block one mma.m16n8k32 with C = 0 (A:
// the signed codes of gemm.cu's q1_plane / q2_plane, B: 8 activation bytes of column g); each lane
// adds m_j(column) · D to its block's int32 fragment; per block one fma per C value into partial
// (block mod BPC), so a lane holds BPC × 4 partials (32; 64 for g64). Then the partials' tree
// (((P0 + P1) + (P2 + P3)) + ...) in the lane, the K parts in order. Row t of an n-row launch
// equals the one-row mvq kernel's value bit for bit.
template <int KIND, int KS>
__device__ __forceinline__ void mvqt_lowbit(const void* __restrict__ codes, const u16* __restrict__ scales,
                                            float* y, int n_out, const i8* __restrict__ q,
                                            const float* __restrict__ ua, const int* __restrict__ ma,
                                            int n_in, int n, int accumulate) {
    constexpr int SPB = KIND == 3 ? 2 : 4;
    constexpr int BPC = 32 / SPB;
    const int G = MV_WARPS / KS;
    __shared__ float part[KS > 1 ? MV_WARPS : 1][16][8];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, tg = lane & 3;
    int kp = w % KS;
    int o0 = (blockIdx.x * G + w / KS) * 16;
    bool valid = o0 < n_out;
    PDL_ENTRY();
    int ra = o0 + g, rb = o0 + g + 8;
    int nsb = n_in >> 5, nblk = nsb / SPB, nch = (nblk + BPC - 1) / BPC;
    size_t rac = valid ? (size_t)min(ra, n_out - 1) : 0, rbc = valid ? (size_t)min(rb, n_out - 1) : 0;
    const u32* wa = (const u32*)codes + rac * nsb * (KIND == 1 ? 1 : 2);
    const u32* wb = (const u32*)codes + rbc * nsb * (KIND == 1 ? 1 : 2);
    const u16* wsa = scales + rac * nblk;
    const u16* wsb = scales + rbc * nblk;
    int tb = min(g, n - 1), t0 = min(2 * tg, n - 1), t1 = min(2 * tg + 1, n - 1);
    const i8* qb = q + (size_t)tb * n_in + 8 * tg;
    const float* u0 = ua + (size_t)t0 * nblk;
    const float* u1 = ua + (size_t)t1 * nblk;
    const int* m0 = ma + (size_t)t0 * nsb;
    const int* m1 = ma + (size_t)t1 * nsb;
    float acc[BPC][4];
#pragma unroll
    for (int p = 0; p < BPC; ++p)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[p][e] = 0.f;
    for (int c = kp; valid && c < nch; c += KS) {
#pragma unroll
        for (int p = 0; p < BPC; ++p) {
            const int B = c * BPC + p;
            if (B < nblk) {
                int cb[4] = {0, 0, 0, 0};
#pragma unroll
                for (int jj = 0; jj < SPB; ++jj) {
                    const int j = B * SPB + jj;
                    u32 a0, a1, a2, a3;
                    if (KIND == 1) {
                        u32 xa = __ldg(wa + j), xb = __ldg(wb + j);
                        a0 = q1_plane(xa, 2 * tg);
                        a1 = q1_plane(xb, 2 * tg);
                        a2 = q1_plane(xa, 2 * tg + 1);
                        a3 = q1_plane(xb, 2 * tg + 1);
                    } else {
                        u32 xa = __ldg(wa + 2 * j + (tg >> 1)), xb = __ldg(wb + 2 * j + (tg >> 1));
                        int f = 2 * (tg & 1);
                        a0 = q2_plane(xa, f);
                        a1 = q2_plane(xb, f);
                        a2 = q2_plane(xa, f + 1);
                        a3 = q2_plane(xb, f + 1);
                    }
                    uint2 b = __ldg((const uint2*)(qb + (size_t)j * 32));
                    int d[4];
                    mma_s8_c(d, a0, a1, a2, a3, b.x, b.y, 0, 0);
                    const int mj0 = __ldg(m0 + j), mj1 = __ldg(m1 + j);
                    cb[0] += mj0 * d[0];
                    cb[1] += mj1 * d[1];
                    cb[2] += mj0 * d[2];
                    cb[3] += mj1 * d[3];
                }
                const float dwa = h2f(__ldg(wsa + B)), dwb = h2f(__ldg(wsb + B));
                const float ub0 = __ldg(u0 + B), ub1 = __ldg(u1 + B);
                acc[p][0] = fmaf(__fmul_rn(dwa, ub0), (float)cb[0], acc[p][0]);
                acc[p][1] = fmaf(__fmul_rn(dwa, ub1), (float)cb[1], acc[p][1]);
                acc[p][2] = fmaf(__fmul_rn(dwb, ub0), (float)cb[2], acc[p][2]);
                acc[p][3] = fmaf(__fmul_rn(dwb, ub1), (float)cb[3], acc[p][3]);
            }
        }
    }
    // the partials' tree: level w adds x[p + w] into x[p] (the butterfly's x[0])
    float v[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        float x[BPC];
#pragma unroll
        for (int p = 0; p < BPC; ++p) x[p] = acc[p][e];
#pragma unroll
        for (int lw = 1; lw < BPC; lw <<= 1)
#pragma unroll
            for (int p = 0; p < BPC; p += 2 * lw) x[p] = x[p] + x[p + lw];
        v[e] = x[0];
    }
    if (KS == 1) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            int o = e < 2 ? ra : rb, t = 2 * tg + (e & 1);
            if (valid && o < n_out && t < n) {
                float* yp = y + (size_t)t * n_out + o;
                *yp = accumulate ? *yp + v[e] : v[e];
            }
        }
        return;
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) part[w][e < 2 ? g : g + 8][2 * tg + (e & 1)] = v[e];
    __syncthreads();
    if (valid && kp == 0) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            int rr = e < 2 ? g : g + 8, t = 2 * tg + (e & 1), o = o0 + rr;
            if (o < n_out && t < n) {
                float xo = part[w][rr][t];
#pragma unroll
                for (int k2 = 1; k2 < KS; ++k2) xo += part[w + k2][rr][t];
                float* yp = y + (size_t)t * n_out + o;
                *yp = accumulate ? *yp + xo : xo;
            }
        }
    }
}

// codes / scales as mvq_*, y [n, n_out], q [n, n_in], u [n, n_in / BE], m [n, n_in / 32].
// grid ceil(n_out / (16 · MV_WARPS / KS)), block MV_WARPS warps.
#define MVQT_ENTRY(NAME, KIND, KS)                                                                    \
    extern "C" __global__ void __launch_bounds__(MV_WARPS * 32) NAME(                                 \
        const void* codes, const u16* scales, float* y, int n_out, const i8* q, const float* u,       \
        const int* m, int n_in, int n, int accumulate) {                                              \
        mvqt_lowbit<KIND, KS>(codes, scales, y, n_out, q, u, m, n_in, n, accumulate);                 \
    }
MVQT_ENTRY(mvqt_q1_k1, 1, 1)
MVQT_ENTRY(mvqt_q1_k2, 1, 2)
MVQT_ENTRY(mvqt_q2_k1, 2, 1)
MVQT_ENTRY(mvqt_q2_k2, 2, 2)
MVQT_ENTRY(mvqt_q2g64_k1, 3, 1)
MVQT_ENTRY(mvqt_q2g64_k2, 3, 2)
