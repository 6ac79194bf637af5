// ---- binary tensor-core mat-vec for Q1_0 (`mvb_*`, n <= 8 rows; off by default) ---------------
// The 1-bit weight codes feed `mma.m16n8k256.row.col.s32.b1.b1.s32.and.popc` as they are stored:
// no unpacking. The int8 activations are split into 8 bit planes (`b1_planes`, once per activation
// vector), and for a weight row and activation sub-block j (32 elements)
//   Σ_k sign_k·q_k = 2·S1 − s_j,   S1 = Σ_{k: bit_k = 1} q_k = Σ_p c_p · popc(W_j AND X_{p,j}),
// c_p = 2^p (p < 7), c_7 = −128 (two's complement), where X_{p,j} holds bit p of the 32 bytes of
// sub-block j IN THE SAME BIT ORDER as the re-tiled Q1 code word (element 4i + b at bit 8b + i).
//
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k256", .b1 / .s32; g = lane >> 2,
// tg = lane & 3; bit i of a register is element i):
//   A (16 x 256, row): a0: row g,   k = 32tg + i      a1: row g + 8, k = 32tg + i
//                      a2: row g,   k = 128 + 32tg + i a3: row g + 8, k = 128 + 32tg + i
//   B (256 x 8, col):  b0: col g,   k = 32tg + i      b1: col g,     k = 128 + 32tg + i
//   C/D (16 x 8 s32):  c0: (g, 2tg)  c1: (g, 2tg + 1)  c2: (g + 8, 2tg)  c3: (g + 8, 2tg + 1)
// One 256-element chunk of a weight row is 8 sub-blocks = 8 code words, so a0..a3 are exactly the
// code words of sub-blocks tg and 4 + tg of rows g and g + 8 (direct u32 loads). Column j of B is
// the plane word of sub-block j of the chunk, zero outside k ∈ [32j, 32j + 32): only lanes with
// g == tg carry a nonzero b0 (sub-block tg) and lanes with g == tg + 4 a nonzero b1 (sub-block
// 4 + tg). Then D[r][j] = popc(W_{r,j} AND X_j): one MMA per plane gives 16 rows × 8 sub-blocks.
// The 8 planes are combined exactly in int32 through the C operand (two Horner chains of 4, planes
// 7..4 with the −128 sign, and 3..0; S1 = 16·hi + lo), then isum = 2·S1 − s_j.
//
// Float order (fixed, independent of n, RT and pre): lane (g, tg) owns sub-blocks 2tg, 2tg + 1 of
// every chunk of its K part; per (row, activation row) acc = fmaf(dw·da, (float)isum, acc) over its
// chunks in increasing order, sub-block 2tg before 2tg + 1; then v = (a_tg0 + a_tg1) + (a_tg2 +
// a_tg3) (xor-shuffle 1 then 2); then the KS parts summed in warp order. Each activation row has
// its own MMAs and epilogue, so row t of an n-row launch equals the 1-row launch bit for bit; the
// weight registers are loaded once per chunk and reused for every activation row.
//
// Q2 (not implemented): a 2-bit code c = 2·h + l would take two weight planes (h and l words per
// sub-block, i.e. twice the A registers and 16 MMAs per chunk): Σ c·q = 2·S_h + S_l.

#define MVB_WARPS 4

// x planes [n, nsb, 8] u32 from q [n, n_in] i8: plane p of sub-block j has, at bit 8b + i, bit p of
// element 4i + b of the sub-block (the re-tiled Q1 code-word order). grid (ceil(nsb / 8), n), block
// 256: warp w handles sub-block 8·bx + w; lane L = 8b + i holds element 4i + b, so __ballot_sync of
// bit p is the plane word. Exact (pure bit moves), no float.
extern "C" __global__ void b1_planes(const i8* q, int n_in, u32* planes) {
    PDL_ENTRY();
    const int t = blockIdx.y, j = blockIdx.x * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    const int nsb = n_in >> 5;
    if (j >= nsb) return;  // warp-uniform
    const int e = 4 * (lane & 7) + (lane >> 3);
    const u32 v = (u32)(u8)q[(size_t)t * n_in + (size_t)j * 32 + e];
    u32 mine = 0u;
#pragma unroll
    for (int p = 0; p < 8; ++p) {
        const u32 wd = __ballot_sync(0xffffffffu, (v >> p) & 1u);
        if (lane == p) mine = wd;
    }
    if (lane < 8) planes[((size_t)t * nsb + j) * 8 + lane] = mine;
}

__device__ __forceinline__ void mma_b1(int* d, const u32* a, u32 b0, u32 b1, int c0, int c1, int c2, int c3) {
    asm("mma.sync.aligned.m16n8k256.row.col.s32.b1.b1.s32.and.popc {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%10,%11,%12,%13};\n"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(c0), "r"(c1), "r"(c2), "r"(c3));
}

// One step of the register ring: this lane's A registers and weight scales of one chunk.
template <int RT>
struct MvbSlot {
    u32 a[RT][4];   // [tile][a0..a3]
    u16 ws[RT][2];  // [tile][row g / g + 8] f16 scale of block 2c + (tg >> 1)
};

template <int RT, int KS>
__device__ __forceinline__ void mvb_body(const MvSeg sg, const bool valid, const int o0, const u32* __restrict__ planes,
                                         const float* __restrict__ da, const int* __restrict__ sa, int n_in,
                                         int n, int accumulate, int pre, float* part) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, tg = lane & 3;
    const int kp = w % KS;
    const int nsb = n_in >> 5, nblk = n_in >> 7;
    const int nch = (nsb + 7) >> 3;  // 256-element chunks per row (the last may be partial)
    const int nmy = (valid && kp < nch) ? (nch - kp + KS - 1) / KS : 0;
    const int n_out = valid ? sg.n_out : 1;
    // per (tile, row half): clamped row (rows past n_out load the last row; never stored)
    const u32* crow[RT][2];
    const u16* srow[RT][2];
#pragma unroll
    for (int t = 0; t < RT; ++t)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const size_t o = (size_t)min(o0 + 16 * t + g + 8 * h, n_out - 1);
            crow[t][h] = (const u32*)sg.codes + o * (size_t)nsb;  // codes [n_out, nsb] u32
            srow[t][h] = sg.scales + o * (size_t)nblk;            // scales [n_out, nblk] f16
        }
    auto load = [&](MvbSlot<RT>& sl, int i) {
        const int c = kp + KS * i;
        const int j0 = 8 * c + tg, j1 = 8 * c + 4 + tg, blk = 2 * c + (tg >> 1);
#pragma unroll
        for (int t = 0; t < RT; ++t) {
            sl.a[t][0] = j0 < nsb ? __ldg(crow[t][0] + j0) : 0u;
            sl.a[t][1] = j0 < nsb ? __ldg(crow[t][1] + j0) : 0u;
            sl.a[t][2] = j1 < nsb ? __ldg(crow[t][0] + j1) : 0u;
            sl.a[t][3] = j1 < nsb ? __ldg(crow[t][1] + j1) : 0u;
            sl.ws[t][0] = blk < nblk ? __ldg(srow[t][0] + blk) : (u16)0;
            sl.ws[t][1] = blk < nblk ? __ldg(srow[t][1] + blk) : (u16)0;
        }
    };

    float acc[RT][2][MAXN];  // [tile][row g / g + 8][activation row]
#pragma unroll
    for (int t = 0; t < RT; ++t)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int tt = 0; tt < MAXN; ++tt) acc[t][h][tt] = 0.f;

    const bool bl0 = g == tg, bl1 = g == tg + 4;  // lanes that carry B words (b0 / b1)
    auto compute = [&](const MvbSlot<RT>& sl, int i) {
        const int c = kp + KS * i;
        const int jb = 8 * c + (bl0 ? tg : 4 + tg);  // this lane's B sub-block
        const bool bact = (bl0 || bl1) && jb < nsb;
        const int je = 8 * c + 2 * tg;  // the two epilogue sub-blocks je, je + 1 (nsb is even)
        const bool elive = je < nsb;
#pragma unroll
        for (int tt = 0; tt < MAXN; ++tt) {
            if (tt >= n) break;  // warp-uniform
            uint4 p0, p1;
            p0.x = p0.y = p0.z = p0.w = 0u;
            p1 = p0;
            if (bact) {
                const uint4* pp = (const uint4*)(planes + ((size_t)tt * nsb + jb) * 8);
                p0 = __ldg(pp);
                p1 = __ldg(pp + 1);
            }
            const u32 pl[8] = {p0.x, p0.y, p0.z, p0.w, p1.x, p1.y, p1.z, p1.w};
            float2 dv;
            int2 sv;
            dv.x = dv.y = 0.f;
            sv.x = sv.y = 0;
            if (elive) {
                dv = __ldg((const float2*)(da + (size_t)tt * nsb + je));
                sv = __ldg((const int2*)(sa + (size_t)tt * nsb + je));
            }
#pragma unroll
            for (int t = 0; t < RT; ++t) {
                int hi[4], lo[4];
                // hi = Σ_{p=4..7} c_p/16 · popc_p (Horner, p = 7 first with the −128 sign)
                mma_b1(hi, sl.a[t], bl0 ? pl[7] : 0u, bl1 ? pl[7] : 0u, 0, 0, 0, 0);
                mma_b1(hi, sl.a[t], bl0 ? pl[6] : 0u, bl1 ? pl[6] : 0u, -2 * hi[0], -2 * hi[1], -2 * hi[2],
                       -2 * hi[3]);
#pragma unroll
                for (int p = 5; p >= 4; --p)
                    mma_b1(hi, sl.a[t], bl0 ? pl[p] : 0u, bl1 ? pl[p] : 0u, 2 * hi[0], 2 * hi[1], 2 * hi[2],
                           2 * hi[3]);
                // lo = Σ_{p=0..3} 2^p · popc_p
                mma_b1(lo, sl.a[t], bl0 ? pl[3] : 0u, bl1 ? pl[3] : 0u, 0, 0, 0, 0);
#pragma unroll
                for (int p = 2; p >= 0; --p)
                    mma_b1(lo, sl.a[t], bl0 ? pl[p] : 0u, bl1 ? pl[p] : 0u, 2 * lo[0], 2 * lo[1], 2 * lo[2],
                           2 * lo[3]);
                if (elive) {
                    const int i0 = 2 * (16 * hi[0] + lo[0]) - sv.x;  // row g,     sub-block je
                    const int i1 = 2 * (16 * hi[1] + lo[1]) - sv.y;  // row g,     sub-block je + 1
                    const int i2 = 2 * (16 * hi[2] + lo[2]) - sv.x;  // row g + 8, sub-block je
                    const int i3 = 2 * (16 * hi[3] + lo[3]) - sv.y;  // row g + 8, sub-block je + 1
                    const float w0 = h2f(sl.ws[t][0]), w1 = h2f(sl.ws[t][1]);
                    acc[t][0][tt] = fmaf(w0 * dv.x, (float)i0, acc[t][0][tt]);
                    acc[t][0][tt] = fmaf(w0 * dv.y, (float)i1, acc[t][0][tt]);
                    acc[t][1][tt] = fmaf(w1 * dv.x, (float)i2, acc[t][1][tt]);
                    acc[t][1][tt] = fmaf(w1 * dv.y, (float)i3, acc[t][1][tt]);
                }
            }
        }
    };

    // register ring of NS chunks: the one being computed and the next one in flight
    const int NS = 2;
    MvbSlot<RT> sl[NS];
    // weights are never written on the device: with `pre` the first chunk is requested before the
    // PDL wait (planes, da and sa only after it)
    if (!pre) PDL_ENTRY();
    if (nmy > 0) load(sl[0], 0);
    if (pre) PDL_ENTRY();
    for (int i0 = 0; i0 < nmy; i0 += NS) {
#pragma unroll
        for (int s = 0; s < NS; ++s) {
            const int i = i0 + s;
            if (i >= nmy) break;
            if (i + 1 < nmy) load(sl[(s + 1) % NS], i + 1);
            compute(sl[s], i);
        }
    }
    // the 4 lanes of a row: (tg0 + tg1) + (tg2 + tg3), then K parts in warp order
#pragma unroll
    for (int t = 0; t < RT; ++t)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int tt = 0; tt < MAXN; ++tt) {
                if (tt >= n) break;
                float v = acc[t][h][tt];
                v += __shfl_xor_sync(0xffffffffu, v, 1);
                v += __shfl_xor_sync(0xffffffffu, v, 2);
                acc[t][h][tt] = v;
            }
    if (KS > 1) {
        // part [MVB_WARPS][RT][2][MAXN][8] (lane tg == 0 of each group writes its rows)
        if (tg == 0) {
#pragma unroll
            for (int t = 0; t < RT; ++t)
#pragma unroll
                for (int h = 0; h < 2; ++h)
#pragma unroll
                    for (int tt = 0; tt < MAXN; ++tt)
                        if (tt < n) part[(((w * RT + t) * 2 + h) * MAXN + tt) * 8 + g] = acc[t][h][tt];
        }
        __syncthreads();
        if (!valid || kp != 0) return;
        if (tg == 0) {
#pragma unroll
            for (int t = 0; t < RT; ++t)
#pragma unroll
                for (int h = 0; h < 2; ++h)
#pragma unroll
                    for (int tt = 0; tt < MAXN; ++tt) {
                        if (tt >= n) break;
                        float v = part[(((w * RT + t) * 2 + h) * MAXN + tt) * 8 + g];
#pragma unroll
                        for (int k2 = 1; k2 < KS; ++k2) v += part[((((w + k2) * RT + t) * 2 + h) * MAXN + tt) * 8 + g];
                        acc[t][h][tt] = v;
                    }
        }
    }
    if (!valid || tg != 0) return;
#pragma unroll
    for (int t = 0; t < RT; ++t)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int o = o0 + 16 * t + g + 8 * h;
            if (o >= sg.n_out) continue;
#pragma unroll
            for (int tt = 0; tt < MAXN; ++tt) {
                if (tt >= n) break;
                float* yp = sg.y + (size_t)tt * sg.n_out + o;
                *yp = accumulate ? *yp + acc[t][h][tt] : acc[t][h][tt];
            }
        }
}

template <int RT, int KS>
__device__ __forceinline__ void mvb_lowbit(MvSeg s0, MvSeg s1, MvSeg s2, MvSeg s3, const u32* __restrict__ planes,
                                           const float* __restrict__ da, const int* __restrict__ sa, int n_in,
                                           int n, int accumulate, int pre) {
    const int ROWS = 16 * RT;
    const int G = MVB_WARPS / KS;  // row groups per block
    __shared__ float part[KS > 1 ? MVB_WARPS * RT * 2 * MAXN * 8 : 1];
    int gw = blockIdx.x * G + (threadIdx.x >> 5) / KS;
    bool valid = true;
    MvSeg sg = mvm_find_seg(s0, s1, s2, s3, ROWS, gw, valid);
    if (!valid && KS == 1) {
        PDL_ENTRY();  // every kernel waits before it exits (completion stays transitive)
        return;
    }
    mvb_body<RT, KS>(sg, valid, gw * ROWS, planes, da, sa, n_in, n, accumulate, pre, part);
}

// Parameters as MVM_ENTRY with the activation codes q replaced by the planes [n, nsb, 8] u32
// (b1_planes); grid (ceil(row groups / (MVB_WARPS / KS))), block MVB_WARPS·32. Q1 only.
#define MVB_ENTRY(NAME, RT, KS, MINB)                          \
    MV_SEG_ENTRY(NAME, MVB_WARPS, MINB, const u32*, planes,   \
                 mvb_lowbit<RT, KS>(s0, s1, s2, s3, planes, da, sa, n_in, n, accumulate, pre))
MVB_ENTRY(mvb_q1_r1_k1, 1, 1, 4)
MVB_ENTRY(mvb_q1_r1_k2, 1, 2, 4)
MVB_ENTRY(mvb_q1_r1_k4, 1, 4, 4)
MVB_ENTRY(mvb_q1_r2_k1, 2, 1, 3)
MVB_ENTRY(mvb_q1_r2_k2, 2, 2, 3)
MVB_ENTRY(mvb_q1_r2_k4, 2, 4, 3)
