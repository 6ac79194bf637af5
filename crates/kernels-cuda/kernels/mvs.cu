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

template <int KIND, int R, int KS>
__device__ __forceinline__ void mv_staged(MvSeg s0, MvSeg s1, MvSeg s2, MvSeg s3, const i8* __restrict__ q,
                                          const float* __restrict__ da, const int* __restrict__ sa, int n_in,
                                          int accumulate, int pre) {
    const int BE = KIND == 3 ? 64 : 128;  // elements per scale block
    const int SPB = BE / 32;              // sub-blocks per scale block
    const int G = MV_WARPS / KS;          // row groups per block
    const int TR = G * R;                 // rows per tile
    extern __shared__ __align__(128) unsigned char mvs_smem[];
    __shared__ u64 full[MVS_MAX_STAGES];
    __shared__ float part[KS > 1 ? MV_WARPS : 1][R];
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

    // tiles: per segment ceil(n_out / TR), in segment order
    int t0 = (s0.n_out + TR - 1) / TR, t1 = (s1.n_out + TR - 1) / TR, t2 = (s2.n_out + TR - 1) / TR,
        t3 = (s3.n_out + TR - 1) / TR;
    int ntiles = t0 + t1 + t2 + t3;
    auto tile_of = [&](int t, MvSeg& sg, int& o0) {
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
        int rows = min(TR, sg.n_out - o0);
        u32 cb = mvs_code_bytes(KIND, rows, n_in);
        u32 sb = (u32)rows * (u32)nblk * 2u;  // a multiple of 16 (the launcher checks n_in)
        unsigned char* dst = stages + (size_t)st * stage_bytes;
        mbar_arrive_tx(&full[st], cb + sb);
        bulk_g2s(dst, (const unsigned char*)sg.codes + (size_t)o0 * mvs_code_bytes(KIND, 1, n_in), cb, &full[st]);
        bulk_g2s(dst + cbytes, (const unsigned char*)sg.scales + (size_t)o0 * nblk * 2, sb, &full[st]);
    };
    int first = blockIdx.x, step = gridDim.x;
    int mine = first < ntiles ? (ntiles - 1 - first) / step + 1 : 0;  // tiles of this block
    if (threadIdx.x == 0) {
        for (int i = 0; i < S; ++i) mbar_init(&full[i], 1);
#if BONSAI_SM90
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
    }
    __syncthreads();
    if (pre && threadIdx.x == 0)
        for (int i = 0; i < min(S, mine); ++i) issue(first + i * step, i);
    PDL_ENTRY();
    if (!pre && threadIdx.x == 0)
        for (int i = 0; i < min(S, mine); ++i) issue(first + i * step, i);
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
        int t = first + i * step;
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
            int rr = min(g * R + r, rows - 1);
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
#pragma unroll
        for (int r = 0; r < R; ++r) {
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
            issue(first + (i + S) * step, st);
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
