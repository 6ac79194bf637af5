// Tensor-core low-bit mat-vec for 1 <= n <= MAXN activation rows (decode and speculative verify).
// Appended after prefill.cu by lib.rs (one translation unit: MvSeg, h2f, PDL_ENTRY of bonsai.cu and
// smem_u32, cp_async_commit / cp_async_wait, GM_MAGIC of gemm.cu are in scope).
//
// STATUS: off by default: it runs only when the launch plan says `mma` (BONSAI_CUDA_MV_MMA=1, or a
// plan forced by a test or the sweep). The ring form passed tests/gpu_kernels.rs `matvec_mma_*` on
// the H200 but was slower than dp4a at n = 1 (tests/cuda_mv_sweep.rs); the direct form at the end
// of this file is the second attempt.
//
// Same interface and semantics as mv_lowbit (bonsai.cu): up to 4 segments sharing the input,
// y (+)= W·x for activation rows t < n. Per 32-element sub-block j the integer dot of 16 weight rows
// with the (up to) 8 activation rows is one mma.m16n8k32 (A: weight codes unpacked in registers,
// B: activation bytes, columns >= n zero), so an n = 8 launch issues the same instructions as n = 1
// (only the f32 rescale of each thread's second column is skipped when n = 1).
//
// Codes enter A as non-negative bytes and the activation block sums s(t, j) correct the offset
// exactly in the MMA's C operand: C = MAGIC − s(t, j) for column t, so D = MAGIC + isum with
//   Q1: A = 2·bit ∈ {0, 2}:      Σ 2·bit·q − s = Σ (±1)·q
//   Q2: A = code ∈ {0, 1, 2, 3}: Σ code·q − s  = Σ (code − 1)·q
// and D read as f32, minus MAGIC, is that integer exactly (the magic-number trick of gemm.cu:
// |isum| <= 32·2·127 < 2^22). The rescale of one output (row o, column t) is, in this fixed order:
//   p_b = Σ_{sub-blocks j of scale block b, increasing} xd(t, j)·isum(o, t, j)   (first: a product)
//   acc = Σ_{blocks b of the warp's K part, increasing} ws(o, b)·p_b              (fmaf)
//   y   = Σ_{K parts kp = 0, 1, ..} acc_kp                                        (shared memory)
// Nothing in it depends on the other columns or on n, so row t of an n-row launch equals the
// 1-row launch bit for bit. It is NOT bit-equal to the dp4a mat-vec (that one rescales per
// sub-block; equal within f32 rounding), so the switch applies to every n of a matrix.
//
// Fragment layouts as in gemm.cu (PTX ISA, "Matrix Fragments for mma.m16n8k32", integer types),
// g = lane >> 2, tg = lane & 3; logical k 4tg+e <-> physical element 8tg+e and 16+4tg+e <-> 8tg+4+e,
// so a thread's B registers are the 8 consecutive activation bytes 8tg..8tg+7 of activation row g
// (one 8-byte load) and its A registers of a weight row come from one code word:
//   Q1 (bit i of byte b = element 4i+b; word = sub-block): x = w >> 2tg;
//       lo = (x << 1) & 0x02020202 (plane 2tg, elements 8tg..+3), hi = x & 0x02020202 (plane 2tg+1)
//   Q2 (field s of byte i = element 4s+i of a 16-element word; sub-block = words 0, 1): word tg>>1,
//       x = w >> 4(tg&1); lo = x & 0x03030303 (field 2(tg&1)), hi = (x >> 2) & 0x03030303
// (4 integer ops per word, 2 per A register; a0/a2 = row g lo/hi, a1/a3 = row g+8 lo/hi).
//
// Work split: block = MVM_WARPS warps; warp w owns RT m16 tiles (16·RT consecutive rows of one
// segment; tiles never straddle segments) and K part kp = w % KS. A row's codes are cut into
// chunks of MVM_CB = 64 bytes (Q1: 16 sub-blocks, 4 scale blocks; Q2: 8 sub-blocks, 2 g128 / 4 g64
// blocks); chunk c belongs to part c % KS. Each warp streams its chunks through a private
// STAGES-deep shared-memory ring with cp.async: 16-byte copies of the codes (a row's 64 bytes are
// two full 32-byte sectors) and 4-byte copies of the f16 weight scales, so (STAGES−1)·16·RT·64
// bytes of weights are in flight per warp without holding registers, and the loop needs no block
// barrier (cp.async.wait_group + __syncwarp). With `pre` the first STAGES−1 chunks are requested
// before the PDL wait (weights are never written on the device). Fragments are read back with
// conflict-free 16-byte (Q1) / 4-byte (Q2) shared loads (row stride 80 bytes: rows g = 0..7 start
// on distinct 16-byte bank groups; the 4 threads of a group read the same word: broadcast).
// Activations (q, d, s; small, L1/L2-resident) are read with __ldg once per scale block and shared
// by the RT tiles, only by threads whose activation row / columns are < n.
//
// Alignment: q 8 bytes, d and s 16 bytes (8 for g64); the launcher checks. Codes of every row are
// 16-byte aligned (re-tiled planes). The scale plane may start at any even address (a one-row
// segment of an odd-nblk matrix): it is read in aligned 4-byte words, zero-filling past its end.

#define MVM_WARPS 4
#define MVM_CB 64   // code bytes per weight row per chunk
#define MVM_RS 80   // shared-memory row stride of the code ring (64 + 16: conflict-free)
#define MVM_SW 4    // scale words per row per stage (<= 3 used: 4 halves starting at an odd half)

// d = A·B + C with C = (ca, cb, ca, cb): per-column initial values (rows g and g+8 share them).
__device__ __forceinline__ void mma_s8_c(int* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1, int ca,
                                         int cb) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%11,%12,%13};\n"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "r"(ca), "r"(cb), "r"(ca), "r"(cb));
}

// One code word -> this thread's two A registers (see the header).
template <int KIND>
__device__ __forceinline__ void mvm_unpack(u32 w, int tg, u32& lo, u32& hi) {
    if (KIND == 1) {
        u32 x = w >> (2 * tg);
        lo = (x << 1) & 0x02020202u;
        hi = x & 0x02020202u;
    } else {
        u32 x = w >> (4 * (tg & 1));
        lo = x & 0x03030303u;
        hi = (x >> 2) & 0x03030303u;
    }
}

// One scale block of one m16 tile, shared by the ring and the direct kernels: per sub-block u the
// MMA of the unpacked codes of rows g (wa) and g + 8 (wb) with the activation bytes, then
//   p = xd(u0)·isum(u0), p = fmaf(isum(u), xd(u), p) ..   (exact integers, see the header)
//   acc = fmaf(p, ws, acc)                                 (ws: the row's f16 weight scale)
// for this thread's column 2tg (and 2tg + 1 when C2). __fmul_rn / __fadd_rn: never contracted.
template <int KIND, int SPB, bool C2>
__device__ __forceinline__ void mvm_block(const u32* wa, const u32* wb, int tg, const uint2* bq, const u32* xa,
                                          const u32* ca, const u32* xb, const u32* cb, float wsa, float wsb,
                                          float (&acc)[4]) {
    float p[4];
#pragma unroll
    for (int u = 0; u < SPB; ++u) {
        u32 la, ha, lb, hb;
        mvm_unpack<KIND>(wa[u], tg, la, ha);
        mvm_unpack<KIND>(wb[u], tg, lb, hb);
        int d[4];
        mma_s8_c(d, la, lb, ha, hb, bq[u].x, bq[u].y, (int)ca[u], (int)cb[u]);
        const float f0 = __fadd_rn(__int_as_float(d[0]), -GM_MAGIC_F);
        const float f2 = __fadd_rn(__int_as_float(d[2]), -GM_MAGIC_F);
        const float x0 = __uint_as_float(xa[u]);
        if (u == 0) {
            p[0] = __fmul_rn(f0, x0);
            p[2] = __fmul_rn(f2, x0);
        } else {
            p[0] = fmaf(f0, x0, p[0]);
            p[2] = fmaf(f2, x0, p[2]);
        }
        if (C2) {
            const float f1 = __fadd_rn(__int_as_float(d[1]), -GM_MAGIC_F);
            const float f3 = __fadd_rn(__int_as_float(d[3]), -GM_MAGIC_F);
            const float x1 = __uint_as_float(xb[u]);
            if (u == 0) {
                p[1] = __fmul_rn(f1, x1);
                p[3] = __fmul_rn(f3, x1);
            } else {
                p[1] = fmaf(f1, x1, p[1]);
                p[3] = fmaf(f3, x1, p[3]);
            }
        }
    }
    acc[0] = fmaf(p[0], wsa, acc[0]);
    acc[2] = fmaf(p[2], wsb, acc[2]);
    if (C2) {
        acc[1] = fmaf(p[1], wsa, acc[1]);
        acc[3] = fmaf(p[3], wsb, acc[3]);
    }
}

// SPB consecutive 32-bit words (16-byte aligned for 4, 8-byte for 2), or zeros when !live.
template <int SPB>
__device__ __forceinline__ void mvm_ldv(const u32* p, bool live, u32* v) {
    if (SPB == 4) {
        uint4 t;
        t.x = t.y = t.z = t.w = 0u;
        if (live) t = __ldg((const uint4*)p);
        v[0] = t.x;
        v[1] = t.y;
        v[2] = t.z;
        v[3] = t.w;
    } else {
        uint2 t;
        t.x = t.y = 0u;
        if (live) t = __ldg((const uint2*)p);
        v[0] = t.x;
        v[1] = t.y;
    }
}

// The activation side of one scale block (sub-blocks jb .. jb + SPB − 1), shared by the RT tiles of
// the ring and the direct kernels: B fragments (8 bytes of activation row g, zero unless rowq),
// the activation scales of this thread's columns (xa, xb) and C = MAGIC − s (ca, cb; see the
// header), zeros / MAGIC for columns that are not live.
template <int SPB, bool C2>
__device__ __forceinline__ void mvm_block_acts(int jb, bool rowq, const i8* qg, bool colA, const u32* dA,
                                               const u32* sA, bool colB, const u32* dB, const u32* sB, uint2* bq,
                                               u32* xa, u32* ca, u32* xb, u32* cb) {
#pragma unroll
    for (int u = 0; u < SPB; ++u) {
        bq[u].x = bq[u].y = 0u;
        if (rowq) bq[u] = __ldg((const uint2*)(qg + (size_t)(jb + u) * 32));
    }
    mvm_ldv<SPB>(dA + jb, colA, xa);
    mvm_ldv<SPB>(sA + jb, colA, ca);
    if (C2) {
        mvm_ldv<SPB>(dB + jb, colB, xb);
        mvm_ldv<SPB>(sB + jb, colB, cb);
    }
#pragma unroll
    for (int u = 0; u < SPB; ++u) {
        ca[u] = (u32)GM_MAGIC - ca[u];
        cb[u] = C2 ? (u32)GM_MAGIC - cb[u] : (u32)GM_MAGIC;
    }
}

// The K-split combine and the store, shared by both tensor-core mat-vecs: tile t, fragment e ->
// row o0 + 16t + g + 8(e >> 1), column 2tg + (e & 1); the KS partials are summed in warp order.
template <int RT, int KS, bool C2>
__device__ __forceinline__ void mvm_store(float (&acc)[RT][4], float* part, const MvSeg sg, const bool valid,
                                          const int o0, int n, int accumulate) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, tg = lane & 3;
    const int kp = w % KS;
    if (KS > 1) {
#pragma unroll
        for (int t = 0; t < RT; ++t)
#pragma unroll
            for (int e = 0; e < 4; ++e) part[(w * (RT * 4) + t * 4 + e) * 32 + lane] = acc[t][e];
        __syncthreads();
        if (!valid || kp != 0) return;
#pragma unroll
        for (int t = 0; t < RT; ++t)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float v = part[(w * (RT * 4) + t * 4 + e) * 32 + lane];
#pragma unroll
                for (int k2 = 1; k2 < KS; ++k2) v += part[((w + k2) * (RT * 4) + t * 4 + e) * 32 + lane];
                acc[t][e] = v;
            }
    }
    if (!valid) return;
#pragma unroll
    for (int t = 0; t < RT; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            if (!C2 && (e & 1)) continue;
            const int o = o0 + 16 * t + g + 8 * (e >> 1), col = 2 * tg + (e & 1);
            if (col < n && o < sg.n_out) {
                float* yp = sg.y + (size_t)col * sg.n_out + o;
                *yp = accumulate ? *yp + acc[t][e] : acc[t][e];
            }
        }
}

// C2: whether the thread's second column (2tg+1) is computed (n > 1). Column 2tg's arithmetic is
// the same code either way (batch invariance).
template <int KIND, int RT, int KS, int STAGES, bool C2>
__device__ __forceinline__ void mvm_body(const MvSeg sg, const bool valid, const int o0,
                                         const i8* __restrict__ q, const float* __restrict__ da,
                                         const int* __restrict__ sa, int n_in, int n, int accumulate,
                                         int pre, u8* s_c, u32* s_s, float* part) {
    const int BE = KIND == 3 ? 64 : 128;  // elements per scale block
    const int SPB = BE / 32;              // sub-blocks per scale block
    const int SBB = KIND == 1 ? 4 : 8;    // code bytes per sub-block
    const int SPC = MVM_CB / SBB;         // sub-blocks per chunk
    const int BPC = SPC / SPB;            // scale blocks per chunk (even)
    const int ROWS = 16 * RT;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, tg = lane & 3;
    const int kp = w % KS;
    const int nsb = n_in >> 5, nblk = n_in / BE;
    const int rowb = nsb * SBB;                        // code bytes per row
    const int nch = (rowb + MVM_CB - 1) / MVM_CB;      // chunks per row
    const int nmy = (valid && kp < nch) ? (nch - kp + KS - 1) / KS : 0;  // chunks kp, kp+KS, ..
    const int n_out = valid ? sg.n_out : 1;
    const u8* codes = (const u8*)sg.codes;
    // the scale plane in aligned words: hoff = halves before it in its first word, htot = halves
    // from that word to the plane's end
    const u32* sbase = (const u32*)((size_t)sg.scales & ~(size_t)3);
    const int hoff = (int)(((size_t)sg.scales >> 1) & 1);
    const u32 htot = (u32)hoff + (u32)n_out * (u32)nblk;
    u8* my_c = s_c + w * (STAGES * ROWS * MVM_RS);
    u32* my_s = s_s + w * (STAGES * ROWS * MVM_SW);

    // copy my i-th chunk (chunk kp + KS·i) into stage i % STAGES (32-bit offsets: a plane is
    // < 4 GiB)
    auto issue = [&](int i) {
        const int c = kp + KS * i, st = i % STAGES;
        const u32 dc = smem_u32(my_c + st * (ROWS * MVM_RS));
        const u32 ds = smem_u32(my_s + st * (ROWS * MVM_SW));
#pragma unroll
        for (int it = 0; it < 2 * RT; ++it) {  // ROWS rows x 4 pieces of 16 bytes
            const int p = lane + 32 * it, r = p >> 2, pc = p & 3;
            const int off = c * MVM_CB + pc * 16;
            if (off < rowb) {
                const u32 o = (u32)min(o0 + r, n_out - 1);
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dc + r * MVM_RS + pc * 16),
                             "l"(codes + (o * (u32)rowb + (u32)off))
                             : "memory");
            }
        }
        const int b0 = c * BPC, nb = min(BPC, nblk - b0);  // the chunk's blocks in a row (>= 1)
#pragma unroll
        for (int it = 0; it < (3 * ROWS + 31) / 32; ++it) {  // ROWS rows x up to 3 words
            const int p = lane + 32 * it;
            if (p < 3 * ROWS) {
                const int r = p / 3, k = p - 3 * r;
                const u32 o = (u32)min(o0 + r, n_out - 1);
                const u32 h0 = (u32)hoff + o * (u32)nblk + (u32)b0;  // first half (from sbase)
                const u32 wi = (h0 >> 1) + (u32)k;
                if (2 * wi <= h0 + (u32)nb - 1) {
                    const u32 left = 2 * (htot - 2 * wi);  // plane bytes from this word on
                    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(ds + (r * MVM_SW + k) * 4),
                                 "l"(sbase + wi), "r"(left >= 4 ? 4 : (int)left)
                                 : "memory");
                }
            }
        }
    };

    // parity of the first half of this thread's rows' chunk scales in their first word (the
    // chunk's first block is even, so it is the row's own parity)
    int par[RT][2];
#pragma unroll
    for (int t = 0; t < RT; ++t)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int o = min(o0 + 16 * t + g + 8 * h, n_out - 1);
            par[t][h] = (hoff + (o & nblk & 1)) & 1;
        }
    float acc[RT][4];
#pragma unroll
    for (int t = 0; t < RT; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[t][e] = 0.f;

    // weights are never written on the device: with `pre` the first chunks are requested before
    // the PDL wait, overlapping the previous kernel's tail
    if (!pre) PDL_ENTRY();
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < nmy) issue(s);
        cp_async_commit();
    }
    if (pre) PDL_ENTRY();

    const bool rowq = g < n;                         // activation row g (B column g) is live
    const bool colA = 2 * tg < n;                    // this thread's first column
    const bool colB = C2 && 2 * tg + 1 < n;          // its second column
    const i8* qg = q + (size_t)(rowq ? g : 0) * n_in + 8 * tg;
    const u32* dA = (const u32*)da + (size_t)(colA ? 2 * tg : 0) * nsb;
    const u32* sA = (const u32*)sa + (size_t)(colA ? 2 * tg : 0) * nsb;
    const u32* dB = (const u32*)da + (size_t)(colB ? 2 * tg + 1 : 0) * nsb;
    const u32* sB = (const u32*)sa + (size_t)(colB ? 2 * tg + 1 : 0) * nsb;

    for (int i = 0; i < nmy; ++i) {
        // my chunk i has landed (only the newest STAGES−2 groups may be pending), for all lanes
        cp_async_wait<STAGES - 2>();
        __syncwarp();
        // refill the stage read in iteration i−1 (every lane passed the __syncwarp above)
        if (i + STAGES - 1 < nmy) issue(i + STAGES - 1);
        cp_async_commit();
        const int c = kp + KS * i, st = i % STAGES;
        const u8* sc = my_c + st * (ROWS * MVM_RS);
        const u16* ss = (const u16*)(my_s + st * (ROWS * MVM_SW));
#pragma unroll 1
        for (int b = 0; b < BPC; ++b) {
            const int jb = c * SPC + b * SPB;  // first sub-block of this scale block
            if (jb >= nsb) break;              // partial last chunk (warp-uniform)
            // activation side of the block's SPB sub-blocks, shared by the RT tiles
            uint2 bq[SPB];
            u32 xa[SPB], ca[SPB], xb[SPB], cb[SPB];
            mvm_block_acts<SPB, C2>(jb, rowq, qg, colA, dA, sA, colB, dB, sB, bq, xa, ca, xb, cb);
#pragma unroll
            for (int t = 0; t < RT; ++t) {
                const int ra = 16 * t + g, rb = ra + 8;
                const u8* pa = sc + ra * MVM_RS;
                const u8* pb = sc + rb * MVM_RS;
                u32 wa[SPB], wb[SPB];
                if (KIND == 1) {
                    // one 16-byte read per row: the block's 4 sub-block words
                    uint4 va = *(const uint4*)(pa + 16 * b), vb = *(const uint4*)(pb + 16 * b);
                    wa[0] = va.x;
                    wa[1] = va.y;
                    wa[2] = va.z;
                    wa[3] = va.w;
                    wb[0] = vb.x;
                    wb[1] = vb.y;
                    wb[2] = vb.z;
                    wb[3] = vb.w;
                } else {
#pragma unroll
                    for (int u = 0; u < SPB; ++u) {
                        const int off = 8 * (b * SPB + u) + 4 * (tg >> 1);
                        wa[u] = *(const u32*)(pa + off);
                        wb[u] = *(const u32*)(pb + off);
                    }
                }
                mvm_block<KIND, SPB, C2>(wa, wb, tg, bq, xa, ca, xb, cb, h2f(ss[ra * (2 * MVM_SW) + par[t][0] + b]),
                                         h2f(ss[rb * (2 * MVM_SW) + par[t][1] + b]), acc[t]);
            }
        }
    }
    // drain the (empty) trailing groups before the ring is reused or the block exits
    cp_async_wait<0>();

    mvm_store<RT, KS, C2>(acc, part, sg, valid, o0, n, accumulate);
}

// The segment holding row group gw (groups of `rows` rows never straddle two matrices); gw becomes
// the group index inside it. `valid` is false past the last segment (such warps still take part in
// the block barrier of the K split).
__device__ __forceinline__ MvSeg mvm_find_seg(MvSeg s0, MvSeg s1, MvSeg s2, MvSeg s3, int rows, int& gw,
                                              bool& valid) {
    int g0 = (s0.n_out + rows - 1) / rows, g1 = (s1.n_out + rows - 1) / rows,
        g2 = (s2.n_out + rows - 1) / rows, g3 = (s3.n_out + rows - 1) / rows;
    valid = true;
    if (gw < g0) return s0;
    if ((gw -= g0) < g1) return s1;
    if ((gw -= g1) < g2) return s2;
    if ((gw -= g2) < g3) return s3;
    valid = false;
    return s0;
}

template <int KIND, int RT, int KS, int STAGES>
__device__ __forceinline__ void mvm_lowbit(MvSeg s0, MvSeg s1, MvSeg s2, MvSeg s3, const i8* __restrict__ q,
                                           const float* __restrict__ da, const int* __restrict__ sa,
                                           int n_in, int n, int accumulate, int pre) {
    const int ROWS = 16 * RT;
    const int G = MVM_WARPS / KS;  // row groups per block
    __shared__ __align__(16) u8 s_c[MVM_WARPS * STAGES * ROWS * MVM_RS];
    __shared__ __align__(16) u32 s_s[MVM_WARPS * STAGES * ROWS * MVM_SW];
    __shared__ float part[KS > 1 ? MVM_WARPS * RT * 4 * 32 : 1];
    int gw = blockIdx.x * G + (threadIdx.x >> 5) / KS;  // row group of this warp
    bool valid = true;
    MvSeg sg = mvm_find_seg(s0, s1, s2, s3, ROWS, gw, valid);
    const int o0 = gw * ROWS;
    if (n > 1) {
        mvm_body<KIND, RT, KS, STAGES, true>(sg, valid, o0, q, da, sa, n_in, n, accumulate, pre, s_c, s_s,
                                             part);
    } else {
        mvm_body<KIND, RT, KS, STAGES, false>(sg, valid, o0, q, da, sa, n_in, n, accumulate, pre, s_c, s_s,
                                              part);
    }
}

// Parameters exactly as MV_ENTRY (bonsai.cu). grid ceil(Σ ceil(n_out_i / 16·RT) / (MVM_WARPS / KS)),
// block MVM_WARPS·32. Ring depth: 4 stages for one tile per warp, 3 for two (shared memory
// 26.6 / 40 KB per block).
#define MVM_ENTRY(NAME, KIND, RT, KS, MINB)                \
    MV_SEG_ENTRY(NAME, MVM_WARPS, MINB, const i8*, q,     \
                 mvm_lowbit<KIND, RT, KS, RT == 1 ? 4 : 3>(s0, s1, s2, s3, q, da, sa, n_in, n, accumulate, pre))
// `_r1` / `_r2`: one or two m16 tiles (16 / 32 weight rows) per warp; `_kKS`: K split over KS warps
// of the block. Every variant takes 1..8 activation rows. KS changes the float order, so the
// launcher picks it from the matrix shape alone (never from n).
#define MVM_KIND_ENTRIES(K, KIND)                 \
    MVM_ENTRY(mvm_##K##_r1_k1, KIND, 1, 1, 5)     \
    MVM_ENTRY(mvm_##K##_r1_k2, KIND, 1, 2, 5)     \
    MVM_ENTRY(mvm_##K##_r1_k4, KIND, 1, 4, 5)     \
    MVM_ENTRY(mvm_##K##_r2_k1, KIND, 2, 1, 3)     \
    MVM_ENTRY(mvm_##K##_r2_k2, KIND, 2, 2, 3)     \
    MVM_ENTRY(mvm_##K##_r2_k4, KIND, 2, 4, 3)
MVM_KIND_ENTRIES(q1, 1)
MVM_KIND_ENTRIES(q2, 2)
MVM_KIND_ENTRIES(q2g64, 3)

// ---- direct-load variant (`mvd_*`) ------------------------------------------------------------
// The same arithmetic, in the same order, as mvm_body above (so its output equals the ring kernel's
// bit for bit, and row t of an n-row launch equals the 1-row launch), with the weights loaded
// straight into registers instead of through a shared-memory ring: the ring's cp.async issue
// (address math per 16-byte piece and per scale word) and its shared-memory reads cost more
// issue slots than the mat-vec itself at n = 1. Each warp walks its K part in steps of 32 (Q1) or
// 64 (Q2) code bytes per row; NS (2) steps of codes and scales are held in a register ring
// (unrolled so every slot index is a compile-time constant). A thread loads what its fragments
// need: Q1 the whole 16-byte block of rows g and g+8 (the 4 threads of a group read the same
// address: one request), Q2 its 4-byte word of each sub-block.
//   Q1:    step = 2 blocks (32 bytes/row, one sector), 8 words per row per thread
//   Q2:    step = 2 blocks (64 bytes/row), word tg>>1 of each of the 8 sub-blocks
//   Q2g64: step = 4 blocks (64 bytes/row), word tg>>1 of each of the 8 sub-blocks
template <int KIND, int RT>
struct MvdSlot {
    u32 w[RT][2][8];   // [tile][row g / g+8][word of the step]
    u16 ws[RT][2][4];  // [tile][row][block of the step] f16 weight scales (Q1: 2 used, Q2: 2, g64: 4)
};

template <int KIND, int RT, int KS, int NS, bool C2>
__device__ __forceinline__ void mvd_body(const MvSeg sg, const bool valid, const int o0, const i8* __restrict__ q,
                                         const float* __restrict__ da, const int* __restrict__ sa, int n_in,
                                         int n, int accumulate, int pre, float* part) {
    const int BE = KIND == 3 ? 64 : 128;  // elements per scale block
    const int SPB = BE / 32;              // sub-blocks per scale block
    const int SBB = KIND == 1 ? 4 : 8;    // code bytes per sub-block
    const int SPC = MVM_CB / SBB;         // sub-blocks per chunk
    const int BPC = SPC / SPB;            // scale blocks per chunk
    const int S = KIND == 1 ? 2 : BPC;    // scale blocks per step
    const int SPCH = BPC / S;             // steps per chunk
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, tg = lane & 3;
    const int kp = w % KS;
    const int nsb = n_in >> 5, nblk = n_in / BE;
    const int rowb = nsb * SBB;
    const int nch = (rowb + MVM_CB - 1) / MVM_CB;
    const int nmy = (valid && kp < nch) ? (nch - kp + KS - 1) / KS : 0;
    const int nst = nmy * SPCH;  // steps of this warp (the last may hold blocks past nblk)
    const int n_out = valid ? sg.n_out : 1;
    const u8* codes = (const u8*)sg.codes;
    // per (tile, row half): clamped row (rows past n_out load the last row; never stored)
    const u8* crow[RT][2];
    const u16* srow[RT][2];
#pragma unroll
    for (int t = 0; t < RT; ++t)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const size_t o = (size_t)min(o0 + 16 * t + g + 8 * h, n_out - 1);
            crow[t][h] = codes + o * (size_t)rowb + (KIND == 1 ? 0 : 4 * (tg >> 1));
            srow[t][h] = sg.scales + o * (size_t)nblk;
        }
    // first scale block of step i
    auto step_blk = [&](int i) { return (kp + KS * (i / SPCH)) * BPC + (i % SPCH) * S; };
    auto load = [&](MvdSlot<KIND, RT>& sl, int i) {
        const int b0 = step_blk(i);
#pragma unroll
        for (int t = 0; t < RT; ++t)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
#pragma unroll
                for (int b = 0; b < S; ++b) {
                    const bool live = b0 + b < nblk;
                    if (KIND == 1) {
                        uint4 v;
                        v.x = v.y = v.z = v.w = 0u;
                        if (live) v = __ldg((const uint4*)(crow[t][h] + 16 * (b0 + b)));
                        sl.w[t][h][4 * b + 0] = v.x;
                        sl.w[t][h][4 * b + 1] = v.y;
                        sl.w[t][h][4 * b + 2] = v.z;
                        sl.w[t][h][4 * b + 3] = v.w;
                    } else {
#pragma unroll
                        for (int u = 0; u < SPB; ++u)
                            sl.w[t][h][SPB * b + u] =
                                live ? __ldg((const u32*)(crow[t][h] + 8 * (SPB * (b0 + b) + u))) : 0u;
                    }
                    sl.ws[t][h][b] = live ? __ldg(srow[t][h] + b0 + b) : (u16)0;
                }
            }
    };

    const bool rowq = g < n;
    const bool colA = 2 * tg < n;
    const bool colB = C2 && 2 * tg + 1 < n;
    const i8* qg = q + (size_t)(rowq ? g : 0) * n_in + 8 * tg;
    const u32* dA = (const u32*)da + (size_t)(colA ? 2 * tg : 0) * nsb;
    const u32* sA = (const u32*)sa + (size_t)(colA ? 2 * tg : 0) * nsb;
    const u32* dB = (const u32*)da + (size_t)(colB ? 2 * tg + 1 : 0) * nsb;
    const u32* sB = (const u32*)sa + (size_t)(colB ? 2 * tg + 1 : 0) * nsb;

    float acc[RT][4];
#pragma unroll
    for (int t = 0; t < RT; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[t][e] = 0.f;

    auto compute = [&](const MvdSlot<KIND, RT>& sl, int i) {
        const int b0 = step_blk(i);
#pragma unroll
        for (int b = 0; b < S; ++b) {
            if (b0 + b >= nblk) break;  // warp-uniform
            const int jb = (b0 + b) * SPB;
            uint2 bq[SPB];
            u32 xa[SPB], ca[SPB], xb[SPB], cb[SPB];
            mvm_block_acts<SPB, C2>(jb, rowq, qg, colA, dA, sA, colB, dB, sB, bq, xa, ca, xb, cb);
#pragma unroll
            for (int t = 0; t < RT; ++t) {
                mvm_block<KIND, SPB, C2>(&sl.w[t][0][SPB * b], &sl.w[t][1][SPB * b], tg, bq, xa, ca, xb, cb,
                                         h2f(sl.ws[t][0][b]), h2f(sl.ws[t][1][b]), acc[t]);
            }
        }
    };

    MvdSlot<KIND, RT> sl[NS];
    // weights are never written on the device: with `pre` the first NS−1 steps are requested
    // before the PDL wait
    if (!pre) PDL_ENTRY();
#pragma unroll
    for (int s = 0; s < NS - 1; ++s)
        if (s < nst) load(sl[s], s);
    if (pre) PDL_ENTRY();
    for (int i0 = 0; i0 < nst; i0 += NS) {
#pragma unroll
        for (int s = 0; s < NS; ++s) {
            const int i = i0 + s;
            if (i >= nst) break;
            if (i + NS - 1 < nst) load(sl[(s + NS - 1) % NS], i + NS - 1);
            compute(sl[s], i);
        }
    }
    mvm_store<RT, KS, C2>(acc, part, sg, valid, o0, n, accumulate);
}

template <int KIND, int RT, int KS>
__device__ __forceinline__ void mvd_lowbit(MvSeg s0, MvSeg s1, MvSeg s2, MvSeg s3, const i8* __restrict__ q,
                                           const float* __restrict__ da, const int* __restrict__ sa, int n_in,
                                           int n, int accumulate, int pre) {
    const int ROWS = 16 * RT;
    const int G = MVM_WARPS / KS;
    __shared__ float part[KS > 1 ? MVM_WARPS * RT * 4 * 32 : 1];
    int gw = blockIdx.x * G + (threadIdx.x >> 5) / KS;
    bool valid = true;
    MvSeg sg = mvm_find_seg(s0, s1, s2, s3, ROWS, gw, valid);
    const int o0 = gw * ROWS;
    // register ring depth: the step being computed and the next one (3 spills at 128 registers)
    const int NS = 2;
    if (n > 1) {
        mvd_body<KIND, RT, KS, NS, true>(sg, valid, o0, q, da, sa, n_in, n, accumulate, pre, part);
    } else {
        mvd_body<KIND, RT, KS, NS, false>(sg, valid, o0, q, da, sa, n_in, n, accumulate, pre, part);
    }
}

// Parameters and grid exactly as MVM_ENTRY; no dynamic or ring shared memory.
#define MVD_ENTRY(NAME, KIND, RT, KS, MINB)            \
    MV_SEG_ENTRY(NAME, MVM_WARPS, MINB, const i8*, q, \
                 mvd_lowbit<KIND, RT, KS>(s0, s1, s2, s3, q, da, sa, n_in, n, accumulate, pre))
#define MVD_KIND_ENTRIES(K, KIND)                 \
    MVD_ENTRY(mvd_##K##_r1_k1, KIND, 1, 1, 4)     \
    MVD_ENTRY(mvd_##K##_r1_k2, KIND, 1, 2, 4)     \
    MVD_ENTRY(mvd_##K##_r1_k4, KIND, 1, 4, 4)     \
    MVD_ENTRY(mvd_##K##_r2_k1, KIND, 2, 1, 3)     \
    MVD_ENTRY(mvd_##K##_r2_k2, KIND, 2, 2, 3)     \
    MVD_ENTRY(mvd_##K##_r2_k4, KIND, 2, 4, 3)
MVD_KIND_ENTRIES(q1, 1)
MVD_KIND_ENTRIES(q2, 2)
MVD_KIND_ENTRIES(q2g64, 3)

// ---- dp4a decode launch in the tensor-core float order (`mvx_*`, n = 1) -----------------------
// The speculative verify (n = 2..8 rows) is cheapest on the tensor-core kernels above, but a
// verify row must equal the decode row bit for bit, and the tensor-core kernels are slower than
// dp4a at n = 1. This kernel computes one activation row with dp4a in exactly the float order of
// mvm_body / mvd_body, so decode (n = 1, here) and verify (n > 1, tensor cores) agree bit for bit:
//   p_b = xd(j0)·isum(j0), then fmaf(isum(j), xd(j), p_b) over the block's sub-blocks j in order
//   acc = fmaf(p_b, ws(b), acc) over the K part's blocks in the tensor-core kernels' order (chunks
//         of MVM_CB code bytes kp, kp + KS, ..; blocks inside a chunk in order)
//   y   = acc_0 + acc_1 + .. over the K parts (mvm_store)
// with isum the same exact integer (sub_dot of bonsai.cu; float(isum) is exact, as is the
// magic-number conversion of the tensor-core kernels).
// Work split: 4 lanes per weight row, 8 rows per warp (RL = 2: rows r and r + 8 per lane, sharing
// the activation loads). Lane s of a row computes p for blocks 4i + s of the K part (Q1: one
// 16-byte load per block, the 4 lanes of a row read 64 contiguous bytes), two blocks per round,
// the next round's weights loading meanwhile; the chain over the blocks then runs in every lane
// of the row, fed by shuffles (the same value in all 4 lanes).
template <int KIND>
__device__ __forceinline__ void mvx_ld_codes(const u8* row, int blk, bool live, uint2* c) {
    const int SPB = KIND == 3 ? 2 : 4;
#pragma unroll
    for (int u = 0; u < SPB; ++u) c[u].x = c[u].y = 0u;
    if (!live) return;
    if (KIND == 1) {
        uint4 v = __ldg((const uint4*)(row + 16 * blk));
        c[0].x = v.x;
        c[1].x = v.y;
        c[2].x = v.z;
        c[3].x = v.w;
    } else {
#pragma unroll
        for (int h = 0; h < SPB / 2; ++h) {
            uint4 v = __ldg((const uint4*)(row + 8 * SPB * blk) + h);
            c[2 * h].x = v.x;
            c[2 * h].y = v.y;
            c[2 * h + 1].x = v.z;
            c[2 * h + 1].y = v.w;
        }
    }
}

template <int KIND, int RL, int KS>
__device__ __forceinline__ void mvx_lowbit(MvSeg s0, MvSeg s1, MvSeg s2, MvSeg s3, const i8* __restrict__ q,
                                           const float* __restrict__ da, const int* __restrict__ sa, int n_in,
                                           int accumulate, int pre) {
    const int BE = KIND == 3 ? 64 : 128;
    const int SPB = BE / 32;
    const int SBB = KIND == 1 ? 4 : 8;
    const int SPC = MVM_CB / SBB;
    const int BPC = SPC / SPB;
    const int ROWS = 8 * RL;  // weight rows per warp
    const int BPL = 2;        // blocks per lane per round (a round covers 4·BPL blocks of the chain)
    const int G = MVM_WARPS / KS;
    __shared__ float part[KS > 1 ? MVM_WARPS * ROWS : 1];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, r = lane >> 2, s = lane & 3;
    const int kp = w % KS;
    int gw = blockIdx.x * G + w / KS;
    bool valid = true;
    MvSeg sg = mvm_find_seg(s0, s1, s2, s3, ROWS, gw, valid);
    const int o0 = gw * ROWS;
    const int nsb = n_in >> 5, nblk = n_in / BE;
    const int rowb = nsb * SBB;
    const int nch = (rowb + MVM_CB - 1) / MVM_CB;
    const int nmy = (valid && kp < nch) ? (nch - kp + KS - 1) / KS : 0;
    // blocks of the K part, in chain order: j -> block (kp + KS·(j / BPC))·BPC + j % BPC; only the
    // global last chunk can be partial, so the valid ones are a prefix of length m
    int m = 0;
    if (nmy > 0) {
        const int last = (kp + KS * (nmy - 1)) * BPC;  // first block of my last chunk
        m = (nmy - 1) * BPC + min(BPC, nblk - last);
    }
    auto blk_of = [&](int j) { return (kp + KS * (j / BPC)) * BPC + j % BPC; };
    const int n_out = valid ? sg.n_out : 1;
    const u8* crow[RL];
    const u16* srow[RL];
#pragma unroll
    for (int e = 0; e < RL; ++e) {
        const size_t o = (size_t)min(o0 + r + 8 * e, n_out - 1);
        crow[e] = (const u8*)sg.codes + o * (size_t)rowb;
        srow[e] = sg.scales + o * (size_t)nblk;
    }
    // round i: my blocks j = 4·(BPL·i + v) + s, v < BPL; codes and scales of the next round are
    // loaded while this one computes
    uint2 c[RL][BPL][SPB], cn[RL][BPL][SPB];
    u16 ws[RL][BPL], wsn[RL][BPL];
    auto load = [&](int i, uint2 (&cc)[RL][BPL][SPB], u16 (&ww)[RL][BPL]) {
#pragma unroll
        for (int v = 0; v < BPL; ++v) {
            const int j = 4 * (BPL * i + v) + s;
            const bool live = j < m;
            const int b = live ? blk_of(j) : 0;
#pragma unroll
            for (int e = 0; e < RL; ++e) {
                mvx_ld_codes<KIND>(crow[e], b, live, cc[e][v]);
                ww[e][v] = live ? __ldg(srow[e] + b) : (u16)0;
            }
        }
    };
    const int rounds = (m + 4 * BPL - 1) / (4 * BPL);
    if (!pre) PDL_ENTRY();
    if (rounds > 0) load(0, c, ws);
    if (pre) PDL_ENTRY();
    float acc[RL];
#pragma unroll
    for (int e = 0; e < RL; ++e) acc[e] = 0.f;
    const int base = lane & ~3;
    for (int i = 0; i < rounds; ++i) {
        if (i + 1 < rounds) load(i + 1, cn, wsn);
        float p[RL][BPL];
#pragma unroll
        for (int v = 0; v < BPL; ++v) {
#pragma unroll
            for (int e = 0; e < RL; ++e) p[e][v] = 0.f;
            const int j = 4 * (BPL * i + v) + s;
            if (j < m) {
                const int jb = blk_of(j) * SPB;
                float xd[SPB];
                int xs[SPB];
                if (SPB == 4) {
                    float4 d4 = __ldg((const float4*)(da + jb));
                    int4 s4 = __ldg((const int4*)(sa + jb));
                    xd[0] = d4.x, xd[1] = d4.y, xd[2] = d4.z, xd[3] = d4.w;
                    xs[0] = s4.x, xs[1] = s4.y, xs[2] = s4.z, xs[3] = s4.w;
                } else {
                    float2 d2 = __ldg((const float2*)(da + jb));
                    int2 s2 = __ldg((const int2*)(sa + jb));
                    xd[0] = d2.x, xd[1] = d2.y;
                    xs[0] = s2.x, xs[1] = s2.y;
                }
#pragma unroll
                for (int u = 0; u < SPB; ++u) {
                    const int4* qa4 = (const int4*)(q + (size_t)(jb + u) * 32);
                    int4 qa0 = __ldg(qa4), qa1 = __ldg(qa4 + 1);
                    int qa[8] = {qa0.x, qa0.y, qa0.z, qa0.w, qa1.x, qa1.y, qa1.z, qa1.w};
#pragma unroll
                    for (int e = 0; e < RL; ++e) {
                        const float f = (float)sub_dot<KIND>(c[e][v][u], qa, xs[u]);
                        p[e][v] = u == 0 ? __fmul_rn(f, xd[u]) : fmaf(f, xd[u], p[e][v]);
                    }
                }
            }
        }
        // the chain over this round's blocks, in order, in every lane of the row
#pragma unroll
        for (int e = 0; e < RL; ++e) {
#pragma unroll
            for (int v = 0; v < BPL; ++v) {
                const float wf = h2f(ws[e][v]);
#pragma unroll
                for (int ss = 0; ss < 4; ++ss) {
                    const float pv = __shfl_sync(0xffffffffu, p[e][v], base + ss);
                    const float wv = __shfl_sync(0xffffffffu, wf, base + ss);
                    if (4 * (BPL * i + v) + ss < m) acc[e] = fmaf(pv, wv, acc[e]);
                }
            }
        }
        if (i + 1 < rounds) {
#pragma unroll
            for (int e = 0; e < RL; ++e)
#pragma unroll
                for (int v = 0; v < BPL; ++v) {
                    ws[e][v] = wsn[e][v];
#pragma unroll
                    for (int u = 0; u < SPB; ++u) c[e][v][u] = cn[e][v][u];
                }
        }
    }
    // K parts in order (as mvm_store), then the store
    if (KS > 1) {
        if (s == 0) {
#pragma unroll
            for (int e = 0; e < RL; ++e) part[w * ROWS + r + 8 * e] = acc[e];
        }
        __syncthreads();
        if (!valid || kp != 0) return;
#pragma unroll
        for (int e = 0; e < RL; ++e) {
            float v = part[w * ROWS + r + 8 * e];
#pragma unroll
            for (int k2 = 1; k2 < KS; ++k2) v += part[(w + k2) * ROWS + r + 8 * e];
            acc[e] = v;
        }
    }
    if (!valid || s != 0) return;
#pragma unroll
    for (int e = 0; e < RL; ++e) {
        const int o = o0 + r + 8 * e;
        if (o < sg.n_out) {
            float* yp = sg.y + o;
            *yp = accumulate ? *yp + acc[e] : acc[e];
        }
    }
}

// Parameters as MV_ENTRY (n is ignored: one activation row). grid ceil(Σ ceil(n_out_i / 8·RL) /
// (MVM_WARPS / KS)), block MVM_WARPS·32.
#define MVX_ENTRY(NAME, KIND, RL, KS, MINB)            \
    MV_SEG_ENTRY(NAME, MVM_WARPS, MINB, const i8*, q, \
                 mvx_lowbit<KIND, RL, KS>(s0, s1, s2, s3, q, da, sa, n_in, accumulate, pre))
#define MVX_KIND_ENTRIES(K, KIND)                 \
    MVX_ENTRY(mvx_##K##_r1_k1, KIND, 1, 1, 6)     \
    MVX_ENTRY(mvx_##K##_r1_k2, KIND, 1, 2, 6)     \
    MVX_ENTRY(mvx_##K##_r1_k4, KIND, 1, 4, 6)     \
    MVX_ENTRY(mvx_##K##_r2_k1, KIND, 2, 1, 4)     \
    MVX_ENTRY(mvx_##K##_r2_k2, KIND, 2, 2, 4)     \
    MVX_ENTRY(mvx_##K##_r2_k4, KIND, 2, 4, 4)
MVX_KIND_ENTRIES(q1, 1)
MVX_KIND_ENTRIES(q2, 2)
MVX_KIND_ENTRIES(q2g64, 3)
