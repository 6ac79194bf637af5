// Feasibility prototype (not engine code): a Q1_0 mat-vec on the binary tensor cores with the
// activations as bit planes of int codes per 128-element block.
//
// Why: the dp4a decode kernels spend ~27 lane-instructions per weight row and 32-element
// sub-block (~38 weights per warp-instruction); at the H200's bandwidth a 1-bit mat-vec needs
// ~122 weights per clock per SM, so dp4a would need ~80 % of the issue rate. Here the raw code
// words are the A fragments of `mma.m16n8k128.b1.and.popc` and the activation bit planes of one
// 128-element block are the B columns (NP = 8 planes: int8 codes; NP = 16: int16 codes, two n8
// tiles). For weight row r and activation row t in block b:
//   Σ_k (2c_k − 1)·a_k = 2·Σ_p w_p·popc(W_rb AND P_tbp) − Σ_k a_k,
// w_p = 2^p except the sign plane (−2^(NP−1)). The MMA gives popc for 16 rows × 8 planes; lane
// (g, tg) holds planes 2tg, 2tg + 1 (and 8 + 2tg, 9 + 2tg) of rows g and g + 8 and folds them with
// per-lane multipliers (lane tg = 0 also subtracts Σa), so each lane keeps a float partial
// acc += (dw·u)·S per row; the 4 lanes of a row and then the K-split warps are added in a fixed
// order at the end. Every activation row has its own MMAs and the same float operations, so an
// n-row launch equals n one-row launches bit for bit (checked by b1plane.py).
//
// Layouts (host-built by b1plane.py):
//   wa [tile][pair][lane] uint4 = {a0(b), a1(b), a0(b + 1), a1(b + 1)}, b = 2·pair:
//      a0 = code word tg of row 16·tile + g in block b, a1 = the same for row + 8.
//   wd [tile][blk][g] u32 = f16 scale of row g (low half) and row g + 8 (high half).
//   xp NP = 16: [t][pair][lane] uint4 = {plane g word tg (b), plane 8 + g word tg (b), (b + 1) ...}
//      NP = 8:  [t][pair][lane] uint2 = {plane g word tg (b), (b + 1)}
//   xu [t][blk] f32 block scale, xs [t][blk][4] i32 = {Σa, 0, 0, 0}, y [t][n_out] f32.
typedef unsigned int u32;
typedef unsigned short u16;

__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ void mma_k128(int* d, u32 a0, u32 a1, u32 b) {
    asm volatile(
        "mma.sync.aligned.m16n8k128.row.col.s32.b1.b1.s32.and.popc {%0,%1,%2,%3}, {%4,%5}, {%6}, "
        "{%7,%7,%7,%7};\n"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a0), "r"(a1), "r"(b), "r"(0));
}

// One block of one tile and one activation row: the folded integer sums of rows g and g + 8.
template <int NP>
__device__ __forceinline__ void fold(u32 a0, u32 a1, u32 blo, u32 bhi, int sa, const int* m, int& sg, int& sg8) {
    int c[4];
    mma_k128(c, a0, a1, blo);
    sg = c[0] * m[0] + c[1] * m[1] - sa;
    sg8 = c[2] * m[0] + c[3] * m[1] - sa;
    if constexpr (NP == 16) {
        int e[4];
        mma_k128(e, a0, a1, bhi);
        sg += e[0] * m[2] + e[1] * m[3];
        sg8 += e[2] * m[2] + e[3] * m[3];
    }
}

// Block: RGW row groups × KS K parts (warp w: part w % KS, group w / KS); a group is RT tiles of
// 16 rows. A warp walks its contiguous range of block pairs UNR pairs at a time; everything the
// next UNR pairs need (weight words and scales, activation planes, block scales and sums) is
// loaded before the current pairs are used.
template <int NP, int KS, int RGW, int RT, int NT, int UNR>
__device__ __forceinline__ void bp_body(const uint4* __restrict__ wa, const u32* __restrict__ wd,
                                        const void* __restrict__ xpv, const float* __restrict__ xu,
                                        const int* __restrict__ xs, float* __restrict__ y, int n_out, int nblk) {
    __shared__ float red[KS][RGW][RT * 16][NT];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, tg = lane & 3;
    const int kp = w % KS, rg = w / KS;
    const int tile0 = (blockIdx.x * RGW + rg) * RT;
    const int ntiles = n_out >> 4;
    const int npair = nblk >> 1;
    const int p0 = kp * npair / KS, p1 = (kp + 1) * npair / KS;
    int m[4];
    if constexpr (NP == 16) {
        m[0] = 1 << (2 * tg + 1), m[1] = 1 << (2 * tg + 2), m[2] = 1 << (2 * tg + 9);
        m[3] = tg == 3 ? -(1 << 16) : (1 << (2 * tg + 10));
    } else {
        m[0] = 1 << (2 * tg + 1), m[1] = tg == 3 ? -256 : (1 << (2 * tg + 2));
        m[2] = m[3] = 0;
    }
    float acc[RT][2][NT];
#pragma unroll
    for (int r = 0; r < RT; ++r)
#pragma unroll
        for (int t = 0; t < NT; ++t) acc[r][0][t] = acc[r][1][t] = 0.f;
    const bool live = tile0 < ntiles;
    // stage registers: [pair of the step][tile] weights, [pair][token] activations
    uint4 na[UNR][RT], nb[UNR][NT];
    u32 nd[UNR][RT][2];
    float2 nu[UNR][NT];
    int ns[UNR][NT][2];
    auto load = [&](int p) {
#pragma unroll
        for (int u = 0; u < UNR; ++u) {
            const int pp = min(p + u, p1 - 1);
#pragma unroll
            for (int r = 0; r < RT; ++r) {
                const int tl = min(tile0 + r, ntiles - 1);
                na[u][r] = __ldg(wa + ((size_t)tl * npair + pp) * 32 + lane);
                nd[u][r][0] = __ldg(wd + ((size_t)tl * nblk + 2 * pp) * 8 + g);
                nd[u][r][1] = __ldg(wd + ((size_t)tl * nblk + 2 * pp + 1) * 8 + g);
            }
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                if constexpr (NP == 16) {
                    nb[u][t] = __ldg((const uint4*)xpv + ((size_t)t * npair + pp) * 32 + lane);
                } else {
                    const uint2 x = __ldg((const uint2*)xpv + ((size_t)t * npair + pp) * 32 + lane);
                    nb[u][t] = make_uint4(x.x, 0u, x.y, 0u);
                }
                nu[u][t] = __ldg((const float2*)(xu + (size_t)t * nblk) + pp);
                ns[u][t][0] = __ldg(xs + ((size_t)t * nblk + 2 * pp) * 4 + tg);
                ns[u][t][1] = __ldg(xs + ((size_t)t * nblk + 2 * pp + 1) * 4 + tg);
            }
        }
    };
    if (live && p0 < p1) load(p0);
    for (int p = p0; live && p < p1; p += UNR) {
        uint4 ca[UNR][RT], cb[UNR][NT];
        u32 cd[UNR][RT][2];
        float2 cu[UNR][NT];
        int cs[UNR][NT][2];
#pragma unroll
        for (int u = 0; u < UNR; ++u) {
#pragma unroll
            for (int r = 0; r < RT; ++r) ca[u][r] = na[u][r], cd[u][r][0] = nd[u][r][0], cd[u][r][1] = nd[u][r][1];
#pragma unroll
            for (int t = 0; t < NT; ++t) cb[u][t] = nb[u][t], cu[u][t] = nu[u][t], cs[u][t][0] = ns[u][t][0], cs[u][t][1] = ns[u][t][1];
        }
        if (p + UNR < p1) load(p + UNR);
#pragma unroll
        for (int u = 0; u < UNR; ++u) {
            if (p + u >= p1) break;
            float dw[RT][2][2];  // [tile][block of pair][row g / g + 8]
#pragma unroll
            for (int r = 0; r < RT; ++r)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    dw[r][h][0] = h2f((u16)(cd[u][r][h] & 0xffffu));
                    dw[r][h][1] = h2f((u16)(cd[u][r][h] >> 16));
                }
#pragma unroll
            for (int t = 0; t < NT; ++t) {
#pragma unroll
                for (int r = 0; r < RT; ++r) {
                    int s0, s08, s1, s18;
                    fold<NP>(ca[u][r].x, ca[u][r].y, cb[u][t].x, cb[u][t].y, cs[u][t][0], m, s0, s08);
                    fold<NP>(ca[u][r].z, ca[u][r].w, cb[u][t].z, cb[u][t].w, cs[u][t][1], m, s1, s18);
                    acc[r][0][t] = fmaf(dw[r][0][0] * cu[u][t].x, (float)s0, acc[r][0][t]);
                    acc[r][1][t] = fmaf(dw[r][0][1] * cu[u][t].x, (float)s08, acc[r][1][t]);
                    acc[r][0][t] = fmaf(dw[r][1][0] * cu[u][t].y, (float)s1, acc[r][0][t]);
                    acc[r][1][t] = fmaf(dw[r][1][1] * cu[u][t].y, (float)s18, acc[r][1][t]);
                }
            }
        }
    }
    // the 4 lanes of a row: (tg0 + tg1) + (tg2 + tg3)
#pragma unroll
    for (int r = 0; r < RT; ++r)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                float v = acc[r][h][t];
                v += __shfl_xor_sync(0xffffffffu, v, 1);
                v += __shfl_xor_sync(0xffffffffu, v, 2);
                if (tg == 0) red[kp][rg][r * 16 + h * 8 + g][t] = v;
            }
    __syncthreads();
    // K parts in order
    for (int i = threadIdx.x; i < RGW * RT * 16 * NT; i += blockDim.x) {
        const int t = i % NT, row = (i / NT) % (RT * 16), grp = i / (NT * RT * 16);
        const int orow = ((blockIdx.x * RGW + grp) * RT) * 16 + row;
        if (orow >= n_out) continue;
        float v = red[0][grp][row][t];
#pragma unroll
        for (int k = 1; k < KS; ++k) v += red[k][grp][row][t];
        y[(size_t)t * n_out + orow] = v;
    }
}

#define BP(NP, KS, RGW, RT, NT, UNR)                                                                        \
    extern "C" __global__ void __launch_bounds__(32 * KS * RGW)                                            \
        bp_##NP##_k##KS##_g##RGW##_r##RT##_n##NT##_u##UNR(const uint4* wa, const u32* wd, const void* xp,  \
                                                          const float* xu, const int* xs, float* y,        \
                                                          int n_out, int nblk) {                           \
        bp_body<NP, KS, RGW, RT, NT, UNR>(wa, wd, xp, xu, xs, y, n_out, nblk);                              \
    }

// decode (n = 1)
BP(16, 1, 4, 1, 1, 1)
BP(16, 1, 4, 1, 1, 2)
BP(16, 2, 4, 1, 1, 1)
BP(16, 2, 4, 1, 1, 2)
BP(16, 4, 2, 1, 1, 1)
BP(16, 4, 2, 1, 1, 2)
BP(16, 8, 1, 1, 1, 1)
BP(16, 8, 1, 1, 1, 2)
BP(16, 16, 1, 1, 1, 1)
BP(16, 2, 2, 2, 1, 1)
BP(16, 4, 1, 2, 1, 1)
BP(8, 1, 4, 1, 1, 2)
BP(8, 4, 2, 1, 1, 2)
BP(8, 8, 1, 1, 1, 2)
BP(8, 16, 1, 1, 1, 1)
// verify (n = 5)
BP(16, 2, 4, 1, 5, 1)
BP(16, 4, 2, 1, 5, 1)
BP(16, 8, 1, 1, 5, 1)
BP(16, 16, 1, 1, 5, 1)
BP(16, 2, 2, 2, 5, 1)
BP(16, 4, 1, 2, 5, 1)
BP(8, 2, 4, 1, 5, 1)
BP(8, 4, 2, 1, 5, 1)
BP(8, 8, 1, 1, 5, 1)

// Streaming-read floor: every thread sums uint4s over `words` (grid-stride), one write per block.
extern "C" __global__ void stream_read(const uint4* p, size_t words, u32* out) {
    u32 s = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < words; i += (size_t)gridDim.x * blockDim.x) {
        const uint4 v = __ldg(p + i);
        s ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (s == 0x9e3779b9u) out[blockIdx.x] = s;
}

// Keeps the GPU busy for `ns` so that the timed launches queued behind it start back to back
// (the host submits them faster than the spin ends; no host gap is timed).
extern "C" __global__ void spin_ns(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < ns);
}
