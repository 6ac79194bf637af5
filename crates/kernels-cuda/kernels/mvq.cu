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
                    acc[h][r] = fmaf(h2f(__ldg(sp[r] + B)) * ub, (float)isum[r], acc[h][r]);
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
