// ---- DSpark drafter: Q4_1 mat-vec on the tensor cores (`mvt_q41`, n <= 8 activation rows) --------
// (mbar_*, bulk_g2s of mvs.cu, mma_u8s8_k32 of mvbp.cu and lo_h / hi_h of bonsai.cu are in scope.)
//
// `mv_q41` (spec.cu) gives every weight row its own dp4a chain per activation row and reads its
// weights through registers, two blocks per lane at a time: on the drafter's 5,120-row launches
// that is ~1.2 TB/s. This kernel shares each activation load among 16 rows on the tensor cores and
// streams the weights through the bulk copy engine. Opt-in (`BONSAI_CUDA_Q41_TC=1`): it drafts
// faster, but its cost does not shrink with the row count, and the 1-row context staging of a
// rejected round made the 27B round cost the same (crates/kernels-cuda/README.md).
//
// Layout (`retile_q41t` in q41t.rs): ceil(n_out / 16) tiles of 16 rows (rows past n_out are
// zero); a tile is np records of Q41T_REC = 640 bytes, one per pair of 32-element blocks (2p, 2p + 1),
// np = ceil(nb / 2) rounded up to a multiple of Q41T_C (the blocks past nb are zero), all of a
// tile's records contiguous:
//   bytes   0..511  uint4 for lane l = 4g + tg: a word of rows g and g + 8 of block 2p, then of
//                   block 2p + 1, whose byte i holds the codes of elements 8tg + i (low nibble) and
//                   8tg + 4 + i (high nibble);
//   bytes 512..639  uint4 for g: the (d | m << 16) f16 pairs of rows g and g + 8 of block 2p, then of
//                   block 2p + 1.
// The MMA's k index is a permutation of the block's elements: k = 4tg + i is element 8tg + i and
// k = 16 + 4tg + i element 8tg + 4 + i, the same for A and B, so the sum is the block's. The word
// masked with 0x0f0f0f0f is then the A register a0 / a1 and shifted right by 4 and masked a2 / a3,
// and lane (g, tg)'s B registers (b0, b1) are activation row g's 8 bytes at element 8tg: one 8-byte
// load. One `mma.u8.s8` per block gives the exact Σ_j q_w·q_a of 16 weight rows × 8 activation rows
// (B column g = activation row g, zero past n).
//
// Block (Q41T_WARPS warps) = one tile, its records in chunks of Q41T_C (a chunk is one stage):
// warp w takes the chunks [w·nch / W, (w + 1)·nch / W) and streams them through its own ring of
// Q41T_S stages (lane 0 asks the bulk copy engine for each, completing on the warp's mbarrier of
// that slot; the first ones before the PDL wait when `pre`, as weights are never written on the
// device). A stage's 8 blocks run without a branch, so the compiler issues all their activation
// loads at once: the blocks past nb (zero codes, zero (d, m)) read the last block's activations
// and add fmaf(dt, 0, acc), and the activation rows past n are read at row n − 1 and never stored.
// When nb % 8 == 0 (every stage inside the row) a block pair's scales and sums are 8-byte loads.
// Lane (g, tg) holds C for weight rows g, g + 8 and activation rows 2tg, 2tg + 1 and keeps mv_q41's
// float operations per block, acc = fmaf(dt, fmaf(dw, (float)C, mw·st), acc), in increasing block
// order; the block's warps are then added in order. That order depends on n_in alone, so row t of a
// launch does not depend on n and row o not on its tile (nor on the grouping of segments).
// `mv_q41t_host` (q41t.rs) is the kernel's twin, bit for bit.
#define Q41T_REC 640
#define Q41T_S 2
#define Q41T_C 4
#define Q41T_WARPS 8

// One stage (Q41T_C records = 2·Q41T_C blocks from bb) of a warp into acc. qg: B column g's row
// at element 8tg; dpa / dpb, spa / spb: the scales / sums rows of activation rows 2tg, 2tg + 1.
template <bool VEC>
__device__ __forceinline__ void q41t_stage(const unsigned char* st, int lane, int g, int bb, int nb,
                                           const i8* __restrict__ qg, bool bcol, const float* __restrict__ dpa,
                                           const float* __restrict__ dpb, const int* __restrict__ spa,
                                           const int* __restrict__ spb, float (&acc)[2][2]) {
    const u32 M4 = 0x0f0f0f0fu;
#pragma unroll
    for (int c = 0; c < Q41T_C; ++c) {
        uint4 cw = *(const uint4*)(st + c * Q41T_REC + lane * 16);
        uint4 dm = *(const uint4*)(st + c * Q41T_REC + 512 + g * 16);
        int bp = bb + 2 * c;  // the pair's first block
        float dt[2][2];       // [activation row 2tg, 2tg + 1][block of the pair]
        int sv[2][2];
        if (VEC) {
            float2 a = __ldg((const float2*)(dpa + bp)), b = __ldg((const float2*)(dpb + bp));
            int2 x = __ldg((const int2*)(spa + bp)), y = __ldg((const int2*)(spb + bp));
            dt[0][0] = a.x; dt[0][1] = a.y; dt[1][0] = b.x; dt[1][1] = b.y;
            sv[0][0] = x.x; sv[0][1] = x.y; sv[1][0] = y.x; sv[1][1] = y.y;
        } else {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                int b = min(bp + h, nb - 1);
                dt[0][h] = __ldg(dpa + b); dt[1][h] = __ldg(dpb + b);
                sv[0][h] = __ldg(spa + b); sv[1][h] = __ldg(spb + b);
            }
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            int b = VEC ? bp + h : min(bp + h, nb - 1);
            u32 wg = h ? cw.z : cw.x, wg8 = h ? cw.w : cw.y;
            u32 A[4] = {wg & M4, wg8 & M4, (wg >> 4) & M4, (wg8 >> 4) & M4};
            uint2 v = __ldg((const uint2*)(qg + (size_t)b * 32));
            int C[4] = {0, 0, 0, 0};
            mma_u8s8_k32(C, A, bcol ? v.x : 0u, bcol ? v.y : 0u);
            u32 dg = h ? dm.z : dm.x, dg8 = h ? dm.w : dm.y;
            float dw0 = lo_h(dg), mw0 = hi_h(dg), dw1 = lo_h(dg8), mw1 = hi_h(dg8);
            float sa0 = (float)sv[0][h], sb0 = (float)sv[1][h];
            acc[0][0] = fmaf(dt[0][h], fmaf(dw0, (float)C[0], mw0 * sa0), acc[0][0]);
            acc[0][1] = fmaf(dt[1][h], fmaf(dw0, (float)C[1], mw0 * sb0), acc[0][1]);
            acc[1][0] = fmaf(dt[0][h], fmaf(dw1, (float)C[2], mw1 * sa0), acc[1][0]);
            acc[1][1] = fmaf(dt[1][h], fmaf(dw1, (float)C[3], mw1 * sb0), acc[1][1]);
        }
    }
}

extern "C" __global__ void __launch_bounds__(Q41T_WARPS * 32)
    mvt_q41(const void* c0, const u16* sc0, float* y0, int n0, const void* c1, const u16* sc1, float* y1, int n1,
            const void* c2, const u16* sc2, float* y2, int n2, const i8* __restrict__ q,
            const float* __restrict__ da, const int* __restrict__ sa, int n_in, int n, int accumulate, int pre) {
    // segments as mv_q41's launcher passes them (the scale pointers are unused: the records hold them)
    MvSeg s0 = {c0, sc0, y0, n0}, s1 = {c1, sc1, y1, n1}, s2 = {c2, sc2, y2, n2};
    extern __shared__ __align__(128) unsigned char q41t_smem[];  // [warps][S][C][640]
    __shared__ u64 bar[Q41T_WARPS][Q41T_S];
    __shared__ float part[Q41T_WARPS][16][8];
    const u32 CHUNK = Q41T_C * Q41T_REC;
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, tg = lane & 3;
    int nb = n_in >> 5, nch = ((nb + 1) / 2 + Q41T_C - 1) / Q41T_C;
    // the block's tile: tiles of s0, then s1, then s2 (the grid is their sum)
    int t = blockIdx.x;
    int t0 = (s0.n_out + 15) >> 4, t1 = (s1.n_out + 15) >> 4;
    MvSeg sg = s0;
    if (t >= t0) {
        t -= t0;
        sg = s1;
        if (t >= t1) {
            t -= t1;
            sg = s2;
        }
    }
    const unsigned char* rec = (const unsigned char*)sg.codes + (size_t)t * nch * CHUNK;
    int k0 = w * nch / Q41T_WARPS, k1 = (w + 1) * nch / Q41T_WARPS;  // this warp's chunks
    unsigned char* ring = q41t_smem + (size_t)w * Q41T_S * CHUNK;
    if (threadIdx.x == 0) {
        for (int i = 0; i < Q41T_WARPS * Q41T_S; ++i) mbar_init(&bar[0][0] + i, 1);
#if BONSAI_SM90
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
    }
    __syncthreads();
    // lane 0: chunk k0 + i into ring slot i mod S
    auto issue = [&](int i) {
        u64* b = &bar[w][i % Q41T_S];
        mbar_arrive_tx(b, CHUNK);
        bulk_g2s(ring + (size_t)(i % Q41T_S) * CHUNK, rec + (size_t)(k0 + i) * CHUNK, CHUNK, b);
    };
    int nst = k1 - k0;
    if (pre && lane == 0)
        for (int i = 0; i < min(Q41T_S, nst); ++i) issue(i);
    PDL_ENTRY();
    if (!pre && lane == 0)
        for (int i = 0; i < min(Q41T_S, nst); ++i) issue(i);

    // B column g (zero past n), and the activation rows 2tg, 2tg + 1 of this lane's C values (rows
    // past n read row n − 1: finite, never stored)
    bool bcol = g < n;
    const i8* qg = q + (size_t)min(g, n - 1) * n_in + 8 * tg;
    int ta = min(2 * tg, n - 1), tb = min(2 * tg + 1, n - 1);
    const float *dpa = da + (size_t)ta * nb, *dpb = da + (size_t)tb * nb;
    const int *spa = sa + (size_t)ta * nb, *spb = sa + (size_t)tb * nb;
    bool vec = nb % (2 * Q41T_C) == 0;  // no block past nb, 8-byte aligned pairs
    float acc[2][2] = {{0.f, 0.f}, {0.f, 0.f}};  // [row g, g + 8][activation row 2tg, 2tg + 1]
    for (int i = 0; i < nst; ++i) {
        int s = i % Q41T_S;
        mbar_wait(&bar[w][s], (u32)(i / Q41T_S) & 1u);
        const unsigned char* st = ring + (size_t)s * CHUNK;
        int bb = 2 * Q41T_C * (k0 + i);  // the stage's first block
        if (vec)
            q41t_stage<true>(st, lane, g, bb, nb, qg, bcol, dpa, dpb, spa, spb, acc);
        else
            q41t_stage<false>(st, lane, g, bb, nb, qg, bcol, dpa, dpb, spa, spb, acc);
        // every lane is done with slot s: refill it S stages ahead
        __syncwarp();
        if (lane == 0 && i + Q41T_S < nst) {
#if BONSAI_SM90
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
            issue(i + Q41T_S);
        }
    }
    part[w][g][2 * tg] = acc[0][0];
    part[w][g][2 * tg + 1] = acc[0][1];
    part[w][g + 8][2 * tg] = acc[1][0];
    part[w][g + 8][2 * tg + 1] = acc[1][1];
    __syncthreads();
    if (threadIdx.x < 128) {
        int r = threadIdx.x >> 3, tt = threadIdx.x & 7;
        int o = t * 16 + r;
        if (tt < n && o < sg.n_out) {
            float v = part[0][r][tt];
#pragma unroll
            for (int k = 1; k < Q41T_WARPS; ++k) v += part[k][r][tt];
            float* yp = sg.y + (size_t)tt * sg.n_out + o;
            *yp = accumulate ? *yp + v : v;
        }
    }
}
