// ---- staged persistent decode mat-vec (`mvs_*`, n = 1, dp4a) ---------------------------------
// (smem_u32 of gemm.cu and the sub-block unpack / dot of bonsai.cu are in scope.)
//
// `mv_lowbit` keeps a warp's weights in registers: a warp loads a batch of code words, waits a
// whole DRAM round trip, computes, loads the next batch. On the H200 that leaves the decode
// mat-vec latency-bound (ncu: 0.53 issued instructions per scheduler cycle, 46 % of cycles with no
// eligible warp, DRAM 22 % busy) and 1.3 waves of blocks leave most of the second wave idle.
//
// Here the weights go through shared memory instead. A persistent block walks row tiles t = b,
// b + nb, ... (a tile = G·R consecutive rows of one matrix, every K) through an S-stage ring:
// thread 0 asks the bulk copy engine for a whole tile (codes and scales are each one contiguous
// range, `cp.async.bulk` completing on an mbarrier), S tiles ahead, so the block always has
// S tiles of weights in flight and its warps only ever wait on shared memory. The activations
// (q, d, s) are copied into shared memory once per launch. With `pre` the first S tiles are asked
// for before the PDL wait (weights are never written on the device).
//
// Float order: warp w of the block takes rows g·R .. g·R + R − 1 of the tile (g = w / KS) and K
// part kp = w % KS; lane l sums sub-blocks j = (kp + KS·m)·32 + l in increasing m with the same
// per-sub-block ops as mv_lowbit, then the same xor-tree, and the K parts are added in order
// kp = 0, 1, .. So a launch equals mv_lowbit<KIND, *, R, *, KS> bit for bit, and decode rows stay
// batch-invariant against the n ≤ 8 verify kernels (same KS from the shape).
//
// Shared memory (dynamic, the launcher sizes it): q [n_in] i8 (each sub-block's two 16-byte
// halves swapped when bit 2 of its index is set, so that the 16-byte loads of 8 consecutive lanes
// hit distinct banks), d [nsb] f32, s [nsb] i32, then S stages of codes [G·R, nsb·CB] and scales
// [G·R, nblk] f16. The launcher only takes this path when every copy is a multiple of 16 bytes.

#define MVS_MAX_STAGES 8

__device__ __forceinline__ void mbar_init(u64* bar, u32 count) {
#if BONSAI_SM90
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
#else
    __trap();
#endif
}
// The calling thread's arrival, announcing `bytes` of bulk-copy traffic for the current phase.
__device__ __forceinline__ void mbar_arrive_tx(u64* bar, u32 bytes) {
#if !BONSAI_SM90
    __trap();
#else
    asm volatile("{\n\t.reg .b64 st;\n\tmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n\t}" ::"r"(
                     smem_u32(bar)),
                 "r"(bytes)
                 : "memory");
#endif
}
// Spin until the phase with parity `parity` of `bar` has completed.
__device__ __forceinline__ void mbar_wait(u64* bar, u32 parity) {
#if !BONSAI_SM90
    __trap();
#else
    u32 done = 0;
    while (!done) {
        asm volatile(
            "{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\tselp.u32 %0, 1, 0, "
            "p;\n\t}"
            : "=r"(done)
            : "r"(smem_u32(bar)), "r"(parity)
            : "memory");
    }
#endif
}
// Bulk copy global → shared (16-byte aligned, a multiple of 16 bytes), completing on `bar`.
__device__ __forceinline__ void bulk_g2s(void* dst, const void* src, u32 bytes, u64* bar) {
#if !BONSAI_SM90
    __trap();
#else
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     smem_u32(dst)),
                 "l"(src), "r"(bytes), "r"(smem_u32(bar))
                 : "memory");
#endif
}

// Bytes of one stage: codes then scales of G·R rows, each part rounded up to 16 bytes. The
// launcher uses the same formula (`mvs_layout` in lib.rs).
__device__ __forceinline__ u32 mvs_code_bytes(int kind, int rows, int n_in) {
    return (u32)rows * (u32)(kind == 1 ? n_in / 8 : n_in / 4);
}
__device__ __forceinline__ u32 mvs_scale_bytes(int kind, int rows, int n_in) {
    return ((u32)rows * (u32)(n_in / (kind == 3 ? 64 : 128)) * 2u + 15u) & ~15u;
}

// Where the SwiGLU mode (MVS_SWI) of mv_staged writes SiLU(gate) ⊙ up.
#define MVS_PLAIN 0
#define MVS_SWI 1

// MVS_SWI (K split 1): s0 is the gate and s1 the up matrix (n_out rows each, n_out % 32 == 0). A
// tile is TO = MV_WARPS·R/2 consecutive outputs: the stage holds their TO gate rows, then the same
// TO up rows (codes, then scales, 4 bulk copies), and warp w takes outputs w·R/2 .. w·R/2 + R/2 − 1,
// gate rows as its rows 0 .. R/2 − 1 and up rows as the rest. Every row is summed as in
// MVS_PLAIN (so as mv_lowbit's K split 1). Blocks take whole quant groups of 32 outputs
// (32 / TO consecutive tiles): lane 0 of each warp writes SiLU(g) ⊙ u of its outputs to shared
// memory, and after the group's last tile one warp quantizes the 32 values with quant32, as
// swiglu_quant does (hf unless null, q, d, s).
template <int KIND, int R, int KS, int MODE = MVS_PLAIN>
__device__ __forceinline__ void mv_staged(MvSeg s0, MvSeg s1, MvSeg s2, MvSeg s3, const i8* __restrict__ q,
                                          const float* __restrict__ da, const int* __restrict__ sa, int n_in,
                                          int accumulate, int pre, SwiOut so = {}) {
    static_assert(MODE == MVS_PLAIN || (KS == 1 && R % 2 == 0), "MVS_SWI: K split 1, gate / up row pairs");
    const int BE = KIND == 3 ? 64 : 128;  // elements per scale block
    const int SPB = BE / 32;              // sub-blocks per scale block
    const int G = MV_WARPS / KS;          // row groups per block
    const int TR = G * R;                 // rows per tile
    const int RO = MODE ? R / 2 : R;      // outputs per warp (MVS_SWI: gate and up row pairs)
    const int TO = G * RO;                // outputs per tile
    const int TPG = MODE ? 32 / TO : 1;   // tiles per quant group (MVS_SWI)
    extern __shared__ __align__(128) unsigned char mvs_smem[];
    __shared__ u64 full[MVS_MAX_STAGES];
    __shared__ float part[KS > 1 ? MV_WARPS : 1][R];
    __shared__ float hbuf[MODE ? 2 : 1][MODE ? 32 : 1];  // SiLU(g) ⊙ u of a quant group, double-buffered
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    int kp = w % KS, g = w / KS;
    int nsb = n_in >> 5, nblk = n_in / BE;
    u32 act_bytes = (u32)n_in + 8u * (u32)nsb;  // q, d, s (n_in is a multiple of 128)
    u32 cbytes = mvs_code_bytes(KIND, TR, n_in), sbytes = mvs_scale_bytes(KIND, TR, n_in);
    u32 stage_bytes = cbytes + sbytes;
    u32 dyn;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
    int S = min((int)((dyn - act_bytes) / stage_bytes), MVS_MAX_STAGES);
    if (S < 1) __trap();  // the launcher always gives at least one stage
    i8* q_s = (i8*)mvs_smem;
    float* d_s = (float*)(mvs_smem + n_in);
    int* s_s = (int*)(mvs_smem + n_in + 4 * nsb);
    unsigned char* stages = mvs_smem + act_bytes;

    // tiles: per segment ceil(n_out / TR), in segment order (MVS_SWI: n_out / TO pairs)
    int t0 = (s0.n_out + TR - 1) / TR, t1 = (s1.n_out + TR - 1) / TR, t2 = (s2.n_out + TR - 1) / TR,
        t3 = (s3.n_out + TR - 1) / TR;
    int ntiles = t0 + t1 + t2 + t3;
    if (MODE) t0 = ntiles = s0.n_out / TO;
    auto tile_of = [&](int t, MvSeg& sg, int& o0) {
        if (MODE) {
            sg = s0;
            o0 = t * TO;
            return;
        }
        if (t < t0) {
            sg = s0;
        } else if ((t -= t0) < t1) {
            sg = s1;
        } else if ((t -= t1) < t2) {
            sg = s2;
        } else {
            t -= t2;
            sg = s3;
        }
        o0 = t * TR;
    };
    // thread 0: ask for tile t into stage st (rows past n_out are not copied)
    auto issue = [&](int t, int st) {
        MvSeg sg = s0;
        int o0 = 0;
        tile_of(t, sg, o0);
        int rows = MODE ? TO : min(TR, sg.n_out - o0);
        u32 cb = mvs_code_bytes(KIND, rows, n_in);
        u32 sb = (u32)rows * (u32)nblk * 2u;  // a multiple of 16 (the launcher checks n_in)
        unsigned char* dst = stages + (size_t)st * stage_bytes;
        size_t co = (size_t)o0 * mvs_code_bytes(KIND, 1, n_in), so = (size_t)o0 * nblk * 2;
        if (MODE) {
            // TO gate rows, then the same TO up rows (rows = TO: n_out % 32 == 0)
            mbar_arrive_tx(&full[st], 2 * (cb + sb));
            bulk_g2s(dst, (const unsigned char*)s0.codes + co, cb, &full[st]);
            bulk_g2s(dst + cb, (const unsigned char*)s1.codes + co, cb, &full[st]);
            bulk_g2s(dst + cbytes, (const unsigned char*)s0.scales + so, sb, &full[st]);
            bulk_g2s(dst + cbytes + sb, (const unsigned char*)s1.scales + so, sb, &full[st]);
            return;
        }
        mbar_arrive_tx(&full[st], cb + sb);
        bulk_g2s(dst, (const unsigned char*)sg.codes + co, cb, &full[st]);
        bulk_g2s(dst + cbytes, (const unsigned char*)sg.scales + so, sb, &full[st]);
    };
    // a block's i-th tile: tiles b, b + nb, ..; MVS_SWI: quant groups b, b + nb, .. of TPG
    // consecutive tiles each
    int first = blockIdx.x, step = gridDim.x;
    int nunits = ntiles / TPG;
    int mine = first < nunits ? ((nunits - 1 - first) / step + 1) * TPG : 0;  // tiles of this block
    auto tile_at = [&](int i) { return (first + (i / TPG) * step) * TPG + i % TPG; };
    if (threadIdx.x == 0) {
        for (int i = 0; i < S; ++i) mbar_init(&full[i], 1);
#if BONSAI_SM90
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
    }
    __syncthreads();
    if (pre && threadIdx.x == 0)
        for (int i = 0; i < min(S, mine); ++i) issue(tile_at(i), i);
    PDL_ENTRY();
    if (!pre && threadIdx.x == 0)
        for (int i = 0; i < min(S, mine); ++i) issue(tile_at(i), i);
    // activations into shared memory (16 bytes at a time; q with the half swap)
    for (int i = threadIdx.x; i < n_in / 16; i += blockDim.x) {
        int j = i >> 1, h = i & 1;
        int4 v = __ldg((const int4*)q + i);
        *(int4*)(q_s + j * 32 + ((h ^ ((j >> 2) & 1)) << 4)) = v;
    }
    for (int i = threadIdx.x; i < nsb / 4; i += blockDim.x) {
        ((int4*)d_s)[i] = __ldg((const int4*)da + i);
        ((int4*)s_s)[i] = __ldg((const int4*)sa + i);
    }
    __syncthreads();

    for (int i = 0; i < mine; ++i) {
        int st = i % S;
        int t = tile_at(i);
        MvSeg sg = s0;
        int o0 = 0;
        tile_of(t, sg, o0);
        int rows = min(TR, sg.n_out - o0);
        mbar_wait(&full[st], (u32)(i / S) & 1u);
        const unsigned char* cs = stages + (size_t)st * stage_bytes;
        const u16* ss = (const u16*)(cs + cbytes);
        // this warp's rows in the stage (clamped to the copied ones: same values, never stored)
        const u32* c1[R];
        const uint2* c2[R];
        const u16* sp[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            // MVS_SWI: gate rows g·RO + r, up rows TO + g·RO + r − RO of the stage
            int rr = MODE ? (r < RO ? g * RO + r : TO + g * RO + r - RO) : min(g * R + r, rows - 1);
            c1[r] = (const u32*)cs + rr * nsb;
            c2[r] = (const uint2*)cs + rr * nsb;
            sp[r] = ss + rr * nblk;
        }
        float acc[R];
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r] = 0.f;
#pragma unroll 2
        for (int j = kp * 32 + lane; j < nsb; j += 32 * KS) {
            const int4* qa4 = (const int4*)(q_s + j * 32);
            int sw = (j >> 2) & 1;
            int4 qa0 = qa4[sw], qa1 = qa4[sw ^ 1];
            int qa[8] = {qa0.x, qa0.y, qa0.z, qa0.w, qa1.x, qa1.y, qa1.z, qa1.w};
            float dt = d_s[j];
            int stv = s_s[j];
#pragma unroll
            for (int r = 0; r < R; ++r) {
                uint2 c;
                if (KIND == 1) {
                    c.x = c1[r][j];
                    c.y = 0u;
                } else {
                    c = c2[r][j];
                }
                float dw = h2f(sp[r][j / SPB]);
                int isum = sub_dot_ops<KIND>(sub_unpack<KIND>(c), qa, stv);
                acc[r] = fmaf(dw * dt, (float)isum, acc[r]);
            }
        }
        // lane sums → warp (fixed xor-tree) → K parts in order kp = 0, 1, .. (fixed)
        if (MODE) {
            float v[R];
#pragma unroll
            for (int r = 0; r < R; ++r) v[r] = warp_sum(acc[r]);
            if (lane == 0)
#pragma unroll
                for (int r = 0; r < RO; ++r) hbuf[(i / TPG) & 1][(i % TPG) * TO + g * RO + r] = siluf_(v[r]) * v[RO + r];
        }
#pragma unroll
        for (int r = 0; r < R && !MODE; ++r) {
            float v = warp_sum(acc[r]);
            if (KS == 1) {
                if (lane == r && g * R + r < rows) {
                    float* yp = sg.y + o0 + g * R + r;
                    *yp = accumulate ? *yp + v : v;
                }
            } else if (lane == 0) {
                part[w][r] = v;
            }
        }
        if (KS > 1) {
            __syncthreads();
            if (kp == 0 && lane < R && g * R + lane < rows) {
                float v = part[w][lane];
#pragma unroll
                for (int k2 = 1; k2 < KS; ++k2) v += part[w + k2][lane];
                float* yp = sg.y + o0 + g * R + lane;
                *yp = accumulate ? *yp + v : v;
            }
        }
        // every warp is done with stage st (and with part): refill it S tiles ahead
        __syncthreads();
        if (threadIdx.x == 0 && i + S < mine) {
#if BONSAI_SM90
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
            issue(tile_at(i + S), st);
        }
        // MVS_SWI: the group's 32 values are in hbuf (the barrier above); one warp, a
        // different one per group, quantizes them while the others go on (they write the other
        // half of hbuf until the next group's last barrier, which this warp reaches only after)
        if (MODE && i % TPG == TPG - 1) {
            int grp = first + (i / TPG) * step;
            if (w == grp % MV_WARPS) {
                float h = hbuf[(i / TPG) & 1][lane];
                int o = grp * 32 + lane;
                if (so.hf) so.hf[o] = h;
                quant32(h, so.q + (size_t)grp * 32, so.d + grp, so.s + grp);
            }
        }
    }
}

// Variants: R = 1, 2 or 4 rows per warp, K split KS (the mv_lowbit KS whose float order this is).
// `n` must be 1; the launcher sizes the grid and the shared memory.
#define MVS_ENTRY(NAME, KIND, R, KS)                 \
    MV_SEG_ENTRY(NAME, MV_WARPS, 4, const i8*, q, \
                 mv_staged<KIND, R, KS>(s0, s1, s2, s3, q, da, sa, n_in, accumulate, pre))
#define MVS_KIND_ENTRIES(K, KIND)       \
    MVS_ENTRY(mvs_##K##_r1_k1, KIND, 1, 1) \
    MVS_ENTRY(mvs_##K##_r1_k2, KIND, 1, 2) \
    MVS_ENTRY(mvs_##K##_r1_k4, KIND, 1, 4) \
    MVS_ENTRY(mvs_##K##_r2_k1, KIND, 2, 1) \
    MVS_ENTRY(mvs_##K##_r2_k2, KIND, 2, 2) \
    MVS_ENTRY(mvs_##K##_r2_k4, KIND, 2, 4) \
    MVS_ENTRY(mvs_##K##_r4_k1, KIND, 4, 1) \
    MVS_ENTRY(mvs_##K##_r4_k2, KIND, 4, 2) \
    MVS_ENTRY(mvs_##K##_r4_k4, KIND, 4, 4)
MVS_KIND_ENTRIES(q1, 1)
MVS_KIND_ENTRIES(q2, 2)
MVS_KIND_ENTRIES(q2g64, 3)

// Decode gate‖up with the SwiGLU fused in (`_swi`), staged: R/2 outputs per warp (`_o1`: R = 2,
// `_o2`: R = 4), K split 1. Gate and up are n_out rows each (n_out % 32 == 0). Writes SiLU(gate) ⊙
// up as swiglu_quant would (hf unless null, hq, hd, hs). The launcher sizes the grid (at most
// n_out / 32 blocks) and the shared memory.
#define MVS_SWI_ENTRY(NAME, KIND, R)                                                                   \
    extern "C" __global__ void __launch_bounds__(MV_WARPS * 32, 4) NAME(                             \
        const void* c0, const u16* sc0, const void* c1, const u16* sc1, int n_out, const i8* q,       \
        const float* da, const int* sa, int n_in, int pre, float* hf, i8* hq, float* hd, int* hs) {   \
        MvSeg s0 = {c0, sc0, nullptr, n_out}, s1 = {c1, sc1, nullptr, n_out},                         \
              none = {nullptr, nullptr, nullptr, 0};                                                   \
        mv_staged<KIND, R, 1, MVS_SWI>(s0, s1, none, none, q, da, sa, n_in, 0, pre,                   \
                                       SwiOut{hf, hq, hd, hs, {}});                                       \
    }
#define MVS_SWI_KIND_ENTRIES(K, KIND)        \
    MVS_SWI_ENTRY(mvs_##K##_o1_swi, KIND, 2) \
    MVS_SWI_ENTRY(mvs_##K##_o2_swi, KIND, 4)
MVS_SWI_KIND_ENTRIES(q1, 1)
MVS_SWI_KIND_ENTRIES(q2, 2)
MVS_SWI_KIND_ENTRIES(q2g64, 3)
