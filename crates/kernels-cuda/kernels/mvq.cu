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
    constexpr int CW = SPB * (KIND == 1 ? 1 : 2);  // code words per row and block
    constexpr int NV = CW / 4;                      // 16-byte loads per row and block
    __shared__ float part[KS > 1 ? MV_WARPS : 1][MVQ_LG][R];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, ql = lane & 7, lg = lane >> 3;
    int kp = w % KS;
    int rg = (blockIdx.x * (MV_WARPS / KS) + w / KS) * MVQ_LG + lg;
    int o0 = rg * R;
    bool valid = o0 < n_out;
    int nsb = n_in >> 5, nblk = nsb / SPB, nch = (nblk + BPC - 1) / BPC;
    // per-row base pointers (rows past n_out clamped: loaded, never stored)
    const uint4* cb4[R];  // the row's code words, NV 16-byte vectors per block
    const u16* sp[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        size_t ro = valid ? (size_t)min(o0 + r, n_out - 1) : 0;
        cb4[r] = (const uint4*)codes + ro * (size_t)nblk * NV;
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
                // the block's sub-scales and code sums, then its code words per row (16-byte loads)
                int mv[SPB], sv[SPB];
                if (SPB == 4) {
                    const int4 m4 = __ldg((const int4*)ma + B), s4 = __ldg((const int4*)sa + B);
                    mv[0] = m4.x, mv[1] = m4.y, mv[2 % SPB] = m4.z, mv[3 % SPB] = m4.w;
                    sv[0] = s4.x, sv[1] = s4.y, sv[2 % SPB] = s4.z, sv[3 % SPB] = s4.w;
                } else {
                    const int2 m2 = __ldg((const int2*)ma + B), s2 = __ldg((const int2*)sa + B);
                    mv[0] = m2.x, mv[1 % SPB] = m2.y;
                    sv[0] = s2.x, sv[1 % SPB] = s2.y;
                }
                u32 cw[R][CW];
#pragma unroll
                for (int r = 0; r < R; ++r)
#pragma unroll
                    for (int v = 0; v < NV; ++v) {
                        const uint4 x = __ldg(cb4[r] + (size_t)B * NV + v);
                        cw[r][4 * v] = x.x, cw[r][4 * v + 1] = x.y, cw[r][4 * v + 2] = x.z, cw[r][4 * v + 3] = x.w;
                    }
                int isum[R];
#pragma unroll
                for (int r = 0; r < R; ++r) isum[r] = 0;
#pragma unroll
                for (int jj = 0; jj < SPB; ++jj) {
                    const int j = B * SPB + jj;
                    const int4* qa4 = (const int4*)(q + (size_t)j * 32);
                    int4 qa0 = __ldg(qa4), qa1 = __ldg(qa4 + 1);
                    int qa[8] = {qa0.x, qa0.y, qa0.z, qa0.w, qa1.x, qa1.y, qa1.z, qa1.w};
#pragma unroll
                    for (int r = 0; r < R; ++r) {
                        uint2 w2;
                        w2.x = cw[r][KIND == 1 ? jj : 2 * jj];
                        w2.y = KIND == 1 ? 0u : cw[r][(2 * jj + 1) % CW];
                        isum[r] += mv[jj] * sub_dot<KIND>(w2, qa, sv[jj]);
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
MVQ_ENTRY(mvq_q1_r4_k4, 1, 4, 4)
MVQ_ENTRY(mvq_q2_r4_k1, 2, 4, 1)
MVQ_ENTRY(mvq_q2_r4_k2, 2, 4, 2)
MVQ_ENTRY(mvq_q2_r4_k4, 2, 4, 4)
MVQ_ENTRY(mvq_q2g64_r4_k1, 3, 4, 1)
MVQ_ENTRY(mvq_q2g64_r4_k2, 3, 4, 2)
MVQ_ENTRY(mvq_q2g64_r4_k4, 3, 4, 4)

// The tensor-core verify kernel of the same order (n ≤ 8 activation rows; sub_emu::tile_mma):
// a warp owns one m16 tile of weight rows and all n rows (one n8 tile; columns ≥ n compute on a
// clamped row and are not stored), K part w mod KS. Per sub-block one mma.m16n8k32 with C = 0 (A:
// the signed codes of gemm.cu's q1_plane / q2_plane, B: 8 activation bytes of column g); each lane
// adds m_j(column) · D to its block's int32 fragment; per block one fma per C value into partial
// (block mod BPC), so a lane holds BPC × 4 partials (32; 64 for g64). Then the partials' tree
// (((P0 + P1) + (P2 + P3)) + ...) in the lane, the K parts in order. Row t of an n-row launch
// equals the one-row mvq kernel's value bit for bit.
// One block's small operands for one lane of mvqt (loaded a block ahead): the activation bytes of
// column tb per sub-block, the sub-scales of columns t0 / t1, the weight scales and units.
template <int KIND>
struct MvqtOps {
    static constexpr int SPB = KIND == 3 ? 2 : 4;
    uint2 b[SPB];
    int m0[SPB], m1[SPB];
    u16 dwa, dwb;
    float u0, u1;
};

template <int KIND>
__device__ __forceinline__ void mvqt_load_ops(MvqtOps<KIND>& k, int B, const u16* wsa, const u16* wsb,
                                              const i8* qb, const float* u0, const float* u1, const int* m0,
                                              const int* m1) {
    constexpr int SPB = MvqtOps<KIND>::SPB;
#pragma unroll
    for (int jj = 0; jj < SPB; ++jj) k.b[jj] = __ldg((const uint2*)(qb + (size_t)(B * SPB + jj) * 32));
    if (SPB == 4) {
        const int4 x = __ldg((const int4*)m0 + B), y = __ldg((const int4*)m1 + B);
        k.m0[0] = x.x, k.m0[1] = x.y, k.m0[2 % SPB] = x.z, k.m0[3 % SPB] = x.w;
        k.m1[0] = y.x, k.m1[1] = y.y, k.m1[2 % SPB] = y.z, k.m1[3 % SPB] = y.w;
    } else {
        const int2 x = __ldg((const int2*)m0 + B), y = __ldg((const int2*)m1 + B);
        k.m0[0] = x.x, k.m0[1 % SPB] = x.y;
        k.m1[0] = y.x, k.m1[1 % SPB] = y.y;
    }
    k.dwa = __ldg(wsa + B), k.dwb = __ldg(wsb + B);
    k.u0 = __ldg(u0 + B), k.u1 = __ldg(u1 + B);
}

#define MVQT_STAGES 8

// The tensor-core verify kernel of the same order (n ≤ 8 activation rows; sub_emu::tile_mma):
// a warp owns one m16 tile of weight rows and all n rows (one n8 tile; columns ≥ n compute on a
// clamped row and are not stored), K part w mod KS. Per sub-block one mma.m16n8k32 with C = 0 (A:
// the signed codes of gemm.cu's q1_plane / q2_plane, B: 8 activation bytes of column g); each lane
// adds m_j(column) · D to its block's int32 fragment; per block one fma per C value into partial
// (block mod BPC), so a lane holds BPC × 4 partials (32; 64 for g64). Then the partials' tree
// (((P0 + P1) + (P2 + P3)) + ...) in the lane, the K parts in order. Row t of an n-row launch
// equals the one-row mvq kernel's value bit for bit.
// Streaming: each warp keeps its own MVQT_STAGES-deep ring of code tiles in shared memory (one
// block's 16 rows × CW words per stage, 16-byte cp.async per lane, one commit group per block),
// so the loads in flight do not hold registers; the small operands come a block ahead.
template <int KIND, int KS>
__device__ __forceinline__ void mvqt_lowbit(const void* __restrict__ codes, const u16* __restrict__ scales,
                                            float* y, int n_out, const i8* __restrict__ q,
                                            const float* __restrict__ ua, const int* __restrict__ ma,
                                            int n_in, int n, int accumulate) {
    constexpr int SPB = KIND == 3 ? 2 : 4;
    constexpr int BPC = 32 / SPB;
    constexpr int CW = SPB * (KIND == 1 ? 1 : 2);  // code words per row and block
    constexpr int NV = CW / 4;                      // 16-byte vectors per row and block
    constexpr int S = MVQT_STAGES;
    const int G = MV_WARPS / KS;
    __shared__ float part[KS > 1 ? MV_WARPS : 1][16][8];
    __shared__ __align__(16) u32 ring[MV_WARPS][S][16 * CW];  // [warp][stage][row 16][CW words]
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, tg = lane & 3;
    int kp = w % KS;
    int o0 = (blockIdx.x * G + w / KS) * 16;
    bool valid = o0 < n_out;
    int nsb = n_in >> 5, nblk = nsb / SPB, nch = (nblk + BPC - 1) / BPC;
    // copy role: lane l moves 16-byte vector l (and l + 32) of a stage's tile: row v / NV, part v % NV
    const int cv = lane < 16 * NV ? lane : 0;
    const size_t crow = valid ? (size_t)min(o0 + cv / NV, n_out - 1) : 0;
    const uint4* csrc = (const uint4*)codes + crow * (size_t)nblk * NV + cv % NV;
    u32* const wring = &ring[w][0][0];
    const int ra = o0 + g, rb = o0 + g + 8;
    const size_t rac = valid ? (size_t)min(ra, n_out - 1) : 0, rbc = valid ? (size_t)min(rb, n_out - 1) : 0;
    const u16* wsa = scales + rac * nblk;
    const u16* wsb = scales + rbc * nblk;
    PDL_ENTRY();
    int tb = min(g, n - 1), t0 = min(2 * tg, n - 1), t1 = min(2 * tg + 1, n - 1);
    const i8* qb = q + (size_t)tb * n_in + 8 * tg;
    const float* u0 = ua + (size_t)t0 * nblk;
    const float* u1 = ua + (size_t)t1 * nblk;
    const int* m0 = ma + (size_t)t0 * nsb;
    const int* m1 = ma + (size_t)t1 * nsb;
    // block i of this K part: chunk kp + (i / BPC) · KS, position i mod BPC
    auto blk = [&](int i) { return (kp + (i / BPC) * KS) * BPC + i % BPC; };
    auto issue = [&](int i) {
        const int B = blk(i);
        if (valid && lane < 16 * NV && B < nblk)
            cp_async16(wring + (i % S) * (16 * CW) + cv * 4, csrc + (size_t)B * NV);
        cp_async_commit();
    };
    float acc[BPC][4];
#pragma unroll
    for (int p = 0; p < BPC; ++p)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[p][e] = 0.f;
#pragma unroll
    for (int s = 0; s < S - 1; ++s) issue(s);
    MvqtOps<KIND> cur;
    if (valid && kp < nch) mvqt_load_ops<KIND>(cur, kp * BPC, wsa, wsb, qb, u0, u1, m0, m1);
    int i = 0;
    for (int c = kp; valid && c < nch; c += KS) {
#pragma unroll
        for (int p = 0; p < BPC; ++p, ++i) {
            const int B = c * BPC + p;
            cp_async_wait<S - 2>();
            __syncwarp();
            u32 ca[CW], cb[CW];
            const u32* st = wring + (i % S) * (16 * CW);
#pragma unroll
            for (int v = 0; v < NV; ++v) {
                const uint4 x = *(const uint4*)(st + g * CW + 4 * v), z = *(const uint4*)(st + (g + 8) * CW + 4 * v);
                ca[4 * v] = x.x, ca[4 * v + 1] = x.y, ca[4 * v + 2] = x.z, ca[4 * v + 3] = x.w;
                cb[4 * v] = z.x, cb[4 * v + 1] = z.y, cb[4 * v + 2] = z.z, cb[4 * v + 3] = z.w;
            }
            __syncwarp();
            issue(i + S - 1);
            // the next block of this K part: B + 1 within the chunk, else the next chunk's first
            const int Bn = p + 1 < BPC ? B + 1 : (c + KS) * BPC;
            MvqtOps<KIND> nxt;
            if (Bn < nblk) mvqt_load_ops<KIND>(nxt, Bn, wsa, wsb, qb, u0, u1, m0, m1);
            if (B < nblk) {
                int cbv[4] = {0, 0, 0, 0};
#pragma unroll
                for (int jj = 0; jj < SPB; ++jj) {
                    u32 a0, a1, a2, a3;
                    if (KIND == 1) {
                        const u32 xa = ca[jj], xb = cb[jj];
                        a0 = q1_plane(xa, 2 * tg);
                        a1 = q1_plane(xb, 2 * tg);
                        a2 = q1_plane(xa, 2 * tg + 1);
                        a3 = q1_plane(xb, 2 * tg + 1);
                    } else {
                        const u32 xa = (tg & 2) ? ca[2 * jj + 1] : ca[2 * jj];
                        const u32 xb = (tg & 2) ? cb[2 * jj + 1] : cb[2 * jj];
                        const int f = 2 * (tg & 1);
                        a0 = q2_plane(xa, f);
                        a1 = q2_plane(xb, f);
                        a2 = q2_plane(xa, f + 1);
                        a3 = q2_plane(xb, f + 1);
                    }
                    int d[4];
                    mma_s8_c(d, a0, a1, a2, a3, cur.b[jj].x, cur.b[jj].y, 0, 0);
                    cbv[0] += cur.m0[jj] * d[0];
                    cbv[1] += cur.m1[jj] * d[1];
                    cbv[2] += cur.m0[jj] * d[2];
                    cbv[3] += cur.m1[jj] * d[3];
                }
                const float dwa = h2f(cur.dwa), dwb = h2f(cur.dwb);
                acc[p][0] = fmaf(__fmul_rn(dwa, cur.u0), (float)cbv[0], acc[p][0]);
                acc[p][1] = fmaf(__fmul_rn(dwa, cur.u1), (float)cbv[1], acc[p][1]);
                acc[p][2] = fmaf(__fmul_rn(dwb, cur.u0), (float)cbv[2], acc[p][2]);
                acc[p][3] = fmaf(__fmul_rn(dwb, cur.u1), (float)cbv[3], acc[p][3]);
            }
            cur = nxt;
        }
    }
    cp_async_wait<0>();
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
MVQT_ENTRY(mvqt_q1_k4, 1, 4)
MVQT_ENTRY(mvqt_q2_k1, 2, 1)
MVQT_ENTRY(mvqt_q2_k2, 2, 2)
MVQT_ENTRY(mvqt_q2_k4, 2, 4)
MVQT_ENTRY(mvqt_q2g64_k1, 3, 1)
MVQT_ENTRY(mvqt_q2g64_k2, 3, 2)
MVQT_ENTRY(mvqt_q2g64_k4, 3, 4)

// ---- experimental verify variants (`mvqx_*`, timing only: gpu_kernels::mv_sub_timing) ----------
// The same float order and bits as mvqt (the tests check every row against the one-row kernel),
// built to find what limits mvqt: UA = 1 takes the unsigned code as the A operand (bit / field)
// and corrects with the code sums (isum_j = 2·D − s_j for Q1, D − s_j for Q2: the same integer);
// TL = 2 gives a warp two m16 tiles (32 rows) that share every activation-side load. Both need
// whole chunks (n_in a multiple of 1,024), so no block is ragged: the chunk loop is unrolled with
// constant stage indices, the operands of the next block come a block ahead into a ping-pong pair.
template <int KIND, int TL>
struct MvqxOps {
    static constexpr int SPB = KIND == 3 ? 2 : 4;
    uint2 b[SPB];
    int m0[SPB], m1[SPB], s0[SPB], s1[SPB];
    float u0, u1;
    u16 dw[TL][2];
};

template <int KIND, int KS, int UA, int TL>
__device__ __forceinline__ void mvqx_lowbit(const void* __restrict__ codes, const u16* __restrict__ scales,
                                            float* y, int n_out, const i8* __restrict__ q,
                                            const float* __restrict__ ua, const int* __restrict__ ma,
                                            const int* __restrict__ sa, int n_in, int n, int accumulate) {
    constexpr int SPB = KIND == 3 ? 2 : 4;
    constexpr int BPC = 32 / SPB;
    constexpr int CW = SPB * (KIND == 1 ? 1 : 2);  // code words per row and block
    constexpr int NV = CW / 4;                      // 16-byte vectors per row and block
    constexpr int S = 8;
    constexpr int TR = 16 * TL;                     // rows per warp
    constexpr int CPL = (TR * NV + 31) / 32;        // 16-byte copies per lane and stage
    static_assert(BPC % S == 0, "a chunk is a whole number of ring turns");
    const int G = MV_WARPS / KS;
    __shared__ float part[KS > 1 ? MV_WARPS : 1][TR][8];
    __shared__ __align__(16) u32 ring[MV_WARPS][S][TR * CW];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, tg = lane & 3;
    const int kp = w % KS;
    const int o0 = (blockIdx.x * G + w / KS) * TR;
    const bool valid = o0 < n_out;
    const int nsb = n_in >> 5, nblk = nsb / SPB, nch = nblk / BPC;
    const uint4* csrc[CPL];
    bool cok[CPL];
#pragma unroll
    for (int i = 0; i < CPL; ++i) {
        const int v = lane + 32 * i;
        cok[i] = valid && v < TR * NV;
        const size_t row = valid ? (size_t)min(o0 + (cok[i] ? v : 0) / NV, n_out - 1) : 0;
        csrc[i] = (const uint4*)codes + row * (size_t)nblk * NV + (cok[i] ? v : 0) % NV;
    }
    u32* const wring = &ring[w][0][0];
    const int wofs = KIND == 1 ? 0 : (tg >> 1);  // Q2: the lane's word of a sub-block's pair
    const u16* ws[TL][2];
#pragma unroll
    for (int tt = 0; tt < TL; ++tt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
            ws[tt][hh] = scales + (valid ? (size_t)min(o0 + 16 * tt + 8 * hh + g, n_out - 1) : 0) * nblk;
    PDL_ENTRY();
    const int tb = min(g, n - 1), t0 = min(2 * tg, n - 1), t1 = min(2 * tg + 1, n - 1);
    const i8* qb = q + (size_t)tb * n_in + 8 * tg;
    const float* u0 = ua + (size_t)t0 * nblk;
    const float* u1 = ua + (size_t)t1 * nblk;
    const int* m0 = ma + (size_t)t0 * nsb;
    const int* m1 = ma + (size_t)t1 * nsb;
    const int* s0 = sa + (size_t)t0 * nsb;
    const int* s1 = sa + (size_t)t1 * nsb;
    auto load_ops = [&](MvqxOps<KIND, TL>& k, int B) {
#pragma unroll
        for (int jj = 0; jj < SPB; ++jj) k.b[jj] = __ldg((const uint2*)(qb + (size_t)(B * SPB + jj) * 32));
        if (SPB == 4) {
            const int4 x = __ldg((const int4*)m0 + B), z = __ldg((const int4*)m1 + B);
            k.m0[0] = x.x, k.m0[1] = x.y, k.m0[2 % SPB] = x.z, k.m0[3 % SPB] = x.w;
            k.m1[0] = z.x, k.m1[1] = z.y, k.m1[2 % SPB] = z.z, k.m1[3 % SPB] = z.w;
            if (UA) {
                const int4 a = __ldg((const int4*)s0 + B), c = __ldg((const int4*)s1 + B);
                k.s0[0] = a.x, k.s0[1] = a.y, k.s0[2 % SPB] = a.z, k.s0[3 % SPB] = a.w;
                k.s1[0] = c.x, k.s1[1] = c.y, k.s1[2 % SPB] = c.z, k.s1[3 % SPB] = c.w;
            }
        } else {
            const int2 x = __ldg((const int2*)m0 + B), z = __ldg((const int2*)m1 + B);
            k.m0[0] = x.x, k.m0[1 % SPB] = x.y;
            k.m1[0] = z.x, k.m1[1 % SPB] = z.y;
            if (UA) {
                const int2 a = __ldg((const int2*)s0 + B), c = __ldg((const int2*)s1 + B);
                k.s0[0] = a.x, k.s0[1 % SPB] = a.y;
                k.s1[0] = c.x, k.s1[1 % SPB] = c.y;
            }
        }
        k.u0 = __ldg(u0 + B), k.u1 = __ldg(u1 + B);
#pragma unroll
        for (int tt = 0; tt < TL; ++tt)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) k.dw[tt][hh] = __ldg(ws[tt][hh] + B);
    };
    float acc[TL][BPC][4];
#pragma unroll
    for (int tt = 0; tt < TL; ++tt)
#pragma unroll
        for (int p = 0; p < BPC; ++p)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[tt][p][e] = 0.f;
    const bool any = valid && kp < nch;
#pragma unroll
    for (int p = 0; p < S - 1; ++p) {
#pragma unroll
        for (int i = 0; i < CPL; ++i)
            if (cok[i] && kp < nch)
                cp_async16(wring + p * (TR * CW) + (lane + 32 * i) * 4, csrc[i] + (size_t)(kp * BPC + p) * NV);
        cp_async_commit();
    }
    MvqxOps<KIND, TL> ops[2];
    if (any) load_ops(ops[0], kp * BPC);
    for (int c = kp; any && c < nch; c += KS) {
        const int cb0 = c * BPC;
        const bool more = c + KS < nch;
        const int cn = more ? c + KS : c;
#pragma unroll
        for (int p = 0; p < BPC; ++p) {
            MvqxOps<KIND, TL>& cur = ops[p & 1];
            MvqxOps<KIND, TL>& nxt = ops[(p + 1) & 1];
            cp_async_wait<S - 2>();
            __syncwarp();
            u32 wd[TL][2][SPB];
            const u32* st = wring + (p % S) * (TR * CW) + wofs;
#pragma unroll
            for (int tt = 0; tt < TL; ++tt)
#pragma unroll
                for (int hh = 0; hh < 2; ++hh)
#pragma unroll
                    for (int jj = 0; jj < SPB; ++jj) wd[tt][hh][jj] = st[(16 * tt + 8 * hh + g) * CW + jj * (CW / SPB)];
            __syncwarp();
            {
                const int pn = p + S - 1;
#pragma unroll
                for (int i = 0; i < CPL; ++i)
                    if (cok[i] && (pn < BPC || more))
                        cp_async16(wring + (pn % S) * (TR * CW) + (lane + 32 * i) * 4,
                                   csrc[i] + (size_t)(pn < BPC ? cb0 + pn : cn * BPC + (pn - BPC)) * NV);
                cp_async_commit();
            }
            load_ops(nxt, p + 1 < BPC ? cb0 + p + 1 : cn * BPC);
            int y0 = 0, y1 = 0;  // UA: Σ_j m_j s_j of columns t0, t1
            if (UA) {
#pragma unroll
                for (int jj = 0; jj < SPB; ++jj) {
                    y0 += cur.m0[jj] * cur.s0[jj];
                    y1 += cur.m1[jj] * cur.s1[jj];
                }
            }
#pragma unroll
            for (int tt = 0; tt < TL; ++tt) {
                int x[4] = {0, 0, 0, 0};
#pragma unroll
                for (int jj = 0; jj < SPB; ++jj) {
                    const u32 xa = wd[tt][0][jj], xb = wd[tt][1][jj];
                    u32 a0, a1, a2, a3;
                    if (UA) {
                        const u32 mk = KIND == 1 ? 0x01010101u : 0x03030303u;
                        const int sh = KIND == 1 ? 2 * tg : 4 * (tg & 1), st2 = KIND == 1 ? 1 : 2;
                        const u32 ya = xa >> sh, yb = xb >> sh;
                        a0 = ya & mk, a1 = yb & mk, a2 = (ya >> st2) & mk, a3 = (yb >> st2) & mk;
                    } else if (KIND == 1) {
                        a0 = q1_plane(xa, 2 * tg), a1 = q1_plane(xb, 2 * tg);
                        a2 = q1_plane(xa, 2 * tg + 1), a3 = q1_plane(xb, 2 * tg + 1);
                    } else {
                        const int f = 2 * (tg & 1);
                        a0 = q2_plane(xa, f), a1 = q2_plane(xb, f);
                        a2 = q2_plane(xa, f + 1), a3 = q2_plane(xb, f + 1);
                    }
                    int d[4];
                    mma_s8_c(d, a0, a1, a2, a3, cur.b[jj].x, cur.b[jj].y, 0, 0);
                    x[0] += cur.m0[jj] * d[0];
                    x[1] += cur.m1[jj] * d[1];
                    x[2] += cur.m0[jj] * d[2];
                    x[3] += cur.m1[jj] * d[3];
                }
                const int f2 = UA && KIND == 1 ? 2 : 1;
                const int c0 = f2 * x[0] - y0, c1 = f2 * x[1] - y1, c2 = f2 * x[2] - y0, c3 = f2 * x[3] - y1;
                const float dwa = h2f(cur.dw[tt][0]), dwb = h2f(cur.dw[tt][1]);
                acc[tt][p][0] = fmaf(__fmul_rn(dwa, cur.u0), (float)c0, acc[tt][p][0]);
                acc[tt][p][1] = fmaf(__fmul_rn(dwa, cur.u1), (float)c1, acc[tt][p][1]);
                acc[tt][p][2] = fmaf(__fmul_rn(dwb, cur.u0), (float)c2, acc[tt][p][2]);
                acc[tt][p][3] = fmaf(__fmul_rn(dwb, cur.u1), (float)c3, acc[tt][p][3]);
            }
        }
    }
    cp_async_wait<0>();
    // per tile the partials' tree, then the K parts in order (as mvqt)
    float v[TL][4];
#pragma unroll
    for (int tt = 0; tt < TL; ++tt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            float xx[BPC];
#pragma unroll
            for (int p = 0; p < BPC; ++p) xx[p] = acc[tt][p][e];
#pragma unroll
            for (int lw = 1; lw < BPC; lw <<= 1)
#pragma unroll
                for (int p = 0; p < BPC; p += 2 * lw) xx[p] = xx[p] + xx[p + lw];
            v[tt][e] = xx[0];
        }
    if (KS == 1) {
#pragma unroll
        for (int tt = 0; tt < TL; ++tt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int o = o0 + 16 * tt + g + (e < 2 ? 0 : 8), t = 2 * tg + (e & 1);
                if (valid && o < n_out && t < n) {
                    float* yp = y + (size_t)t * n_out + o;
                    *yp = accumulate ? *yp + v[tt][e] : v[tt][e];
                }
            }
        return;
    }
#pragma unroll
    for (int tt = 0; tt < TL; ++tt)
#pragma unroll
        for (int e = 0; e < 4; ++e) part[w][16 * tt + g + (e < 2 ? 0 : 8)][2 * tg + (e & 1)] = v[tt][e];
    __syncthreads();
    if (valid && kp == 0) {
#pragma unroll
        for (int tt = 0; tt < TL; ++tt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int rr = 16 * tt + g + (e < 2 ? 0 : 8), t = 2 * tg + (e & 1), o = o0 + rr;
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

// as MVQT_ENTRY plus s [n, n_in / 32]; grid ceil(n_out / (16·TL · MV_WARPS / KS))
#define MVQX_ENTRY(NAME, KIND, KS, UA, TL)                                                              \
    extern "C" __global__ void __launch_bounds__(MV_WARPS * 32) NAME(                                 \
        const void* codes, const u16* scales, float* y, int n_out, const i8* q, const float* u,       \
        const int* m, const int* s, int n_in, int n, int accumulate) {                                \
        mvqx_lowbit<KIND, KS, UA, TL>(codes, scales, y, n_out, q, u, m, s, n_in, n, accumulate);      \
    }
#define MVQX_KS(K, KIND, UA, TL)                                  \
    MVQX_ENTRY(mvqx_##K##_u##UA##t##TL##_k1, KIND, 1, UA, TL)     \
    MVQX_ENTRY(mvqx_##K##_u##UA##t##TL##_k2, KIND, 2, UA, TL)     \
    MVQX_ENTRY(mvqx_##K##_u##UA##t##TL##_k4, KIND, 4, UA, TL)
MVQX_KS(q1, 1, 0, 1)
MVQX_KS(q1, 1, 1, 1)
MVQX_KS(q1, 1, 0, 2)
MVQX_KS(q1, 1, 1, 2)
MVQX_KS(q2, 2, 0, 1)
MVQX_KS(q2, 2, 1, 1)
MVQX_KS(q2, 2, 0, 2)
MVQX_KS(q2, 2, 1, 2)
