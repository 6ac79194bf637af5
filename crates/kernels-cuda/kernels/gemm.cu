// Prefill: tensor-core (int8 mma) matrix products for n > MAXN rows. Appended to bonsai.cu by
// lib.rs (same translation unit: its typedefs and helpers are in scope).

// ---- low-bit GEMM: y[n, n_out] (+)= x · Wᵀ on int8 tensor cores ------------------------------
//
// W is a re-tiled low-bit matrix (code plane + f16 scale plane, see the header of bonsai.cu), x the
// int8 activations (q [n, n_in], per-32 scales d [n, n_in/32]). For every 32-element sub-block j
// the exact integer dot Σ w_code·q is one m16n8k32 MMA; it is then scaled as
//   y[t, o] = Σ_blocks ws(o, b) · Σ_{j in b} xd(t, j) · isum(o, t, j)
// in f32 with a fixed order (sub-blocks in increasing order inside a scale block, blocks in
// increasing order), so results are deterministic and independent of the grid. They are not bit
// identical to the mat-vec path (that one sums ws·xd·isum per sub-block), only equal within f32
// rounding. Weight codes are expanded to signed int8 (Q1: ±1; Q2: code − 1 ∈ {−1, 0, 1, 2}), so the
// activation sums (x_s) are not needed.
//
// Fragment layouts of mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 (PTX ISA, "Matrix Fragments
// for mma.m16n8k32", integer types), g = lane >> 2 (groupID), tg = lane & 3 (threadID_in_group):
//   A 16x32 row-major: a0 = row g,   k 4tg..4tg+3    a1 = row g+8, k 4tg..4tg+3
//                      a2 = row g,   k 16+4tg..+3    a3 = row g+8, k 16+4tg..+3
//   B 32x8 col-major:  b0 = col g,   k 4tg..4tg+3    b1 = col g,   k 16+4tg..+3
//   C/D 16x8 s32:      c0, c1 = row g, cols 2tg, 2tg+1;   c2, c3 = row g+8, cols 2tg, 2tg+1
// (byte e of an A/B register is k = base + e). The sum runs over k, so any bijection between the
// MMA's logical k and the physical element index p of the sub-block is fine as long as A and B use
// the same one. We use: logical 4tg+e <-> p = 8tg+e, logical 16+4tg+e <-> p = 8tg+4+e. Then a
// thread's B registers are the 8 consecutive activation bytes p = 8tg..8tg+7 (one 8-byte shared
// load), and its A registers come straight out of the re-tiled code words:
//   Q1 (bit i of byte b = element 4i+b):  p = 8tg+e   -> bits (2tg)   of the word's 4 bytes
//                                         p = 8tg+4+e -> bits (2tg+1)
//   Q2 (field s of byte i = element 4s+i of a 16-element word; a sub-block is words h = 0, 1):
//      p = 8tg+e -> word tg>>1, field 2(tg&1);   p = 8tg+4+e -> word tg>>1, field 2(tg&1)+1.
// M = weight rows, N = activation rows.
//
// Int to float: the MMA accumulates onto C = GM_MAGIC (0x4B400000 = bits of 1.5·2^23), so D read as
// f32 is exactly 12582912 + isum (|isum| <= 32·2·127 < 2^22); one FADD recovers isum exactly.
//
// CTA tile: GM_BM = 128 weight rows (8 warps x 16 rows, one m16 tile per warp) x BN = 8·NT
// activation rows (each warp covers all BN with NT n8 tiles), k in chunks of GM_KC = 128 (one
// Q1/Q2 scale block, two Q2g64 blocks). Weight codes, activation codes and activation scales of a
// chunk are staged in shared memory with cp.async, GM_STAGES deep (one barrier per chunk); weight
// scales are read from global one chunk ahead into registers. Each weight byte is read from global
// once per CTA (the NT-tiles of one weight tile are adjacent in blockIdx.x, so they run together
// and share it through L2). Out-of-range weight rows / activation rows are clamped for loads
// (always in bounds) and never stored. No atomics.

#define GM_WARPS 8
#define GM_THREADS (GM_WARPS * 32)
#define GM_BM (GM_WARPS * 16)
#define GM_KC 128
#define GM_STAGES 3
// activation row stride in shared memory: 128 code bytes + 32 pad, so the 8-byte B loads of a
// half-warp (rows g..g+3, bytes 8tg..8tg+7) hit 32 distinct banks
#define GM_AST 160
#define GM_MAGIC 0x4B400000
#define GM_MAGIC_F 12582912.0f

__device__ __forceinline__ u32 smem_u32(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(smem)), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// d = A·B + MAGIC (see above); a/b as described in the fragment table.
__device__ __forceinline__ void mma_s8_magic(int* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    int c = GM_MAGIC;
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%11,%12,%13};\n"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "r"(c), "r"(c), "r"(c), "r"(c));
}

// Q1 code word -> 4 signed bytes (+1 for a set bit, −1 for a clear one) of bit plane i:
// m has bytes 0/1, m·0xFE has bytes 0x00/0xFE (no carries), ~ gives 0xFF/0x01.
__device__ __forceinline__ u32 q1_plane(u32 w, int i) { return ~(((w >> i) & 0x01010101u) * 0xFEu); }
// Q2 code word -> 4 signed bytes code − 1 of field s: bytes c + 0x7F never carry (c <= 3), and
// ^ 0x80 maps 0x7F + c to c − 1 in two's complement.
__device__ __forceinline__ u32 q2_plane(u32 w, int s) {
    return (((w >> (2 * s)) & 0x03030303u) + 0x7F7F7F7Fu) ^ 0x80808080u;
}

struct GmSeg {
    const u8* codes;
    const u16* scales;
    float* y;
    int n_out;
};

// The segment of CTA row tile `mt` (tiles of `bm` weight rows, segments in order; tiles never
// straddle two): false past the last one. On return `mt` is the tile index inside the segment.
__device__ __forceinline__ bool gm_segment(const GmSeg& s0, const GmSeg& s1, const GmSeg& s2, const GmSeg& s3,
                                           int bm, int& mt, GmSeg& sg) {
    const int t0 = (s0.n_out + bm - 1) / bm, t1 = (s1.n_out + bm - 1) / bm, t2 = (s2.n_out + bm - 1) / bm,
              t3 = (s3.n_out + bm - 1) / bm;
    if (mt < t0) {
        sg = s0;
    } else if ((mt -= t0) < t1) {
        sg = s1;
    } else if ((mt -= t1) < t2) {
        sg = s2;
    } else if ((mt -= t2) < t3) {
        sg = s3;
    } else {
        return false;
    }
    return true;
}

template <int KIND, int NT>
__device__ __forceinline__ void gemm_lowbit(GmSeg s0, GmSeg s1, GmSeg s2, GmSeg s3, const i8* __restrict__ xq,
                                            const float* __restrict__ xd, int n_in, int n, int accumulate) {
    const int BN = NT * 8;
    const int CB = KIND == 1 ? 16 : 32;   // code bytes per row per chunk
    const int SPC = KIND == 3 ? 2 : 1;    // scale blocks per chunk
    // shared: per stage activation codes [BN][GM_AST] (first 128 bytes used), activation scales
    // [BN][4] f32, weight codes [GM_BM][CB]
    __shared__ __align__(16) u8 s_x[GM_STAGES][BN * GM_AST];
    __shared__ __align__(16) float s_d[GM_STAGES][BN * 4];
    __shared__ __align__(16) u8 s_w[GM_STAGES][GM_BM * CB];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, tg = lane & 3;
    // this CTA's weight tile: global m-tile blockIdx.y, segments in order (tiles never straddle)
    int mt = blockIdx.y;
    GmSeg sg;
    if (!gm_segment(s0, s1, s2, s3, GM_BM, mt, sg)) return;
    const int m0 = mt * GM_BM;
    const int n0 = blockIdx.x * BN;
    const int n_out = sg.n_out;
    const int nsb = n_in >> 5;          // 32-element sub-blocks per row (activation scales)
    const int nc = n_in / GM_KC;        // chunks
    const int nblk = nc * SPC;          // weight scale blocks per row
    const size_t wrow = (size_t)nc * CB; // code bytes per weight row

    // loader roles (one 16-byte cp.async each; tid-major so that a warp's copies are contiguous)
    auto load_chunk = [&](int c, int st) {
        // activation codes: BN rows x 8 pieces of 16 bytes
#pragma unroll
        for (int i = tid; i < BN * 8; i += GM_THREADS) {
            int r = i >> 3, q = i & 7;
            int t = min(n0 + r, n - 1);
            cp_async16(&s_x[st][r * GM_AST + q * 16], xq + (size_t)t * n_in + (size_t)c * GM_KC + q * 16);
        }
        // activation scales: BN rows x 4 floats
        if (tid < BN) {
            int t = min(n0 + tid, n - 1);
            cp_async16(&s_d[st][tid * 4], xd + (size_t)t * nsb + (size_t)c * 4);
        }
        // weight codes: GM_BM rows x CB/16 pieces
#pragma unroll
        for (int i = tid; i < GM_BM * (CB / 16); i += GM_THREADS) {
            int r = i / (CB / 16), q = i % (CB / 16);
            int o = min(m0 + r, n_out - 1);
            cp_async16(&s_w[st][r * CB + q * 16], sg.codes + (size_t)o * wrow + (size_t)c * CB + q * 16);
        }
    };

    // this thread's weight rows (C rows g and g+8 of the warp's m16 tile)
    const int ra = m0 + warp * 16 + g, rb = ra + 8;
    const u16* wsa = sg.scales + (size_t)min(ra, n_out - 1) * nblk;
    const u16* wsb = sg.scales + (size_t)min(rb, n_out - 1) * nblk;
    // raw f16 weight scales of the current chunk (g64: two per row, packed in one u32)
    u32 swa, swb;
    if (SPC == 1) {
        swa = __ldg(wsa);
        swb = __ldg(wsb);
    } else {
        swa = __ldg((const u32*)wsa);
        swb = __ldg((const u32*)wsb);
    }

    float acc[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;

    // prologue: chunks 0 .. GM_STAGES-2
#pragma unroll
    for (int st = 0; st < GM_STAGES - 1; ++st) {
        if (st < nc) load_chunk(st, st);
        cp_async_commit();
    }

    for (int c = 0; c < nc; ++c) {
        // chunk c has landed (only the newest GM_STAGES-2 groups may be pending), for everyone
        cp_async_wait<GM_STAGES - 2>();
        __syncthreads();
        // refill the stage consumed in iteration c-1 (every thread passed the barrier above)
        {
            int cn = c + GM_STAGES - 1;
            if (cn < nc) load_chunk(cn, cn % GM_STAGES);
            cp_async_commit();
        }
        // next chunk's weight scales, used one iteration later
        u32 nwa = 0, nwb = 0;
        if (c + 1 < nc) {
            if (SPC == 1) {
                nwa = __ldg(wsa + c + 1);
                nwb = __ldg(wsb + c + 1);
            } else {
                nwa = __ldg((const u32*)wsa + c + 1);
                nwb = __ldg((const u32*)wsb + c + 1);
            }
        }
        const int st = c % GM_STAGES;
        // A fragments of the 4 sub-blocks of this chunk
        u32 af[4][4];
        {
            const u8* wr = &s_w[st][(warp * 16 + g) * CB];
            if (KIND == 1) {
                uint4 va = *(const uint4*)wr;             // row g: words = sub-blocks 0..3
                uint4 vb = *(const uint4*)(wr + 8 * CB);  // row g+8
                u32 wa[4] = {va.x, va.y, va.z, va.w}, wb[4] = {vb.x, vb.y, vb.z, vb.w};
#pragma unroll
                for (int s = 0; s < 4; ++s) {
                    af[s][0] = q1_plane(wa[s], 2 * tg);
                    af[s][1] = q1_plane(wb[s], 2 * tg);
                    af[s][2] = q1_plane(wa[s], 2 * tg + 1);
                    af[s][3] = q1_plane(wb[s], 2 * tg + 1);
                }
            } else {
                // sub-block s = words 2s, 2s+1; this thread uses word 2s + (tg >> 1)
                uint4 va0 = *(const uint4*)wr, va1 = *(const uint4*)(wr + 16);
                uint4 vb0 = *(const uint4*)(wr + 8 * CB), vb1 = *(const uint4*)(wr + 8 * CB + 16);
                bool hi = (tg >> 1) != 0;
                u32 wa[4] = {hi ? va0.y : va0.x, hi ? va0.w : va0.z, hi ? va1.y : va1.x, hi ? va1.w : va1.z};
                u32 wb[4] = {hi ? vb0.y : vb0.x, hi ? vb0.w : vb0.z, hi ? vb1.y : vb1.x, hi ? vb1.w : vb1.z};
                int f = 2 * (tg & 1);
#pragma unroll
                for (int s = 0; s < 4; ++s) {
                    af[s][0] = q2_plane(wa[s], f);
                    af[s][1] = q2_plane(wb[s], f);
                    af[s][2] = q2_plane(wa[s], f + 1);
                    af[s][3] = q2_plane(wb[s], f + 1);
                }
            }
        }
        float wa0, wb0, wa1, wb1;  // weight scales of rows g / g+8 (g64: blocks 2c, 2c+1)
        wa0 = h2f((u16)(swa & 0xffffu));
        wb0 = h2f((u16)(swb & 0xffffu));
        wa1 = h2f((u16)(swa >> 16));
        wb1 = h2f((u16)(swb >> 16));

        const u8* xs = s_x[st];
        const float* ds = s_d[st];
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            // activation scales of this thread's two columns (rows 8j + 2tg, +1), sub-blocks 0..3
            float4 xa = *(const float4*)&ds[(8 * j + 2 * tg) * 4];
            float4 xb = *(const float4*)&ds[(8 * j + 2 * tg + 1) * 4];
            float da[4] = {xa.x, xa.y, xa.z, xa.w}, db[4] = {xb.x, xb.y, xb.z, xb.w};
            const u8* brow = xs + (8 * j + g) * GM_AST + 8 * tg;
            float p[4];
#pragma unroll
            for (int s = 0; s < 4; ++s) {
                uint2 b = *(const uint2*)(brow + 32 * s);
                int d[4];
                mma_s8_magic(d, af[s][0], af[s][1], af[s][2], af[s][3], b.x, b.y);
                float f0 = __int_as_float(d[0]) - GM_MAGIC_F, f1 = __int_as_float(d[1]) - GM_MAGIC_F,
                      f2 = __int_as_float(d[2]) - GM_MAGIC_F, f3 = __int_as_float(d[3]) - GM_MAGIC_F;
                bool first = SPC == 1 ? s == 0 : (s & 1) == 0;
                if (first) {
                    p[0] = f0 * da[s];
                    p[1] = f1 * db[s];
                    p[2] = f2 * da[s];
                    p[3] = f3 * db[s];
                } else {
                    p[0] = fmaf(f0, da[s], p[0]);
                    p[1] = fmaf(f1, db[s], p[1]);
                    p[2] = fmaf(f2, da[s], p[2]);
                    p[3] = fmaf(f3, db[s], p[3]);
                }
                bool last = SPC == 1 ? s == 3 : (s & 1) == 1;
                if (last) {
                    float ua = (SPC == 1 || s == 1) ? wa0 : wa1;
                    float ub = (SPC == 1 || s == 1) ? wb0 : wb1;
                    acc[j][0] = fmaf(p[0], ua, acc[j][0]);
                    acc[j][1] = fmaf(p[1], ua, acc[j][1]);
                    acc[j][2] = fmaf(p[2], ub, acc[j][2]);
                    acc[j][3] = fmaf(p[3], ub, acc[j][3]);
                }
            }
        }
        swa = nwa;
        swb = nwb;
    }
    // drain the (empty) trailing groups before exit
    cp_async_wait<0>();

#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            int o = e < 2 ? ra : rb;
            int t = n0 + 8 * j + 2 * tg + (e & 1);
            if (o < n_out && t < n) {
                float* yp = sg.y + (size_t)t * n_out + o;
                float v = acc[j][e];
                *yp = accumulate ? *yp + v : v;
            }
        }
    }
}

// Flat parameters like MV_ENTRY: per segment codes, scales, y, n_out (unused segments n_out = 0),
// then q [n, n_in], d [n, n_in/32], n_in (a multiple of 128), n, accumulate.
// grid (ceil(n / (8·NT)), Σ ceil(n_out_i / GM_BM)), block GM_THREADS.
#define GM_ENTRY(NAME, KIND, NT)                                                                        \
    extern "C" __global__ void __launch_bounds__(GM_THREADS, 2) NAME(                                   \
        const u8* c0, const u16* sc0, float* y0, int n0, const u8* c1, const u16* sc1, float* y1,        \
        int n1, const u8* c2, const u16* sc2, float* y2, int n2, const u8* c3, const u16* sc3,           \
        float* y3, int n3, const i8* q, const float* da, int n_in, int n, int accumulate) {              \
        GmSeg s0 = {c0, sc0, y0, n0}, s1 = {c1, sc1, y1, n1}, s2 = {c2, sc2, y2, n2},                    \
              s3 = {c3, sc3, y3, n3};                                                                   \
        gemm_lowbit<KIND, NT>(s0, s1, s2, s3, q, da, n_in, n, accumulate);                              \
    }
// BN = 64 activation rows per CTA (large grids) and BN = 32 (more CTAs for small n_out or small n);
// the launcher (gemm.rs) picks one from the wave count. Both give the same values bit for bit
// (per output the float ops do not depend on NT).
GM_ENTRY(gemm_q1, 1, 8)
GM_ENTRY(gemm_q2, 2, 8)
GM_ENTRY(gemm_q2g64, 3, 8)
GM_ENTRY(gemm_q1_n32, 1, 4)
GM_ENTRY(gemm_q2_n32, 2, 4)
GM_ENTRY(gemm_q2g64_n32, 3, 4)

// ---- f16 tensor-core GEMM (the default prefill path) -------------------------------------------
//
// The int8 GEMM above spends most of its issue slots on the per-32 rescale after every MMA (the
// activation scale changes every 32 elements: 2 float ops per output per MMA). Here the scales
// leave the inner loop:
//   * activations: act_q8_to_f16p turns a row's int8 codes into f16 values q·d·2^-e_t, with one
//     power of two per row (xs[t] = 2^e_t) that puts the row's largest |value| in (2^13, 2^14]
//     (no f16 overflow or underflow whatever the activations' range), stored in "pair order":
//     every 4 elements x0 x1 x2 x3 as x0 x2 x1 x3;
//   * weights: each A register is made straight from the re-tiled code word with the weight
//     scale folded in, exactly: Q1 ±d (a sign flip of −d), Q2 (c − 1)·d (c − 1 ∈ {−1, 0, 1, 2});
//   * mma.m16n8k16 f16 × f16 → f32 accumulates over all of K; the epilogue multiplies by xs[t].
// Per output the order is fixed (k16 steps in increasing order, chained in the accumulator), so
// results do not depend on the grid, the tile width, the grouping or n. They differ from the
// int8 path by the f16 rounding of q·d (relative 2^-11 per element).
//
// Fragment layouts of mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 (PTX ISA), g = lane >> 2,
// tg = lane & 3; register halves: low = the lower k.
//   A 16x16: a0 = row g, k 2tg, 2tg+1   a1 = row g+8, k 2tg, 2tg+1   a2 = row g, k 2tg+8, +9
//            a3 = row g+8, k 2tg+8, +9
//   B 16x8:  b0 = col g, k 2tg, 2tg+1   b1 = col g, k 2tg+8, +9      (ldmatrix of an [n][k] tile)
//   C 16x8:  c0, c1 = row g, cols 2tg, 2tg+1;  c2, c3 = row g+8, cols 2tg, 2tg+1
// Within a 32-element sub-block, stored f16 pair P (positions 2P, 2P+1 of the pair-ordered row)
// holds elements e0 = 4(P>>1) + (P&1) and e0 + 2. k16 step h of the sub-block covers pairs
// 8h..8h+7: a thread's b0 is pair 8h + tg, its b1 pair 8h + 4 + tg, and a0/a2 must hold the
// weights of the same two pairs. In the code words those two elements sit 16 bits apart:
//   Q1 (element 4i + b at bit 8b + i): pair P -> bits 8b + i and 8b + i + 16 (i = P>>1, b = P&1),
//      so (w << (15 − 8b − i)) & 0x80008000 has them in the f16 sign bits; XOR onto −d.
//   Q2 (word h of the sub-block; element 4s + i of the word in bits 8i + 2s, +1): pair 8h + tg
//      -> s = tg>>1, i = tg&1; pair 8h + 4 + tg -> s = 2 + (tg>>1); fields at r and r + 16 with
//      r = 8i + 2s, so ((w >> r) & 0x00030003) | 0x64006400 is f16 (1024 + c), minus 1025 -> c − 1
//      exactly, times d exactly.
// CTA: 4 warps along M (32 weight rows each: 2 m16 tiles) x BN = 8·NT activation rows (every warp
// all of them: NT n8 tiles), k in chunks of 128 through a GH_STAGES-deep cp.async ring in dynamic
// shared memory.

#define GH_KC 128
// activation row stride in shared memory: 256 bytes of f16 + 16 pad, so the 8 row addresses of an
// ldmatrix hit 8 distinct 16-byte bank groups
#define GH_XST 272

__device__ __forceinline__ void mma_f16(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void ldsm_x4(u32* r, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}
// (a & 0x80008000) ^ c in one LOP3
__device__ __forceinline__ u32 sign_xor(u32 a, u32 c) {
    u32 d;
    asm("lop3.b32 %0, %1, %2, %3, 0x6a;" : "=r"(d) : "r"(a), "r"(0x80008000u), "r"(c));
    return d;
}
// Q2 f16x2 of (c − 1)·d for the two 2-bit fields at bits r and r + 16 of w; dd = d | d << 16
__device__ __forceinline__ u32 q2_h2(u32 w, int r, u32 dd) {
    u32 v = ((w >> r) & 0x00030003u) | 0x64006400u;
    u32 o;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(o) : "r"(v), "r"(0x64016401u));
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(v) : "r"(o), "r"(dd));
    return v;
}
// two floats -> f16x2 (lo in the low half), round to nearest even
__device__ __forceinline__ u32 pack_h2(float lo, float hi) {
    u32 d;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

// Row exponent of act_q8_to_f16p: e with amax·2^-e in (2^13, 2^14] for a normal positive amax,
// clamped to ±100 (so 2^±e are normal floats); 0 for amax 0, inf or NaN. Host twin:
// gemm::f16p_row_exp.
__device__ __forceinline__ int f16p_row_exp(float amax) {
    u32 bits = __float_as_uint(amax);
    int E = (int)((bits >> 23) & 0xffu);
    if (!(amax > 0.0f) || E == 0xff) return 0;
    return min(max(max(E, 1) - 140, -100), 100);
}

// q [n, n_in] i8 + d [n, n_in/32] f32 -> xh [n, n_in] f16 bits (pair order), xs [n] = 2^e_t.
// grid n, block 256. n_in a multiple of 32; xh 16-byte aligned rows (n_in % 8 == 0).
extern "C" __global__ void act_q8_to_f16p(const i8* q, const float* d, int n_in, u16* xh, float* xs) {
    __shared__ float red[32];
    const int t = blockIdx.x, nsb = n_in >> 5;
    const float* dr = d + (size_t)t * nsb;
    float m = 0.0f;
    for (int j = threadIdx.x; j < nsb; j += blockDim.x) m = fmaxf(m, dr[j]);
    m = block_max(m, red);
    const int e = f16p_row_exp(m * 127.0f);
    const float down = __uint_as_float((u32)(127 - e) << 23);
    if (threadIdx.x == 0) xs[t] = __uint_as_float((u32)(127 + e) << 23);
    const i8* qr = q + (size_t)t * n_in;
    uint4* xr = (uint4*)(xh + (size_t)t * n_in);
    for (int c = threadIdx.x; c < (n_in >> 3); c += blockDim.x) {
        uint2 v = *(const uint2*)(qr + 8 * c);
        float s = dr[c >> 2] * down;
        float x[8];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            x[i] = (float)(int)(signed char)(v.x >> (8 * i)) * s;
            x[4 + i] = (float)(int)(signed char)(v.y >> (8 * i)) * s;
        }
        xr[c] = make_uint4(pack_h2(x[0], x[2]), pack_h2(x[1], x[3]), pack_h2(x[4], x[6]), pack_h2(x[5], x[7]));
    }
}

// weight code bytes per row of a shared-memory stage (Q2 kinds padded 32 -> 48: no bank conflicts)
#define GH_WROW(KIND) ((KIND) == 1 ? 16 : 48)

// ---- pieces shared by the two f16 GEMMs (gemmh: mma.sync, gemmw: wgmma) ---------------------
// A thread owns 4 weight rows k = 2·mi + hf (A rows g / g + 8 of m-tile or half mi), local row
// lr[k] of the CTA tile.

// Scale index of each row's first block, in units of one chunk's scale load (u16; g64: u32).
template <int KIND>
__device__ __forceinline__ u32 f16g_load_scale(const GmSeg& sg, const u32* wsi, int k, int c) {
    return KIND != 3 ? (u32)__ldg(sg.scales + wsi[k] + c) : __ldg((const u32*)sg.scales + wsi[k] + c);
}

// Per row the f16x2 base of a chunk's scale block(s) from its raw scales `sw`: Q1 −d (a set bit
// flips it to d), Q2 d; g64: [0] for sub-blocks 0-1, [1] for 2-3.
template <int KIND>
__device__ __forceinline__ void f16g_bases(const u32* sw, u32 (*base)[2]) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
#pragma unroll
        for (int b = 0; b < 2; ++b) {
            u32 h = (KIND != 3 || b == 0) ? (sw[k] & 0xffffu) : (sw[k] >> 16);
            if (KIND == 1) h ^= 0x8000u;  // −d
            base[k][b] = h * 0x00010001u;
        }
    }
}

// Every code word of a chunk for the 4 rows (Q1: sub-block sb = word sb; Q2: words 2sb, 2sb+1)
// from the shared-memory stage `wbase` (row stride GH_WROW(KIND)).
template <int KIND>
__device__ __forceinline__ void f16g_code_words(const u8* wbase, const int* lr, u32 (*cw)[KIND == 1 ? 4 : 8]) {
    constexpr int NW = KIND == 1 ? 4 : 8;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
#pragma unroll
        for (int v = 0; v < NW / 4; ++v) {
            uint4 x = *(const uint4*)(wbase + lr[k] * GH_WROW(KIND) + 16 * v);
            cw[k][4 * v] = x.x;
            cw[k][4 * v + 1] = x.y;
            cw[k][4 * v + 2] = x.z;
            cw[k][4 * v + 3] = x.w;
        }
    }
}

// The A fragment (4 f16x2 registers, the mma.m16n8k16 / wgmma m64nNk16 layout) of rows 2mi, 2mi+1
// at k16 step kk of a chunk. q1s / q2r: the thread's shifts (see the layout notes above).
template <int KIND>
__device__ __forceinline__ void f16g_a_frag(const u32 (*cw)[KIND == 1 ? 4 : 8], const u32 (*base)[2], int kk, int mi,
                                            int q1s, int q2r, u32* a) {
    const int sb = kk >> 1, h = kk & 1;
    const int bi = (KIND == 3 && sb >= 2) ? 1 : 0;  // g64: the chunk's second scale block
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        const int k = 2 * mi + hf;
        if (KIND == 1) {
            const int s = q1s - 4 * h;
            a[hf] = sign_xor(cw[k][sb] << s, base[k][bi]);
            a[2 + hf] = sign_xor(cw[k][sb] << (s - 2), base[k][bi]);
        } else {
            const u32 w = cw[k][2 * sb + h];
            a[hf] = q2_h2(w, q2r, base[k][bi]);
            a[2 + hf] = q2_h2(w, q2r + 4, base[k][bi]);
        }
    }
}

// y[t, o] (+)= acc · xs[t] for the 2 x NJ n8 blocks of accumulators (C layout: [4j + 2hf + e2] is
// row lr[2mi + hf], activation row n0 + 8j + 2tg + e2).
template <int NJ>
__device__ __forceinline__ void f16g_store(const float (*acc)[4 * NJ], const GmSeg& sg, const int* lr, int m0, int n0,
                                           int tg, const float* __restrict__ xs, int n, int accumulate) {
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
#pragma unroll
        for (int e2 = 0; e2 < 2; ++e2) {
            const int t = n0 + 8 * j + 2 * tg + e2;
            if (t >= n) continue;
            const float sc = xs[t];
#pragma unroll
            for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    const int o = m0 + lr[2 * mi + hf];
                    if (o < sg.n_out) {
                        float* yp = sg.y + (size_t)t * sg.n_out + o;
                        float v = acc[mi][4 * j + 2 * hf + e2] * sc;
                        *yp = accumulate ? *yp + v : v;
                    }
                }
            }
        }
    }
}

// Dynamic shared memory of a gemmh launch: per stage BN activation rows + 32·W weight rows.
#define GH_SMEM(KIND, NT, W, ST) ((ST) * (8 * (NT) * GH_XST + 32 * (W) * GH_WROW(KIND)))

// W warps per CTA (GH_BM = 32·W weight rows: more rows per CTA read each activation tile from L2
// fewer times), NT n8 tiles per warp, GH_STAGES ring stages.
template <int KIND, int NT, int W, int GH_STAGES>
__device__ __forceinline__ void gemmh_lowbit(GmSeg s0, GmSeg s1, GmSeg s2, GmSeg s3, const u16* __restrict__ xh,
                                             const float* __restrict__ xs, int n_in, int n, int accumulate) {
    extern __shared__ __align__(16) u8 gh_smem[];
    constexpr int GH_BM = 32 * W, GH_THREADS = 32 * W;
    const int BN = NT * 8;
    const int CB = KIND == 1 ? 16 : 32;  // code bytes per weight row per chunk
    const int WS = GH_WROW(KIND);        // their stride in shared memory (Q2 padded: no conflicts)
    const int XSTAGE = BN * GH_XST, WSTAGE = GH_BM * WS;
    u8* s_x = gh_smem;                        // [GH_STAGES][BN][GH_XST]
    u8* s_w = gh_smem + GH_STAGES * XSTAGE;   // [GH_STAGES][GH_BM][WS]

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, tg = lane & 3;
    int mt = blockIdx.y;
    GmSeg sg;
    if (!gm_segment(s0, s1, s2, s3, GH_BM, mt, sg)) return;
    const int m0 = mt * GH_BM;
    const int n0 = blockIdx.x * BN;
    const int n_out = sg.n_out;
    const int nc = n_in / GH_KC;
    const size_t wrow = (size_t)nc * CB;

    auto load_chunk = [&](int c, int st) {
        u8* sx = s_x + st * XSTAGE;
#pragma unroll
        for (int i = tid; i < BN * 16; i += GH_THREADS) {
            int r = i >> 4, p = i & 15;
            int t = min(n0 + r, n - 1);
            cp_async16(sx + r * GH_XST + p * 16, (const u8*)(xh + (size_t)t * n_in + (size_t)c * GH_KC) + p * 16);
        }
        u8* sw = s_w + st * WSTAGE;
#pragma unroll
        for (int i = tid; i < GH_BM * (CB / 16); i += GH_THREADS) {
            int r = i / (CB / 16), p = i % (CB / 16);
            int o = min(m0 + r, n_out - 1);
            cp_async16(sw + r * WS + p * 16, sg.codes + (size_t)o * wrow + (size_t)c * CB + p * 16);
        }
    };

    // this thread's 4 weight rows: local row lr[k] = warp·32 + 16·(k>>1) + g + 8·(k&1)
    // (k = 2·mi + half: A rows g / g+8 of m-tile mi)
    int lr[4];
    // scale index of each row's first block, in units of this chunk's scale load (u16; g64 u32)
    u32 wsi[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        lr[k] = warp * 32 + 16 * (k >> 1) + g + 8 * (k & 1);
        wsi[k] = (u32)min(m0 + lr[k], n_out - 1) * (u32)nc;
    }
    u32 sw[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) sw[k] = f16g_load_scale<KIND>(sg, wsi, k, 0);

    float acc[2][4 * NT];  // [m-tile][4j + e]: n8 tile j's C registers
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int e = 0; e < 4 * NT; ++e) acc[mi][e] = 0.f;

#pragma unroll
    for (int st = 0; st < GH_STAGES - 1; ++st) {
        if (st < nc) load_chunk(st, st);
        cp_async_commit();
    }

    // ldmatrix roles: matrix lane >> 3 (0: tile j k 0-7, 1: tile j k 8-15, 2/3: tile j+1), row lane & 7
    const u32 ld_off = (u32)((8 * ((lane >> 4) & 1) + (lane & 7)) * GH_XST + 16 * ((lane >> 3) & 1));
    // Q1 shifts of pairs 8h + tg (a0/a1) and 8h + 4 + tg (a2/a3) at h = 0; h = 1 is 4 less
    const int q1s = 15 - 8 * (tg & 1) - (tg >> 1);
    // Q2 right shifts of the same pairs
    const int q2r = 8 * (tg & 1) + 2 * (tg >> 1);

    for (int c = 0; c < nc; ++c) {
        cp_async_wait<GH_STAGES - 2>();
        __syncthreads();
        {
            int cn = c + GH_STAGES - 1;
            if (cn < nc) load_chunk(cn, cn % GH_STAGES);
            cp_async_commit();
        }
        u32 nsw[4] = {0, 0, 0, 0};
        if (c + 1 < nc) {
#pragma unroll
            for (int k = 0; k < 4; ++k) nsw[k] = f16g_load_scale<KIND>(sg, wsi, k, c + 1);
        }
        const int st = c % GH_STAGES;
        const u32 xbase = smem_u32(s_x + st * XSTAGE) + ld_off;
        u32 base[4][2];
        f16g_bases<KIND>(sw, base);
        // every code word of the chunk, then the k16 steps with the B fragments of step kk+1
        // loaded before the MMAs of step kk (two register sets), so no MMA waits on its own ldmatrix
        u32 cw[4][KIND == 1 ? 4 : 8];
        f16g_code_words<KIND>(s_w + st * WSTAGE, lr, cw);
        u32 bf[2][NT][2];
        auto load_b = [&](int kk, u32 (*b)[2]) {
#pragma unroll
            for (int jp = 0; jp < NT / 2; ++jp) {
                u32 r[4];
                ldsm_x4(r, xbase + (u32)(16 * jp * GH_XST + 32 * kk));
                b[2 * jp][0] = r[0];
                b[2 * jp][1] = r[1];
                b[2 * jp + 1][0] = r[2];
                b[2 * jp + 1][1] = r[3];
            }
        };
        load_b(0, bf[0]);
#pragma unroll
        for (int kk = 0; kk < 8; ++kk) {
            if (kk + 1 < 8) load_b(kk + 1, bf[(kk + 1) & 1]);
#pragma unroll
            for (int mi = 0; mi < 2; ++mi) {
                u32 a[4];
                f16g_a_frag<KIND>(cw, base, kk, mi, q1s, q2r, a);
#pragma unroll
                for (int j = 0; j < NT; ++j)
                    mma_f16(&acc[mi][4 * j], a[0], a[1], a[2], a[3], bf[kk & 1][j][0], bf[kk & 1][j][1]);
            }
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) sw[k] = nsw[k];
    }
    cp_async_wait<0>();
    f16g_store<NT>(acc, sg, lr, m0, n0, tg, xs, n, accumulate);
}

// Parameters as GM_ENTRY with xh [n, n_in] f16 (pair order) and xs [n] instead of q and d.
// grid (ceil(n / (8·NT)), Σ ceil(n_out_i / (32·W))), block 32·W, GH_SMEM(KIND, NT, W) bytes of
// dynamic shared memory.
#define GH_ENTRY(NAME, KIND, NT, W, ST, MINB)                                                           \
    extern "C" __global__ void __launch_bounds__(32 * (W), MINB) NAME(                                  \
        const u8* c0, const u16* sc0, float* y0, int n0, const u8* c1, const u16* sc1, float* y1,        \
        int n1, const u8* c2, const u16* sc2, float* y2, int n2, const u8* c3, const u16* sc3,           \
        float* y3, int n3, const u16* xh, const float* xs, int n_in, int n, int accumulate) {            \
        GmSeg s0 = {c0, sc0, y0, n0}, s1 = {c1, sc1, y1, n1}, s2 = {c2, sc2, y2, n2},                    \
              s3 = {c3, sc3, y3, n3};                                                                   \
        gemmh_lowbit<KIND, NT, W, ST>(s0, s1, s2, s3, xh, xs, n_in, n, accumulate);                      \
    }
// 4 warps (128 weight rows) and 8 warps (256) per CTA; BN 64 and 32; 3 stages, and (_o4) 2 stages
// at 4 CTAs per SM (128 registers)
GH_ENTRY(gemmh_q1, 1, 8, 4, 3, 3)
GH_ENTRY(gemmh_q2, 2, 8, 4, 3, 3)
GH_ENTRY(gemmh_q2g64, 3, 8, 4, 3, 3)
GH_ENTRY(gemmh_q1_n32, 1, 4, 4, 3, 3)
GH_ENTRY(gemmh_q2_n32, 2, 4, 4, 3, 3)
GH_ENTRY(gemmh_q2g64_n32, 3, 4, 4, 3, 3)
GH_ENTRY(gemmh_q1_w8, 1, 8, 8, 3, 1)
GH_ENTRY(gemmh_q2_w8, 2, 8, 8, 3, 1)
GH_ENTRY(gemmh_q2g64_w8, 3, 8, 8, 3, 1)
GH_ENTRY(gemmh_q1_w8_n32, 1, 4, 8, 3, 2)
GH_ENTRY(gemmh_q2_w8_n32, 2, 4, 8, 3, 2)
GH_ENTRY(gemmh_q2g64_w8_n32, 3, 4, 8, 3, 2)
GH_ENTRY(gemmh_q1_o4, 1, 8, 4, 2, 4)
GH_ENTRY(gemmh_q2_o4, 2, 8, 4, 2, 4)
GH_ENTRY(gemmh_q2g64_o4, 3, 8, 4, 2, 4)

// ---- f16 GEMM on Hopper warpgroup MMA (sm_90a; the default prefill path where available) ------
//
// Same activations (act_q8_to_f16p), weights (A fragments from the code words, scales folded) and
// fragment mapping as gemmh above, but the products run as wgmma.mma_async.m64n64k16 with A from
// registers and B (the activations) read by the tensor cores straight from shared memory, so no
// ldmatrix and no per-MMA issue for B. CTA = one warpgroup (4 warps, 128 threads): 128 weight rows
// as two m64 halves (warp w holds rows 16w + g, +8 of each half) x BN = 64 activation rows
// (N = 64). k in chunks of 128 through a GW_STAGES-deep cp.async ring, loaded 2 chunks ahead.
// Shared activation stage: the canonical no-swizzle K-major layout of wgmma, core matrices of 8
// rows x 16 bytes: byte offset of (row n, 8-element k block kb) = kb·1024 + (n >> 3)·128 +
// (n & 7)·16; the descriptor of k16 step kk starts at 2kk·1024 with 1024 between k-adjacent and
// 128 between n-adjacent core matrices. Per k16 step: wait until at most NSETS - 1 earlier wgmma
// groups are in flight (the A register set about to be rewritten is then free: NSETS sets
// rotate), unpack, fence, two wgmmas (one per half), commit. Each output's sum runs over the k16 steps in order in the
// accumulator, so results do not depend on the grid or n (but they are not bit-equal to gemmh:
// the tensor cores' internal summation order differs between the two instructions).

#define GW_KC 128
#define GW_STAGES 4
#define GW_XSTAGE (64 * GW_KC * 2)
#define GW_SMEM(KIND) (GW_STAGES * (GW_XSTAGE + 128 * GH_WROW(KIND)))

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// d[32] += A (4 f16x2 registers) x B (descriptor), m64n64k16, f32 accumulate
__device__ __forceinline__ void wgmma_m64n64k16(float* d, const u32* a, unsigned long long desc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc)
                 : "memory");
}
#endif

// 1 where this cubin has the wgmma kernels (compiled for sm_90a), else 0.
extern "C" __global__ void gemmw_available(int* out) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    *out = 1;
#else
    *out = 0;
#endif
}

template <int KIND, int NSETS>
__device__ __forceinline__ void gemmw_lowbit(GmSeg s0, GmSeg s1, GmSeg s2, GmSeg s3, const u16* __restrict__ xh,
                                             const float* __restrict__ xs, int n_in, int n, int accumulate,
                                             int desc_swap) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ __align__(1024) u8 gw_smem[];
    const int CB = KIND == 1 ? 16 : 32;
    const int WS = GH_WROW(KIND);
    const int WSTAGE = 128 * WS;
    u8* s_x = gw_smem;                          // [GW_STAGES][GW_XSTAGE] (core-matrix layout)
    u8* s_w = gw_smem + GW_STAGES * GW_XSTAGE;  // [GW_STAGES][128][WS]

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, tg = lane & 3;
    int mt = blockIdx.y;
    GmSeg sg;
    if (!gm_segment(s0, s1, s2, s3, 128, mt, sg)) return;
    const int m0 = mt * 128;
    const int n0 = blockIdx.x * 64;
    const int n_out = sg.n_out;
    const int nc = n_in / GW_KC;
    const size_t wrow = (size_t)nc * CB;

    auto load_chunk = [&](int c, int st) {
        u8* sx = s_x + st * GW_XSTAGE;
#pragma unroll
        for (int m = 0; m < 8; ++m) {
            int p = tid + 128 * m;
            int r8 = p & 7, kb = (p >> 3) & 15, ng = p >> 7;
            int t = min(n0 + 8 * ng + r8, n - 1);
            cp_async16(sx + kb * 1024 + ng * 128 + r8 * 16,
                       (const u8*)(xh + (size_t)t * n_in + (size_t)c * GW_KC + 8 * kb));
        }
        u8* sw = s_w + st * WSTAGE;
#pragma unroll
        for (int i = tid; i < 128 * (CB / 16); i += 128) {
            int r = i / (CB / 16), q = i % (CB / 16);
            int o = min(m0 + r, n_out - 1);
            cp_async16(sw + r * WS + q * 16, sg.codes + (size_t)o * wrow + (size_t)c * CB + q * 16);
        }
    };

    // this thread's 4 weight rows: k = 2·half + hf -> 64·half + 16·warp + g + 8·hf
    int lr[4];
    u32 wsi[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        lr[k] = 64 * (k >> 1) + 16 * warp + g + 8 * (k & 1);
        wsi[k] = (u32)min(m0 + lr[k], n_out - 1) * (u32)nc;
    }
    u32 sw[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) sw[k] = f16g_load_scale<KIND>(sg, wsi, k, 0);

    float acc[2][32];
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int e = 0; e < 32; ++e) acc[h][e] = 0.f;

    load_chunk(0, 0);
    cp_async_commit();
    if (1 < nc) load_chunk(1, 1);
    cp_async_commit();

    const int q1s = 15 - 8 * (tg & 1) - (tg >> 1);
    const int q2r = 8 * (tg & 1) + 2 * (tg >> 1);
    // descriptor fields: 1024 bytes between k-adjacent core matrices, 128 between n-adjacent ones
    // (desc_swap puts them in each other's field: a switch for the first hardware check)
    const unsigned long long lbo = desc_swap ? 128 : 1024, sbo = desc_swap ? 1024 : 128;
    const unsigned long long desc_hi = ((lbo >> 4) << 16) | ((sbo >> 4) << 32);
    u32 a[NSETS][2][4];  // [register set][half][4]

    wgmma_fence();
    for (int c = 0; c < nc; ++c) {
        cp_async_wait<1>();
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();
        if (c + 2 < nc) load_chunk(c + 2, (c + 2) % GW_STAGES);
        cp_async_commit();
        u32 nsw[4] = {0, 0, 0, 0};
        if (c + 1 < nc) {
#pragma unroll
            for (int k = 0; k < 4; ++k) nsw[k] = f16g_load_scale<KIND>(sg, wsi, k, c + 1);
        }
        const int st = c % GW_STAGES;
        const u32 xaddr = smem_u32(s_x + st * GW_XSTAGE);
        u32 base[4][2];
        f16g_bases<KIND>(sw, base);
        u32 cw[4][KIND == 1 ? 4 : 8];
        f16g_code_words<KIND>(s_w + st * WSTAGE, lr, cw);
#pragma unroll
        for (int kk = 0; kk < 8; ++kk) {
            const int rs = kk % NSETS;
            // register set rs was read by the group NSETS steps ago: wait for it (NSETS - 1
            // groups may stay in flight)
            wgmma_wait<NSETS - 1>();
#pragma unroll
            for (int hm = 0; hm < 2; ++hm) f16g_a_frag<KIND>(cw, base, kk, hm, q1s, q2r, a[rs][hm]);
            wgmma_fence();
            const unsigned long long desc =
                desc_hi | (unsigned long long)(((xaddr + (u32)(2 * kk * 1024)) >> 4) & 0x3fffu);
            wgmma_m64n64k16(acc[0], a[rs][0], desc);
            wgmma_m64n64k16(acc[1], a[rs][1], desc);
            wgmma_commit();
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) sw[k] = nsw[k];
    }
    wgmma_wait<0>();
    cp_async_wait<0>();
    f16g_store<8>(acc, sg, lr, m0, n0, tg, xs, n, accumulate);
#endif
}

// Parameters as GH_ENTRY plus desc_swap. grid (ceil(n / 64), Σ ceil(n_out_i / 128)), block 128,
// GW_SMEM(KIND) bytes of dynamic shared memory. Empty unless compiled for sm_90a.
#define GW_ENTRY(NAME, KIND, NSETS)                                                                     \
    extern "C" __global__ void __launch_bounds__(128, 2) NAME(                                          \
        const u8* c0, const u16* sc0, float* y0, int n0, const u8* c1, const u16* sc1, float* y1,        \
        int n1, const u8* c2, const u16* sc2, float* y2, int n2, const u8* c3, const u16* sc3,           \
        float* y3, int n3, const u16* xh, const float* xs, int n_in, int n, int accumulate,             \
        int desc_swap) {                                                                                \
        GmSeg s0 = {c0, sc0, y0, n0}, s1 = {c1, sc1, y1, n1}, s2 = {c2, sc2, y2, n2},                    \
              s3 = {c3, sc3, y3, n3};                                                                   \
        gemmw_lowbit<KIND, NSETS>(s0, s1, s2, s3, xh, xs, n_in, n, accumulate, desc_swap);               \
    }
// 2 or 4 A register sets (1 or 3 wgmma groups left in flight at each step)
GW_ENTRY(gemmw_q1, 1, 2)
GW_ENTRY(gemmw_q2, 2, 2)
GW_ENTRY(gemmw_q2g64, 3, 2)
GW_ENTRY(gemmw_q1_s4, 1, 4)
GW_ENTRY(gemmw_q2_s4, 2, 4)
GW_ENTRY(gemmw_q2g64_s4, 3, 4)

// ---- f16 GEMM on wgmma with both operands in shared memory (gemmws) ---------------------------
//
// Same activations (act_q8_to_f16p, pair order) and the same exact f16 weights ((c − 1)·d, ±d) as
// gemmh / gemmw, but the weights are expanded once per CTA and chunk into an f16 tile in shared
// memory, so the tensor cores read both operands from shared memory: one
// wgmma.mma_async.m64nBNk16 per m64 half and k16 step, issued while the threads expand the next
// chunk. CTA = one warpgroup (128 threads), 2 per SM: 128 weight rows (two m64 halves) x BN = 64
// or 128 activation rows, k in chunks of GV_KC = 64.
//   * Per chunk c, thread t expands weight row t of the CTA tile: its code bytes (Q1 8, Q2 16)
//     come through the cp.async ring with the activations; its scale is read from global GV_SD
//     chunks ahead; the 8 units of 8 k (16 bytes of f16, in the activations' pair order) go to
//     A buffer c & 1.
//   * Shared tiles use wgmma's K-major layout with the 128-byte swizzle: a row's 64 f16 (the whole
//     chunk) are one 128-byte line, 16-byte unit kb of row r at byte r·128 + ((kb ^ (r & 7)) · 16),
//     tiles 1024-byte aligned. A descriptor of k16 step kk starts 32·kk bytes into the tile (A: plus
//     8192 for the second m64 half), 1024 bytes between 8-row groups. (The no-swizzle core-matrix
//     layout, measured first, ran at ~55 % of this speed: 220 against 410 TOPS on Q1 gate‖up.)
//   * Measured and dropped: two warpgroups per CTA (256 weight rows sharing the activation tile, 8
//     stages, 1 CTA per SM): 0.8x.
//   * Ring: ST stages, loads ST − 2 chunks ahead; at most one wgmma group (the previous chunk's)
//     is in flight when a stage or an A buffer is rewritten.
// Pair order inside a unit: positions 2j, 2j+1 of unit kb hold elements e and e + 2 of the chunk
// with e = 8kb + 4(j >> 1) + (j & 1). In the re-tiled code words:
//   Q1 (element 4i + b of a 32-element sub-block at bit 8b + i; unit kb: word kb >> 2, u = kb & 3):
//      register j holds bits (2u + (j>>1)) + 8(j&1) and that + 16: shifted left by
//      15 − 2u − (j>>1) − 8(j&1) they sit in the f16 sign bits; XOR onto −d.
//   Q2 (element 4s + i of a 16-element word at bits 8i + 2s; unit kb: word kb >> 1, half h = kb & 1):
//      register j holds the fields at r = 4h + 2(j>>1) + 8(j&1) and r + 16 (q2_h2).
// Per output the k16 steps run in order in the accumulator, so results do not depend on the grid,
// BN or n. K split (grid.z = S > 1, one segment, chosen by the host from the shape): slice z sums
// chunks [z·kc_split, (z + 1)·kc_split) into part[z] (raw, before the row factor), and
// gemm_splitk_sum adds the slices in z order.

#define GV_KC 64
#define GV_SD 4
#define GV_ABUF (128 * GV_KC * 2)
#define GV_XSTAGE(BN) ((BN) * GV_KC * 2)
#define GV_ST 4
#define GV_SMEM(BN) (2 * GV_ABUF + GV_ST * (GV_XSTAGE(BN) + 128 * 16))

__device__ __forceinline__ void cp_async4(void* smem, const void* gmem) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_u32(smem)), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async8(void* smem, const void* gmem) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(smem_u32(smem)), "l"(gmem) : "memory");
}

// ---- the b1-plane layout (kernels/mvbp.cu) read by the GEMM ------------------------------------
// The b1-plane code words hold 32 elements in their natural order (bit i = element i; Q2_0: one
// word per code bit plane). gemmws_expand_row takes the dp4a re-tiled words, so a b1-plane GEMM
// launch first permutes its words, by exchanges of bit-index bits (delta swaps: the bit at
// position p, whose index bits j = 1 and k = 0, trades places with the one at p + 2^k − 2^j).
// Then the expansion's f16 tile and every product are those of the dp4a-layout launch, bit for
// bit. Host twins: retile.rs (`b1p_word_to_q1`, `b1p_words_to_q2`), checked against `retile`.
__device__ __forceinline__ u32 delta_swap(u32 x, int d, u32 m) {
    const u32 t = ((x >> d) ^ x) & m;
    return x ^ t ^ (t << d);
}
// Q1_0: natural word (element n at bit n) → dp4a word (element 4i + b at bit 8b + i): the bit
// index (s4 s3 s2 s1 s0) becomes (s1 s0 s4 s3 s2), by the swaps (0 1), (0 2), (1 3), (2 4).
__device__ __forceinline__ u32 b1p_word_to_q1(u32 w) {
    w = delta_swap(w, 1, 0x22222222u);
    w = delta_swap(w, 3, 0x0a0a0a0au);
    w = delta_swap(w, 6, 0x00cc00ccu);
    return delta_swap(w, 12, 0x0000f0f0u);
}
// Q2_0: half k (elements 16k .. 16k + 15) of the two plane words (p0: code bit 0, p1: bit 1) →
// one word of 2-bit codes, element x = (x3 x2 x1 x0) at bits f(x) = 16·x1 + 8·x3 + 4·x2 + 2·x0
// (+ 1 for bit 1). Elements x and x + 2, the two halves of one f16x2 register of the expansion
// (the activations' pair order), are then 16 bits apart as in the dp4a word, so the expansion
// reads the fields of register j of unit h at 8h + 4·(j >> 1) + 2·(j & 1) instead of the dp4a
// word's 4h + 8·(j & 1) + 2·(j >> 1): the same codes, fewer steps than the dp4a order. The
// halves side by side (p1's above p0's) give the bit index (P x3 x2 x1 x0); the swaps (0 1),
// (0 4) make it (x1 x3 x2 x0 P).
__device__ __forceinline__ u32 b1p_words_to_q2(u32 p0, u32 p1, int k) {
    const u32 w = __byte_perm(p0, p1, k ? 0x7632 : 0x5410);
    return delta_swap(delta_swap(w, 1, 0x22222222u), 15, 0x0000aaaau);
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// d[32] += A (descriptor) x B (descriptor), m64n64k16, f32 accumulate, both K-major
__device__ __forceinline__ void wgmma_ss_m64n64k16(float* d, unsigned long long adesc, unsigned long long bdesc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "l"(adesc), "l"(bdesc)
                 : "memory");
}
// d[64] += A (descriptor) x B (descriptor), m64n128k16, f32 accumulate, both K-major
__device__ __forceinline__ void wgmma_ss_m64n128k16(float* d, unsigned long long adesc, unsigned long long bdesc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "l"(adesc), "l"(bdesc)
                 : "memory");
}
#endif

// The 8 units of weight row t's chunk (code words ws, f16x2 scale dd: Q1 −d, Q2 d) into its
// 128-byte line `arow` of the A buffer, unit kb at (kb ^ sw) · 16 (sw = t & 7: the swizzle).
// LB (Q2): the words of b1p_words_to_q2, whose fields sit elsewhere (the same f16 values).
template <int KIND, bool LB = false>
__device__ __forceinline__ void gemmws_expand_row(const u32* ws, u32 dd, u8* arow, int sw) {
#pragma unroll
    for (int kb = 0; kb < 8; ++kb) {
        uint4 v;
        if (KIND == 1) {
            const u32 w = ws[kb >> 2];
            const int u = kb & 3;
            v.x = sign_xor(w << (15 - 2 * u), dd);
            v.y = sign_xor(w << (7 - 2 * u), dd);
            v.z = sign_xor(w << (14 - 2 * u), dd);
            v.w = sign_xor(w << (6 - 2 * u), dd);
        } else {
            // register j's fields at r0 + (j & 1)·dj + (j >> 1)·dk: the dp4a word's 4h + 8·(j & 1)
            // + 2·(j >> 1), or (LB) b1p_words_to_q2's 8h + 2·(j & 1) + 4·(j >> 1)
            const u32 w = ws[kb >> 1];
            constexpr int dj = LB ? 2 : 8, dk = LB ? 4 : 2;
            const int r0 = (LB ? 8 : 4) * (kb & 1);
            v.x = q2_h2(w, r0, dd);
            v.y = q2_h2(w, r0 + dj, dd);
            v.z = q2_h2(w, r0 + dk, dd);
            v.w = q2_h2(w, r0 + dj + dk, dd);
        }
        *(uint4*)(arow + ((kb ^ sw) << 4)) = v;
    }
}

// The raw f16 scale of row o's block under 64-chunk c (Q1 / Q2: one per 128, g64: one per 64); 0
// past the last chunk.
template <int KIND>
__device__ __forceinline__ u32 gemmws_scale(const GmSeg& sg, u32 o, int n_in, int c) {
    if (c >= (n_in >> 6)) return 0u;
    return KIND == 3 ? (u32)__ldg(sg.scales + (size_t)o * (u32)(n_in >> 6) + c)
                     : (u32)__ldg(sg.scales + (size_t)o * (u32)(n_in >> 7) + (c >> 1));
}

// The same from the b1-plane scales ([n_out / 16][n_in / 128][8] u32: row 16T + g low, + 8 high).
__device__ __forceinline__ u32 gemmws_scale_b1p(const GmSeg& sg, u32 o, int n_in, int c) {
    if (c >= (n_in >> 6)) return 0u;
    const u32 nblk = (u32)(n_in >> 7);
    const u32 v = __ldg((const u32*)sg.scales + ((size_t)(o >> 4) * nblk + (u32)(c >> 1)) * 8 + (o & 7));
    return (o & 8) ? v >> 16 : v & 0xffffu;
}

// LB: the weights in the b1-plane layout (Q1 / Q2 g128 only): the chunk's code words (per plane,
// words 2·(c & 1) and + 1 of block c >> 1) are copied from it 8 bytes at a time, one word of two
// rows, and permuted (Q1: into the dp4a words; Q2: into b1p_words_to_q2's order) before the
// expansion: the same f16 tile.
template <int KIND, int BN, bool LB = false>
__device__ __forceinline__ void gemmws_lowbit(GmSeg s0, GmSeg s1, GmSeg s2, GmSeg s3, const u16* __restrict__ xh,
                                              const float* __restrict__ xs, int n_in, int n, int accumulate,
                                              int desc_swap, int kc_split, float* __restrict__ part) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ __align__(1024) u8 gv_smem[];
    constexpr int CBC = KIND == 1 ? 8 : 16;  // code bytes per weight row per chunk
    constexpr int ST = GV_ST, WSTAGE = 128 * 16;
    u8* s_a = gv_smem;                       // [2][GV_ABUF]: expanded weights (128 rows x 128 bytes)
    u8* s_x = gv_smem + 2 * GV_ABUF;         // [ST][GV_XSTAGE(BN)]: activations (BN rows x 128 bytes)
    u8* s_w = s_x + ST * GV_XSTAGE(BN);      // [ST][128][16]: code bytes

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, tg = lane & 3;
    int mt = blockIdx.y;
    GmSeg sg;
    if (!gm_segment(s0, s1, s2, s3, 128, mt, sg)) return;
    const int m0 = mt * 128;
    const int n0 = blockIdx.x * BN;
    const int n_out = sg.n_out;
    // K split (grid.z > 1, one segment): this CTA sums chunks [cb, ce) into part[z] (raw, no xs)
    const int nc_all = n_in / GV_KC;
    const int cb = blockIdx.z * kc_split, ce = min(nc_all, cb + kc_split);
    const int nc = ce - cb;
    const u32 o_mine = (u32)min(m0 + tid, n_out - 1);  // the weight row this thread expands
    static_assert(!LB || KIND == 1 || KIND == 2, "b1-plane layouts: Q1_0, Q2_0 g128");
    constexpr int PL = KIND == 1 ? 1 : 2;  // LB: code bit planes
    const u8* wsrc = sg.codes + (size_t)o_mine * ((size_t)nc_all * CBC) + (size_t)cb * CBC;
    // LB: the b1-plane tile of this thread's row (tile o >> 4: lane 4g + tg holds word tg of rows
    // g and g + 8, components 2·hb and 2·hb + 1 for block 2p + hb of pair p). The threads of rows
    // g and g + 8 share the loads: thread (g, up) copies word tg0 + up of both rows (8 bytes) into
    // word row 2q + up of the stage, whose row order puts g and g + 8 side by side (sidx)
    const int npair = n_in >> 8;
    const int g16 = tid & 7, up = (tid >> 3) & 1;
    const u32* wb1 = (const u32*)sg.codes + ((size_t)(o_mine >> 4) * npair * PL * 32 + 4 * g16 + up) * 4;
    const int sidx = (tid & ~15) + 2 * g16 + up;  // this row's word in a stage word row
    const u16* xsrc = xh + (size_t)cb * GV_KC;

    // local chunk c (global cb + c)
    auto load_chunk = [&](int c, int st) {
        u8* sx = s_x + st * GV_XSTAGE(BN);
#pragma unroll
        for (int m = 0; m < BN / 16; ++m) {
            int p = tid + 128 * m;
            int kb = p & 7, r = p >> 3;
            int tr = min(n0 + r, n - 1);
            cp_async16(sx + r * 128 + ((kb ^ (r & 7)) << 4),
                       (const u8*)(xsrc + (size_t)tr * n_in + (size_t)c * GV_KC + 8 * kb));
        }
        u8* sw = s_w + st * WSTAGE + tid * 16;
        if (LB) {
            // plane q's word tg0 + up of rows g, g + 8 into word row 2q + up ([4][128] u32: a
            // warp's 8-byte copies land in 64 consecutive bytes)
            const int cg = cb + c, b = cg >> 1, p = b >> 1, hb = b & 1, tg0 = 2 * (cg & 1);
            u8* sl = s_w + st * WSTAGE + ((tid & ~15) + 2 * g16) * 4;
#pragma unroll
            for (int q = 0; q < PL; ++q)
                cp_async8(sl + (2 * q + up) * 512, wb1 + (((size_t)p * PL + q) * 32 + tg0) * 4 + 2 * hb);
        } else if (KIND == 1) {
            cp_async8(sw, wsrc + (size_t)c * CBC);
        } else {
            cp_async16(sw, wsrc + (size_t)c * CBC);
        }
    };
    auto scale_of = [&](int c) -> u32 {
        return LB ? gemmws_scale_b1p(sg, o_mine, n_in, c) : gemmws_scale<KIND>(sg, o_mine, n_in, c);
    };

    // this thread's 4 output rows: k = 2·half + hf -> 64·half + 16·warp + g + 8·hf
    int lr[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) lr[k] = 64 * (k >> 1) + 16 * warp + g + 8 * (k & 1);

    float acc[2][BN / 2];
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int e = 0; e < BN / 2; ++e) acc[h][e] = 0.f;

#pragma unroll
    for (int st = 0; st < ST - 2; ++st) {
        if (st < nc) load_chunk(st, st);
        cp_async_commit();
    }
    // scales GV_SD chunks ahead: sc[i] is chunk c + i's
    u32 sc[GV_SD];
#pragma unroll
    for (int i = 0; i < GV_SD; ++i) sc[i] = scale_of(cb + i);

    // descriptors: 128-byte swizzle (layout type 1 in bits 62-63), 1024 bytes between 8-row groups,
    // leading offset unused (1). desc_swap drops A's swizzle bit: a switch for the hardware check.
    const unsigned long long b_hi = (1ull << 62) | (1ull << 16) | ((unsigned long long)(1024 >> 4) << 32);
    const unsigned long long a_hi = desc_swap ? ((1ull << 16) | ((unsigned long long)(1024 >> 4) << 32)) : b_hi;
    u8* arow0 = s_a + tid * 128;

    for (int c = 0; c < nc; ++c) {
        cp_async_wait<ST - 3>();  // chunk c's copies (this thread's) have landed
        wgmma_wait<1>();          // chunk c − 2's MMAs (A buffer c & 1, stage (c − 2) % ST) are done
        __syncthreads();
        {
            const int cn = c + ST - 2;
            if (cn < nc) load_chunk(cn, cn % ST);
            cp_async_commit();
        }
        const int st = c % ST;
        {
            u32 ws[4];
            if (LB) {
                // word rows {p0 tg0, p0 tg0 + 1, p1 tg0, p1 tg0 + 1}
                const u32* sl = (const u32*)(s_w + st * WSTAGE) + sidx;
                if (KIND == 1) {
                    ws[0] = b1p_word_to_q1(sl[0]);
                    ws[1] = b1p_word_to_q1(sl[128]);
                    ws[2] = ws[3] = 0;
                } else {
                    // the chunk's 4 words of 16 codes
                    const u32 a0 = sl[0], a1 = sl[128], b0 = sl[256], b1 = sl[384];
                    ws[0] = b1p_words_to_q2(a0, b0, 0);
                    ws[1] = b1p_words_to_q2(a0, b0, 1);
                    ws[2] = b1p_words_to_q2(a1, b1, 0);
                    ws[3] = b1p_words_to_q2(a1, b1, 1);
                }
            } else if (KIND == 1) {
                uint2 x = *(const uint2*)(s_w + st * WSTAGE + tid * 16);
                ws[0] = x.x;
                ws[1] = x.y;
                ws[2] = ws[3] = 0;
            } else {
                uint4 x = *(const uint4*)(s_w + st * WSTAGE + tid * 16);
                ws[0] = x.x;
                ws[1] = x.y;
                ws[2] = x.z;
                ws[3] = x.w;
            }
            const u32 dd = (KIND == 1 ? (sc[0] ^ 0x8000u) : sc[0]) * 0x00010001u;
            gemmws_expand_row<KIND, LB>(ws, dd, arow0 + (c & 1) * GV_ABUF, tid & 7);
        }
#pragma unroll
        for (int i = 0; i + 1 < GV_SD; ++i) sc[i] = sc[i + 1];
        sc[GV_SD - 1] = scale_of(cb + c + GV_SD);
        // the expanded tile and the landed activations, visible to the tensor cores (async proxy)
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();
        wgmma_fence();
        const u32 aaddr = smem_u32(s_a + (c & 1) * GV_ABUF);
        const u32 xaddr = smem_u32(s_x + st * GV_XSTAGE(BN));
#pragma unroll
        for (int kk = 0; kk < GV_KC / 16; ++kk) {
            const unsigned long long bdesc = b_hi | (unsigned long long)(((xaddr + (u32)(32 * kk)) >> 4) & 0x3fffu);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const unsigned long long adesc =
                    a_hi | (unsigned long long)(((aaddr + (u32)(32 * kk + 8192 * h)) >> 4) & 0x3fffu);
                if (BN == 128)
                    wgmma_ss_m64n128k16(acc[h], adesc, bdesc);
                else
                    wgmma_ss_m64n64k16(acc[h], adesc, bdesc);
            }
        }
        wgmma_commit();
    }
    wgmma_wait<0>();
    cp_async_wait<0>();
    if (part == nullptr) {
        f16g_store<BN / 8>(acc, sg, lr, m0, n0, tg, xs, n, accumulate);
    } else {
        // raw partial sums: part[z][t][o] (gemm_splitk_sum adds them in z order and scales)
        float* pz = part + (size_t)blockIdx.z * n * n_out;
#pragma unroll
        for (int j = 0; j < BN / 8; ++j)
#pragma unroll
            for (int e2 = 0; e2 < 2; ++e2) {
                const int t = n0 + 8 * j + 2 * tg + e2;
                if (t >= n) continue;
#pragma unroll
                for (int mi = 0; mi < 2; ++mi)
#pragma unroll
                    for (int hf = 0; hf < 2; ++hf) {
                        const int o = m0 + lr[2 * mi + hf];
                        if (o < n_out) pz[(size_t)t * n_out + o] = acc[mi][4 * j + 2 * hf + e2];
                    }
            }
    }
#endif
}

// y[t, o] (+)= (Σ_z part[z][t][o], z = 0 .. nz − 1 in order) · xs[t]: the K-split GEMM's sum.
// grid ceil(n·n_out / 256), block 256.
extern "C" __global__ void gemm_splitk_sum(const float* __restrict__ part, int nz, int n, int n_out,
                                           const float* __restrict__ xs, float* __restrict__ y, int accumulate) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x, total = (size_t)n * n_out;
    if (i >= total) return;
    float v = part[i];
    for (int z = 1; z < nz; ++z) v += part[(size_t)z * total + i];
    v *= xs[i / n_out];
    y[i] = accumulate ? y[i] + v : v;
}

// Parameters as GW_ENTRY plus the K split: kc_split chunks per grid.z slice and part (null: no
// split, write y). grid (ceil(n / BN), Σ ceil(n_out_i / 128), splits), block 128, GV_SMEM(BN)
// bytes of dynamic shared memory (2 CTAs per SM). Empty unless compiled for sm_90a.
#define GV_ENTRY(NAME, KIND, BN, LB)                                                                    \
    extern "C" __global__ void __launch_bounds__(128, 2) NAME(                                          \
        const u8* c0, const u16* sc0, float* y0, int n0, const u8* c1, const u16* sc1, float* y1,        \
        int n1, const u8* c2, const u16* sc2, float* y2, int n2, const u8* c3, const u16* sc3,           \
        float* y3, int n3, const u16* xh, const float* xs, int n_in, int n, int accumulate,             \
        int desc_swap, int kc_split, float* part) {                                                     \
        GmSeg s0 = {c0, sc0, y0, n0}, s1 = {c1, sc1, y1, n1}, s2 = {c2, sc2, y2, n2},                    \
              s3 = {c3, sc3, y3, n3};                                                                   \
        gemmws_lowbit<KIND, BN, LB>(s0, s1, s2, s3, xh, xs, n_in, n, accumulate, desc_swap,              \
                                     kc_split, part);                                                   \
    }
GV_ENTRY(gemmws_q1, 1, 128, false)
GV_ENTRY(gemmws_q2, 2, 128, false)
GV_ENTRY(gemmws_q2g64, 3, 128, false)
GV_ENTRY(gemmws_q1_n64, 1, 64, false)
GV_ENTRY(gemmws_q2_n64, 2, 64, false)
GV_ENTRY(gemmws_q2g64_n64, 3, 64, false)
// the b1-plane layout (Launcher: Gpu::gemm_b1p_multi)
GV_ENTRY(gemmws_q1_b1p, 1, 128, true)
GV_ENTRY(gemmws_q2_b1p, 2, 128, true)
GV_ENTRY(gemmws_q1_b1p_n64, 1, 64, true)
GV_ENTRY(gemmws_q2_b1p_n64, 2, 64, true)

