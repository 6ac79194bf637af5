// ---- "o8" mat-vec family (`mvo_*` decode, `mvt_*` verify; BONSAI_CUDA_MV_O8=1, off) ------------
// One float order that is cheap for BOTH a one-row dp4a kernel and an int8 tensor-core kernel, so
// a speculative verify (n <= 8 rows) can run on the tensor cores while decode keeps dp4a, and a
// verify row still equals the decode row bit for bit.
//
// The order, for weight row o and activation row t: sub-block j (32 elements) gives the exact
// integer isum_j (Q1 Σ sign·q, Q2 Σ (code − 1)·q) and adds into partial p = j mod 8 as
//   P_p = fma(dw_o,blk(j) ⊗ dt_t,j, float(isum_j), P_p)      (⊗ an f32 multiply, j increasing)
// over the sub-blocks of K part kp (chunk c = j / 8 belongs to part c mod KS). A part is
//   ((P0 + P4) + (P2 + P6)) + ((P1 + P5) + (P3 + P7))
// (the xor-butterfly 4, 2, 1 over 8 lanes; every lane ends with this value, by commutativity), and
// the row's value is part 0 + part 1 + ... in order. The existing dp4a order has 32 partials (lane l
// takes j ≡ l mod 32): a tensor-core kernel would need 128 accumulator registers per thread for it,
// 8 partials need 32.
//
// mvo (n = 1): lane = 8·gq + p; lane group gq owns RR weight rows, lane p its sub-blocks j ≡ p
// (mod 8): the 8 lanes of a group read 8 consecutive code words (one 32-byte sector) per row.
// mvt (n <= 8): a warp owns one m16 tile of weight rows; per sub-block one m16n8k32 MMA (fragment
// mapping and the exact int-to-float of gemm.cu), the 8 partials × 4 C values in registers.

template <int KIND, int RR, int U, int KS>
__device__ __forceinline__ void mv_o8_dp4a(MvSeg s0, MvSeg s1, MvSeg s2, MvSeg s3, const i8* __restrict__ q,
                                           const float* __restrict__ da, const int* __restrict__ sa,
                                           int n_in, int accumulate, int pre) {
    const int BE = KIND == 3 ? 64 : 128;
    const int SPB = BE / 32;
    const int R = 4 * RR;             // rows per warp unit: 4 lane groups × RR
    const int G = MV_WARPS / KS;      // warp units per block
    __shared__ float part[KS > 1 ? MV_WARPS : 1][R];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    int gq = lane >> 3, p = lane & 7;
    int kp = w % KS;
    MvSeg sg = s0;
    int u0 = 0;  // the warp unit's first row in its segment
    bool valid = mv_seg_group<R>(blockIdx.x * G + w / KS, s0, s1, s2, s3, sg, u0);
    if (!valid && KS == 1) return;
    int o0 = u0 + gq * RR;  // this lane group's first row
    int nsb = n_in >> 5, nblk = n_in / BE;
    const u32* cp1[RR];
    const uint2* cp2[RR];
    const u16* sp[RR];
#pragma unroll
    for (int r = 0; r < RR; ++r) {
        size_t ro = valid ? (size_t)min(o0 + r, sg.n_out - 1) : 0;
        cp1[r] = (const u32*)sg.codes + ro * nsb;
        cp2[r] = (const uint2*)sg.codes + ro * nsb;
        sp[r] = sg.scales + ro * nblk;
    }
    float acc[RR];
#pragma unroll
    for (int r = 0; r < RR; ++r) acc[r] = 0.f;
    // this part's chunks c = kp, kp + KS, ...; lane p takes sub-block 8c + p; U chunks per batch
    const int STEP = 8 * KS;
    uint2 c[U][RR];
    float dw[U][RR];
    auto load_w = [&](int j0) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            int j = j0 + STEP * u;
#pragma unroll
            for (int r = 0; r < RR; ++r) {
                c[u][r] = make_uint2(0u, 0u);
                dw[u][r] = 0.f;
                if (j < nsb) {
                    if (KIND == 1) {
                        c[u][r].x = __ldg(cp1[r] + j);
                    } else {
                        c[u][r] = __ldg(cp2[r] + j);
                    }
                    dw[u][r] = h2f(__ldg(sp[r] + j / SPB));
                }
            }
        }
    };
    int jfirst = 8 * kp + p;
    if (pre) {
        if (valid) load_w(jfirst);
        PDL_ENTRY();
    } else {
        PDL_ENTRY();
        if (valid) load_w(jfirst);
    }
    for (int j0 = jfirst; valid && j0 < nsb; j0 += STEP * U) {
        if (j0 != jfirst) load_w(j0);
#pragma unroll
        for (int u = 0; u < U; ++u) {
            int j = j0 + STEP * u;
            if (j < nsb) {
                const int4* qa4 = (const int4*)(q + (size_t)j * 32);
                int4 qa0 = __ldg(qa4), qa1 = __ldg(qa4 + 1);
                int qa[8] = {qa0.x, qa0.y, qa0.z, qa0.w, qa1.x, qa1.y, qa1.z, qa1.w};
                float dt = __ldg(da + j);
                int st = __ldg(sa + j);
#pragma unroll
                for (int r = 0; r < RR; ++r) {
                    int isum = sub_dot<KIND>(c[u][r], qa, st);
                    acc[r] = fmaf(__fmul_rn(dw[u][r], dt), (float)isum, acc[r]);
                }
            }
        }
    }
    // partials → the butterfly over the 8 lanes of the group (xor 4, 2, 1) → parts in order
#pragma unroll
    for (int r = 0; r < RR; ++r) {
        float v = acc[r];
        v += __shfl_xor_sync(0xffffffffu, v, 4);
        v += __shfl_xor_sync(0xffffffffu, v, 2);
        v += __shfl_xor_sync(0xffffffffu, v, 1);
        if (KS == 1) {
            if (valid && p == 0 && o0 + r < sg.n_out) {
                float* yp = sg.y + o0 + r;
                *yp = accumulate ? *yp + v : v;
            }
        } else if (p == 0) {
            part[w][gq * RR + r] = v;
        }
    }
    if (KS > 1) {
        __syncthreads();
        if (valid && kp == 0 && lane < R) {
            int o = u0 + lane;
            if (o < sg.n_out) {
                float v = part[w][lane];
#pragma unroll
                for (int k2 = 1; k2 < KS; ++k2) v += part[w + k2][lane];
                float* yp = sg.y + o;
                *yp = accumulate ? *yp + v : v;
            }
        }
    }
}

// The tensor-core kernel of the same order: a warp owns 16 weight rows (one m16 tile of a segment)
// and all n <= 8 activation rows (one n8 tile; columns >= n compute on a clamped row and are not
// stored), K part kp. Thread (g, tg) holds C values (row g, cols 2tg, 2tg + 1) and (row g + 8,
// same cols) for each of the 8 partials.
template <int KIND, int KS>
__device__ __forceinline__ void mv_o8_tc(MvSeg s0, MvSeg s1, MvSeg s2, MvSeg s3, const i8* __restrict__ q,
                                         const float* __restrict__ da, int n_in, int n, int accumulate) {
    const int BE = KIND == 3 ? 64 : 128;
    const int SPB = BE / 32;
    const int G = MV_WARPS / KS;
    __shared__ float part[KS > 1 ? MV_WARPS : 1][16][8];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, tg = lane & 3;
    int kp = w % KS;
    MvSeg sg = s0;
    int o0 = 0;  // the tile's first row in its segment
    bool valid = mv_seg_group<16>(blockIdx.x * G + w / KS, s0, s1, s2, s3, sg, o0);
    PDL_ENTRY();
    if (!valid && KS == 1) return;
    int ra = o0 + g, rb = o0 + g + 8;
    int nsb = n_in >> 5, nblk = n_in / BE;
    size_t rac = valid ? (size_t)min(ra, sg.n_out - 1) : 0, rbc = valid ? (size_t)min(rb, sg.n_out - 1) : 0;
    // Q1: one u32 per sub-block; Q2: this thread's word (tg >> 1) of the sub-block's two
    const u32* wa = (const u32*)sg.codes + rac * nsb * (KIND == 1 ? 1 : 2);
    const u32* wb = (const u32*)sg.codes + rbc * nsb * (KIND == 1 ? 1 : 2);
    const u16* wsa = sg.scales + rac * nblk;
    const u16* wsb = sg.scales + rbc * nblk;
    // activation rows: B column g, C columns 2tg and 2tg + 1 (clamped to n − 1 for loads)
    int tb = min(g, n - 1), t0 = min(2 * tg, n - 1), t1 = min(2 * tg + 1, n - 1);
    const i8* qb = q + (size_t)tb * n_in + 8 * tg;
    const float* d0 = da + (size_t)t0 * nsb;
    const float* d1 = da + (size_t)t1 * nsb;
    float acc[8][4];
#pragma unroll
    for (int s = 0; s < 8; ++s)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[s][e] = 0.f;
    for (int c = kp; valid && 8 * c < nsb; c += KS) {
#pragma unroll
        for (int s = 0; s < 8; ++s) {
            int j = 8 * c + s;
            if (j < nsb) {
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
                mma_s8_magic(d, a0, a1, a2, a3, b.x, b.y);
                float dwa = h2f(__ldg(wsa + j / SPB)), dwb = h2f(__ldg(wsb + j / SPB));
                float dt0 = __ldg(d0 + j), dt1 = __ldg(d1 + j);
                acc[s][0] = fmaf(__fmul_rn(dwa, dt0), __fadd_rn(__int_as_float(d[0]), -GM_MAGIC_F), acc[s][0]);
                acc[s][1] = fmaf(__fmul_rn(dwa, dt1), __fadd_rn(__int_as_float(d[1]), -GM_MAGIC_F), acc[s][1]);
                acc[s][2] = fmaf(__fmul_rn(dwb, dt0), __fadd_rn(__int_as_float(d[2]), -GM_MAGIC_F), acc[s][2]);
                acc[s][3] = fmaf(__fmul_rn(dwb, dt1), __fadd_rn(__int_as_float(d[3]), -GM_MAGIC_F), acc[s][3]);
            }
        }
    }
    float v[4];
#pragma unroll
    for (int e = 0; e < 4; ++e)
        v[e] = ((acc[0][e] + acc[4][e]) + (acc[2][e] + acc[6][e])) + ((acc[1][e] + acc[5][e]) + (acc[3][e] + acc[7][e]));
    if (KS == 1) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            int o = e < 2 ? ra : rb, t = 2 * tg + (e & 1);
            if (o < sg.n_out && t < n) {
                float* yp = sg.y + (size_t)t * sg.n_out + o;
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
            if (o < sg.n_out && t < n) {
                float x = part[w][rr][t];
#pragma unroll
                for (int k2 = 1; k2 < KS; ++k2) x += part[w + k2][rr][t];
                float* yp = sg.y + (size_t)t * sg.n_out + o;
                *yp = accumulate ? *yp + x : x;
            }
        }
    }
}

// Variants: mvo RR = 1, 2 or 4 rows per lane group (4, 8 or 16 rows per warp unit), U = 4 chunks in
// flight; mvt one m16 tile per warp. Both with K split KS = 1, 2, 4 (the same KS gives the same
// order in both).
#define MVO_ENTRY(NAME, KIND, RR, KS, MINB)           \
    MV_SEG_ENTRY(NAME, MV_WARPS, MINB, const i8*, q, \
                 mv_o8_dp4a<KIND, RR, 4, KS>(s0, s1, s2, s3, q, da, sa, n_in, accumulate, pre))
#define MVT_ENTRY(NAME, KIND, KS)                 \
    MV_SEG_ENTRY(NAME, MV_WARPS, 2, const i8*, q, \
                 mv_o8_tc<KIND, KS>(s0, s1, s2, s3, q, da, n_in, n, accumulate))
#define MVO_KIND_ENTRIES(K, KIND)             \
    MVO_ENTRY(mvo_##K##_r1_k1, KIND, 1, 1, 6) \
    MVO_ENTRY(mvo_##K##_r1_k2, KIND, 1, 2, 6) \
    MVO_ENTRY(mvo_##K##_r1_k4, KIND, 1, 4, 6) \
    MVO_ENTRY(mvo_##K##_r2_k1, KIND, 2, 1, 5) \
    MVO_ENTRY(mvo_##K##_r2_k2, KIND, 2, 2, 5) \
    MVO_ENTRY(mvo_##K##_r2_k4, KIND, 2, 4, 5) \
    MVO_ENTRY(mvo_##K##_r4_k1, KIND, 4, 1, 4) \
    MVO_ENTRY(mvo_##K##_r4_k2, KIND, 4, 2, 4) \
    MVO_ENTRY(mvo_##K##_r4_k4, KIND, 4, 4, 4) \
    MVT_ENTRY(mvt_##K##_k1, KIND, 1)          \
    MVT_ENTRY(mvt_##K##_k2, KIND, 2)          \
    MVT_ENTRY(mvt_##K##_k4, KIND, 4)
MVO_KIND_ENTRIES(q1, 1)
MVO_KIND_ENTRIES(q2, 2)
MVO_KIND_ENTRIES(q2g64, 3)
