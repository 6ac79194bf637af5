// ---- tensor-core verify in the dp4a float order (`mvc_*`; Gpu::mvc) --------------------------------
// Verify rows (2 <= n <= MAXN) of the low-bit mat-vec on the tensor cores that equal the dp4a
// one-row launches (mv_lowbit, and mvp / mvs, which keep its order) bit for bit.
//
// The dp4a order (mv_lowbit with K split KS): lane l of the warp of K part kp owns chain l, the
// sub-blocks j = 32c + l of the chunks c ≡ kp (mod KS), in increasing c:
//     acc_l = fmaf(dw(o, j) · dt(t, j), (float) isum(o, t, j), acc_l)      from acc_l = 0
// then warp_sum's butterfly (xor 16, 8, 4, 2, 1), then the K parts added in order kp = 0, 1, ..
// isum is an exact integer, so any exact way of computing it gives the same bits. Here one
// mma.m16n8k32 per sub-block computes it for 16 weight rows × 8 activation rows, with mvm.cu's
// fragments: A the codes unpacked to non-negative bytes (mvm_unpack), B the activation bytes
// 8tg .. 8tg + 7 of activation row g, C = MAGIC − s(t, j), so D read as f32 minus MAGIC is isum.
//
// What kept the tensor cores out of this order before (mvm / o8 changed the order instead): a
// thread holds 4 C values, and the order needs 32 separate chains of each, 128 accumulators. Here
// the chains are split over warps (below), stored to shared memory, and one thread per (row,
// activation row) adds the 32 chains of each K part in the butterfly's tree, then the parts in order.
// The butterfly's result at any lane is the tree below (a + b == b + a in IEEE f32):
//     v_l = c_l + c_{l+16} (l < 16), then v_l + v_{l+8} (l < 8), .., v_0 + v_1.
//
// Block = one m16 tile (16 consecutive rows of one segment; tiles never straddle segments) ×
// 32 / CPW warps; warp wc runs chains CPW·wc .. + CPW of every K part (KS × CPW × 4 accumulators
// a thread), walking all chunks in order, chunk c into part c mod KS. The block first copies the
// tile's f16 weight scales into shared memory; each warp streams its chains' code bytes of the 16
// rows through a private MVC_STAGES-deep cp.async ring (no block barrier in the loop), with the
// scales and the first `pre` stages requested before the PDL wait (weights are never written on
// the device). A one-chunk-ahead register prefetch was measured first: with only 256-512 bytes
// of weights in flight per warp the kernel was 2× slower than the dp4a n-row kernels. Per chain
// the activation bytes, scales and sums come from L1 / L2. Columns >= n compute on a clamped row
// and are never stored.
//
// Alignment (the launcher checks, else the dp4a kernel runs): codes 16 bytes (every row of a
// re-tiled plane is), q 8 bytes, d and s 16 bytes on Q1_0 / Q2_0 g128 (4 on g64, read one by one).
// Shared memory: see `mvc_smem` in lib.rs.

// Dynamic shared memory of a block (the launcher's `mvc_smem` computes the same): the tile's weight
// scales [16][nblk] u16 (padded to 16 bytes), then the warps' code rings [WARPS][S][16][RB] bytes,
// whose space the chains' results [KS][32][16][n] f32 reuse after the loop.
#define MVC_STAGES 8

template <int KIND, int KS, int CPW>
__device__ __forceinline__ void mv_chain_tc(MvSeg s0, MvSeg s1, MvSeg s2, MvSeg s3, const i8* __restrict__ q,
                                            const float* __restrict__ da, const int* __restrict__ sa, int n_in,
                                            int n, int accumulate, int pre) {
    constexpr int BE = KIND == 3 ? 64 : 128;  // elements per scale block
    constexpr int SPB = BE / 32;              // sub-blocks per scale block
    constexpr int WPC = KIND == 1 ? 1 : 2;    // code words per sub-block
    constexpr int WARPS = 32 / CPW;
    constexpr int RB = CPW * 4 * WPC;         // code bytes of a warp's chains per row and chunk
    constexpr int PR = RB / 16;               // 16-byte pieces per row and chunk
    constexpr int S = MVC_STAGES;
    extern __shared__ __align__(16) unsigned char mvc_smem[];
    const int lane = threadIdx.x & 31, wc = threadIdx.x >> 5, g = lane >> 2, tg = lane & 3;
    MvSeg sg = s0;
    int o0 = 0;  // the tile's first row in its segment
    const bool valid = mv_seg_group<16>(blockIdx.x, s0, s1, s2, s3, sg, o0);
    const int nsb = n_in >> 5, nblk = n_in / BE, nch = (nsb + 31) >> 5;
    u16* ssc = (u16*)mvc_smem;                                       // [16][nblk]
    unsigned char* rings = mvc_smem + ((16 * nblk * 2 + 15) & ~15);  // [WARPS][S][16][RB]
    unsigned char* ring = rings + wc * (S * 16 * RB);
    float* red = (float*)rings;  // after the loop: [KS][32 chains][16 rows][n]
    // this warp's code pieces of chunk c into ring slot c mod S (16-byte cp.async; pieces past
    // the row's end are skipped: their chains are never read), then one commit per lane
    const u8* cbase = (const u8*)sg.codes;
    const size_t rowb = (size_t)nsb * 4 * WPC;
    auto issue = [&](int c) {
        if (c < nch) {
            unsigned char* slot = ring + (c % S) * (16 * RB);
            const int b0 = (32 * c + CPW * wc) * 4 * WPC;  // first byte of the chains in a row
#pragma unroll
            for (int k = 0; k < (16 * PR + 31) / 32; ++k) {
                const int piece = lane + 32 * k, r = piece / PR, pp = piece % PR;
                if (piece < 16 * PR && (size_t)(b0 + 16 * pp) < rowb) {
                    const size_t row = (size_t)min(o0 + r, sg.n_out - 1);
                    cp_async16(slot + r * RB + 16 * pp, cbase + row * rowb + b0 + 16 * pp);
                }
            }
        }
        cp_async_commit();
    };
    // `pre` (0..S−1): how many ring stages to request before the PDL wait (the scales too when
    // > 0); the rest of the first S − 1 after it
    const int np = min(max(pre, 0), S - 1);
    auto load_scales = [&]() {
        // the tile's scales (plain loads: a scale plane may start at any even address)
        for (int i = threadIdx.x; i < 16 * nblk; i += WARPS * 32) {
            const int r = i / nblk;
            ssc[i] = __ldg(sg.scales + (size_t)min(o0 + r, sg.n_out - 1) * nblk + (i - r * nblk));
        }
    };
    if (valid && np > 0) {
        load_scales();
        for (int c = 0; c < np; ++c) issue(c);
    }
    PDL_ENTRY();
    if (valid) {
        if (np == 0) load_scales();
        for (int c = np; c < S - 1; ++c) issue(c);
    }
    if (!valid) return;  // the whole block is one tile: no barrier is left waiting
    __syncthreads();     // the scales
    // activation rows: B column g, C columns 2tg and 2tg + 1 (clamped to n − 1 for the loads)
    const int tb = min(g, n - 1), t0 = min(2 * tg, n - 1), t1 = min(2 * tg + 1, n - 1);
    const i8* qb = q + (size_t)tb * n_in + 8 * tg;
    const float* d0 = da + (size_t)t0 * nsb;
    const float* d1 = da + (size_t)t1 * nsb;
    const int* e0 = sa + (size_t)t0 * nsb;
    const int* e1 = sa + (size_t)t1 * nsb;
    const u16* sca = ssc + g * nblk;
    const u16* scb = ssc + (g + 8) * nblk;
    float acc[KS][CPW][4];
#pragma unroll
    for (int p = 0; p < KS; ++p)
#pragma unroll
        for (int i = 0; i < CPW; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[p][i][e] = 0.f;
    // chunk c goes to K part c mod KS (the chunks a K-split dp4a warp of that part takes)
    for (int cc = 0; cc < nch; cc += KS) {
#pragma unroll
        for (int p = 0; p < KS; ++p) {
            const int c = cc + p;
            if (c < nch) {
                const int j0 = 32 * c + CPW * wc;
                // the chains' activations (L1 / L2), issued before the wait for the codes: the
                // scales and sums of columns t0 / t1 four chains at a time where the chunk is whole
                // and rows are 16-byte aligned (nsb % 4 == 0: Q1_0, Q2_0 g128), else one by one
                uint2 bq[CPW];
                float x0[CPW], x1[CPW];
                int m0[CPW], m1[CPW];
#pragma unroll
                for (int i = 0; i < CPW; ++i) {
                    const int j = min(j0 + i, nsb - 1);
                    bq[i] = __ldg((const uint2*)(qb + (size_t)j * 32));
                }
                if (KIND != 3 && j0 + CPW <= nsb) {
#pragma unroll
                    for (int k = 0; k < CPW / 4; ++k) {
                        const float4 p0 = __ldg((const float4*)(d0 + j0) + k);
                        const float4 p1 = __ldg((const float4*)(d1 + j0) + k);
                        const int4 r0 = __ldg((const int4*)(e0 + j0) + k);
                        const int4 r1 = __ldg((const int4*)(e1 + j0) + k);
                        x0[4 * k] = p0.x, x0[4 * k + 1] = p0.y, x0[4 * k + 2] = p0.z, x0[4 * k + 3] = p0.w;
                        x1[4 * k] = p1.x, x1[4 * k + 1] = p1.y, x1[4 * k + 2] = p1.z, x1[4 * k + 3] = p1.w;
                        m0[4 * k] = r0.x, m0[4 * k + 1] = r0.y, m0[4 * k + 2] = r0.z, m0[4 * k + 3] = r0.w;
                        m1[4 * k] = r1.x, m1[4 * k + 1] = r1.y, m1[4 * k + 2] = r1.z, m1[4 * k + 3] = r1.w;
                    }
                } else {
#pragma unroll
                    for (int i = 0; i < CPW; ++i) {
                        const int j = min(j0 + i, nsb - 1);
                        x0[i] = __ldg(d0 + j), x1[i] = __ldg(d1 + j);
                        m0[i] = __ldg(e0 + j), m1[i] = __ldg(e1 + j);
                    }
                }
                // the weight scales of the chains' blocks (j0 is a multiple of CPW, so of SPB)
                float wsa[CPW / SPB], wsb[CPW / SPB];
#pragma unroll
                for (int b = 0; b < CPW / SPB; ++b) {
                    const int blk = min(j0 / SPB + b, nblk - 1);
                    wsa[b] = h2f(sca[blk]), wsb[b] = h2f(scb[blk]);
                }
                cp_async_wait<S - 2>();  // this lane's pieces of chunk c have landed
                __syncwarp();            // and every lane's (slot (c − 1) mod S is free again)
                issue(c + S - 1);
                const unsigned char* slot = ring + (c % S) * (16 * RB);
                u32 xa[CPW], xb[CPW];
                if (KIND == 1) {
#pragma unroll
                    for (int k = 0; k < CPW / 4; ++k) {
                        const uint4 va = *(const uint4*)(slot + g * RB + 16 * k);
                        const uint4 vb = *(const uint4*)(slot + (g + 8) * RB + 16 * k);
                        xa[4 * k] = va.x, xa[4 * k + 1] = va.y, xa[4 * k + 2] = va.z, xa[4 * k + 3] = va.w;
                        xb[4 * k] = vb.x, xb[4 * k + 1] = vb.y, xb[4 * k + 2] = vb.z, xb[4 * k + 3] = vb.w;
                    }
                } else {
                    // two words per sub-block; this thread's is word tg >> 1
                    const bool hi = tg >> 1;
#pragma unroll
                    for (int k = 0; k < CPW / 2; ++k) {
                        const uint4 va = *(const uint4*)(slot + g * RB + 16 * k);
                        const uint4 vb = *(const uint4*)(slot + (g + 8) * RB + 16 * k);
                        xa[2 * k] = hi ? va.y : va.x, xa[2 * k + 1] = hi ? va.w : va.z;
                        xb[2 * k] = hi ? vb.y : vb.x, xb[2 * k + 1] = hi ? vb.w : vb.z;
                    }
                }
#pragma unroll
                for (int i = 0; i < CPW; ++i) {
                    const int j = j0 + i;
                    if (j < nsb) {  // uniform over the warp: every thread runs the MMA or none does
                        u32 la, ha, lb, hb;
                        mvm_unpack<KIND>(xa[i], tg, la, ha);
                        mvm_unpack<KIND>(xb[i], tg, lb, hb);
                        int d[4];
                        mma_s8_c(d, la, lb, ha, hb, bq[i].x, bq[i].y, GM_MAGIC - m0[i], GM_MAGIC - m1[i]);
                        const float wA = wsa[i / SPB], wB = wsb[i / SPB];
                        float(&a)[4] = acc[p][i];
                        a[0] = fmaf(__fmul_rn(wA, x0[i]), __fadd_rn(__int_as_float(d[0]), -GM_MAGIC_F), a[0]);
                        a[1] = fmaf(__fmul_rn(wA, x1[i]), __fadd_rn(__int_as_float(d[1]), -GM_MAGIC_F), a[1]);
                        a[2] = fmaf(__fmul_rn(wB, x0[i]), __fadd_rn(__int_as_float(d[2]), -GM_MAGIC_F), a[2]);
                        a[3] = fmaf(__fmul_rn(wB, x1[i]), __fadd_rn(__int_as_float(d[3]), -GM_MAGIC_F), a[3]);
                    }
                }
            }
        }
    }
    cp_async_wait<0>();
    __syncthreads();  // every warp is done with its ring: the chains' results take the space
#pragma unroll
    for (int p = 0; p < KS; ++p)
#pragma unroll
        for (int i = 0; i < CPW; ++i) {
            float* r = red + (size_t)(p * 32 + CPW * wc + i) * 16 * n;
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int rr = e < 2 ? g : g + 8, t = 2 * tg + (e & 1);
                if (t < n) r[rr * n + t] = acc[p][i][e];
            }
        }
    __syncthreads();
    // one thread per (weight row, activation row): the butterfly's tree, then the K parts in order
    if (threadIdx.x < 16 * MAXN) {
        const int rr = threadIdx.x / MAXN, t = threadIdx.x % MAXN, o = o0 + rr;
        if (o < sg.n_out && t < n) {
            float y = 0.f;
#pragma unroll
            for (int p = 0; p < KS; ++p) {
                float v[32];
#pragma unroll
                for (int l = 0; l < 32; ++l) v[l] = red[((p * 32 + l) * 16 + rr) * n + t];
#pragma unroll
                for (int lvl = 0; lvl < 5; ++lvl) {
                    const int h = 16 >> lvl;
#pragma unroll
                    for (int l = 0; l < 16; ++l)
                        if (l < h) v[l] = v[l] + v[l + h];
                }
                y = p == 0 ? v[0] : y + v[0];
            }
            float* yp = sg.y + (size_t)t * sg.n_out + o;
            *yp = accumulate ? *yp + y : y;
        }
    }
}

// Variants: K split 1 and 2 (the dp4a default plans' splits) with 4 chains per warp (8 warps a
// block), and K split 1 with 8 chains per warp (4 warps). A warp runs its chains in every K part.
// K split 2 compiled for 3 blocks per SM (80 registers, some spilled) and, `_b2`, for 2 (none).
#define MVC_ENTRY(NAME, KIND, KS, CPW, MINB)                    \
    MV_SEG_ENTRY(NAME, 32 / (CPW), MINB, const i8*, q,          \
                 mv_chain_tc<KIND, KS, CPW>(s0, s1, s2, s3, q, da, sa, n_in, n, accumulate, pre))
#define MVC_KIND_ENTRIES(K, KIND)                \
    MVC_ENTRY(mvc_##K##_k1_c4, KIND, 1, 4, 3)    \
    MVC_ENTRY(mvc_##K##_k2_c4, KIND, 2, 4, 3)    \
    MVC_ENTRY(mvc_##K##_k2_c4_b2, KIND, 2, 4, 2) \
    MVC_ENTRY(mvc_##K##_k1_c8, KIND, 1, 8, 4)
MVC_KIND_ENTRIES(q1, 1)
MVC_KIND_ENTRIES(q2, 2)
MVC_KIND_ENTRIES(q2g64, 3)
