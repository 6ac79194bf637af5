// DSpark round: GDN verify records and replay rollback, drafter ops. Appended to bonsai.cu and
// gemm.cu by lib.rs (same translation unit: their typedefs and helpers are in scope).

// ---- GDN verify record and replay rollback (MODEL.md §4.9 option C) ------------------------------
//
// A verify record row of one GDN layer is `W = conv_dim + hk·dk + hv·dv + 2·hv` f32:
//   [0, conv_dim)                  mixed: the pre-conv projection row (conv input)
//   [conv_dim, +hk·dk)             k: post-conv, SiLU'd, L2-normed per k-head (what gdn_step reads)
//   [.., +hv·dv)                   v: post-conv, SiLU'd
//   [.., +hv)                      g: the log-decay ssm_a·softplus(a + dt_bias) (≤ 0; exp'd in the step)
//   [.., +hv)                      β: σ(b)
// the layout of `gdn_rec_width` in the engine and of the CPU backend's record.

// rec[t] = mixed[t] ‖ k[t] ‖ v[t] ‖ g[t] ‖ beta[t] (plain copies, bit for bit).
// grid (ceil(W / 256), n), block 256: thread c of row t writes element c of the record row.
//   mixed [n, conv_dim]; k [n, qk]; v [n, vd]; g/beta [n, hv]; rec [n, W].
extern "C" __global__ void gdn_rec_write(const float* mixed, const float* k, const float* v, const float* g,
                                         const float* beta, int conv_dim, int qk, int vd, int hv, float* rec) {
    PDL_ENTRY();  // launched with programmatic stream serialization: wait first
    int t = blockIdx.y;
    int c0 = blockIdx.x * blockDim.x + threadIdx.x;
    int W = conv_dim + qk + vd + 2 * hv;
    if (c0 >= W) return;
    int c = c0;
    float x;
    if (c < conv_dim) {
        x = mixed[(size_t)t * conv_dim + c];
    } else if ((c -= conv_dim) < qk) {
        x = k[(size_t)t * qk + c];
    } else if ((c -= qk) < vd) {
        x = v[(size_t)t * vd + c];
    } else if ((c -= vd) < hv) {
        x = g[(size_t)t * hv + c];
    } else {
        x = beta[(size_t)t * hv + (c - hv)];
    }
    rec[(size_t)t * W + c0] = x;
}

// Replay the first n rows of a verify record into the GDN state, with no outputs.
// grid (hv + ceil(conv_dim / REPLAY_THREADS), dv / 32), block REPLAY_THREADS (4 warps).
//   S [hv, dk, dv]; conv_state [kconv-1, conv_dim] oldest first; rec [>= n, rec_w] as above.
// Blocks x < hv: the delta rule of v-head x for value columns [32·y, 32·y + 32), written as a copy of
// gdn_step's recurrence: the same loads, the same float operations in the same order (a column's dk
// key rows in 8 chunks of R = dk/8 rows, each chunk's sum a fmaf chain over its rows, the 8 chunk
// sums added to 0 in chunk order), so the state equals what gdn_step leaves bit for bit. The threads
// are laid out as in bonsai.cu's gdn_conv_step_body: thread (w, lane) holds column 8w + (lane & 7)
// and chunks 2cp, 2cp + 1 (cp = lane >> 3), and a column's chunk sums meet by shuffles; one block
// barrier a row (k in shared memory, double-buffered by row parity). Only the output o is not
// computed (it never feeds back into S). KEEP IN SYNC with gdn_step in bonsai.cu: any change to its
// arithmetic must be mirrored here (the GPU tests compare the two bit for bit).
// Blocks x >= hv (row y == 0 only): the conv window, one channel per thread: for each row drop the
// oldest window row and append the row's pre-conv input, exactly as gdn_conv updates it.
// S_src / conv_src: where the state and window are read (the round's snapshot, so the rollback
// needs no restore copy first; equal to S / conv_state for an in-place replay).
#define REPLAY_THREADS 128
__device__ __forceinline__ void gdn_replay_body(float* S, float* conv_state, const float* S_src,
                                                const float* conv_src, const float* rec, int rec_w, int hk,
                                                int hv, int dk, int dv, int kconv, int n) {
    // [row parity][gdn_qk_slots] k (gdn_conv_step_body's layout)
    __shared__ __align__(16) float ks[2][GDN_QK_SLOTS];
    const int conv_dim = 2 * hk * dk + hv * dv;
    const int tid = threadIdx.x;
    if ((int)blockIdx.x >= hv) {
        if (blockIdx.y != 0) return;
        int ch = (blockIdx.x - hv) * REPLAY_THREADS + tid;
        const int km1 = kconv - 1;
        if (ch >= conv_dim || km1 < 1 || km1 > 7) return;
        // the window [window ‖ rows 0..n) keeps its last km1 elements
        float win[7];
#pragma unroll
        for (int j = 0; j < 7; ++j) win[j] = j < km1 ? conv_src[(size_t)j * conv_dim + ch] : 0.f;
        for (int t = 0; t < n; ++t) {
            const float x = rec[(size_t)t * rec_w + ch];
#pragma unroll
            for (int j = 0; j < 7; ++j)
                if (j < km1) win[j] = j + 1 < km1 ? win[j + 1] : x;
        }
#pragma unroll
        for (int j = 0; j < 7; ++j)
            if (j < km1) conv_state[(size_t)j * conv_dim + ch] = win[j];
        return;
    }
    const int koff = conv_dim, voff = conv_dim + hk * dk, goff = voff + hv * dv, boff = goff + hv;
    const int h = blockIdx.x, lane = tid & 31, w = tid >> 5;
    const int cp = lane >> 3, j = blockIdx.y * 32 + 8 * w + (lane & 7);
    const int R = dk / 8;
    const int kap = h % hk;
    const GdnQkSlots sl = gdn_qk_slots(tid, cp, R);
    const int r0 = sl.r0, r1 = sl.r1;  // this lane's two chunks in ks
    const int kw = sl.kw;              // where k element tid goes (tid < dk)
    float* Sh = S + (size_t)h * dk * dv;
    const float* Ss = S_src + (size_t)h * dk * dv;
    float s[32];
#pragma unroll
    for (int c = 0; c < 2; ++c)
#pragma unroll
        for (int r = 0; r < 16; ++r)
            s[c * 16 + r] = r < R ? Ss[(size_t)((2 * cp + c) * R + r) * dv + j] : 0.f;
    for (int t = 0; t < n; ++t) {
        const float* row = rec + (size_t)t * rec_w;
        const int b = t & 1;
        // (row t − 2's readers of this buffer passed row t − 1's barrier before this write)
        if (tid < dk) ks[b][kw] = row[koff + kap * dk + tid];
        __syncthreads();
        // gdn_step's row t without its output
        gdn_state_row<false>(s, ks[b], nullptr, r0, r1, R, expf(row[goff + h]), row[boff + h],
                             row[voff + h * dv + j], lane);
    }
#pragma unroll
    for (int c = 0; c < 2; ++c)
#pragma unroll
        for (int r = 0; r < 16; ++r)
            if (r < R) Sh[(size_t)((2 * cp + c) * R + r) * dv + j] = s[c * 16 + r];
}

extern "C" __global__ void gdn_replay(float* S, float* conv_state, const float* S_src, const float* conv_src,
                                      const float* rec, int rec_w, int hk, int hv, int dk, int dv, int kconv,
                                      int n) {
    PDL_ENTRY();  // launched with programmatic stream serialization: wait first
    gdn_replay_body(S, conv_state, S_src, conv_src, rec, rec_w, hk, hv, dk, dv, kconv, n);
}

// gdn_replay of up to REPLAY_MAX_LAYERS GDN layers of a rollback in one launch (the layers are
// independent; one launch per layer ran them one after the other, ~8 µs each on a 27B model).
// grid (as gdn_replay's, L): block z replays layer z, whose five pointers are tab.p[5z ..]: S,
// conv_state, S_src, conv_src, rec. The table is a by-value parameter (2.5 KiB of the 4 KiB
// parameter space), read in place (__grid_constant__). The same body as gdn_replay, so the same
// bits.
#define REPLAY_MAX_LAYERS 64
struct ReplayTab {
    u64 p[5 * REPLAY_MAX_LAYERS];
};
extern "C" __global__ void gdn_replay_layers(const __grid_constant__ ReplayTab tab, int rec_w, int hk, int hv,
                                             int dk, int dv, int kconv, int n) {
    PDL_ENTRY();  // launched with programmatic stream serialization: wait first
    const u64* p = tab.p + 5 * blockIdx.z;
    gdn_replay_body((float*)p[0], (float*)p[1], (const float*)p[2], (const float*)p[3], (const float*)p[4],
                    rec_w, hk, hv, dk, dv, kconv, n);
}

// ---- DSpark drafter (MODEL.md §4.5–§4.6) ---------------------------------------------------------
//
// The drafter's matrices are Q4_1 (re-tiled by retile_q41: codes [n_out, n_in/32] uint4 in GGUF nibble
// order, (d, m) [n_out, n_in/32] as one u32 = d | m << 16, both f16), its context K/V cache is f32 in
// a ring of `cap` rows ([cap, n_kv·hd] per layer), and a draft is at most 8 block rows.

// Q4_1 mat-vec for n <= 8 int8 activation rows, over up to 3 matrices sharing the input (segments;
// unused ones have n_out = 0): y_s[t, o] (+)= Σ_b xd[t,b]·(d_ob·Σ_j q_obj·xq[t,b,j] + m_ob·xs[t,b]).
// grid ceil(Σ ceil(n_out_s / R) / 4), block 128 (4 warps): warp = R consecutive rows of one segment,
// lane l takes blocks l, l + 32, ... in increasing order, then a fixed xor-tree: row t's result does
// not depend on n. Byte i of code word w holds element 4w + i (low nibble) and 16 + 4w + i (high).
// Q41_R rows per warp (the template parameter): 2 in every entry (4 measured no faster; removed
// on 2026-12-07). NT: activation rows the
// registers are sized for, MAXN or 4 (`mv_q41_n4`, n <= 4: a draft block; fewer registers, more
// warps per SM, the same float operations per row). RF (`mv_q41_n4f`, opt-in with
// `Gpu::mv_rows_first`, built, not yet run on a GPU): the activation rows loaded first (rows past n
// read row n − 1 again, never stored) and each weight row's masks made once for all of them, with no branch between — behind the
// `t < n` branches ptxas masks the codes again for every row (128 LOP3 beside 128 IDP in the main
// loop of `mv_q41_n4`). The same float operations per row.
#define Q41_WARPS 4
template <int Q41_R, int NT, bool RF = false>
__device__ __forceinline__ void mv_q41_rows(const uint4* c0, const u32* dm0, float* y0, int n0, const uint4* c1,
                                            const u32* dm1, float* y1, int n1, const uint4* c2, const u32* dm2,
                                            float* y2, int n2, const i8* __restrict__ q,
                                            const float* __restrict__ da, const int* __restrict__ sa, int n_in,
                                            int n, int accumulate) {
    int lane = threadIdx.x & 31;
    int gw = blockIdx.x * Q41_WARPS + (threadIdx.x >> 5);
    int g0 = (n0 + Q41_R - 1) / Q41_R, g1 = (n1 + Q41_R - 1) / Q41_R, g2 = (n2 + Q41_R - 1) / Q41_R;
    const uint4* cp;
    const u32* dp;
    float* y;
    int no;
    if (gw < g0) {
        cp = c0; dp = dm0; y = y0; no = n0;
    } else if ((gw -= g0) < g1) {
        cp = c1; dp = dm1; y = y1; no = n1;
    } else if ((gw -= g1) < g2) {
        cp = c2; dp = dm2; y = y2; no = n2;
    } else {
        return;  // no block barrier in this kernel
    }
    int o0 = gw * Q41_R;
    int nb = n_in >> 5;
    const uint4* crow[Q41_R];
    const u32* drow[Q41_R];
#pragma unroll
    for (int r = 0; r < Q41_R; ++r) {
        size_t ro = (size_t)min(o0 + r, no - 1);
        crow[r] = cp + ro * nb;
        drow[r] = dp + ro * nb;
    }
    float acc[Q41_R][NT];
#pragma unroll
    for (int r = 0; r < Q41_R; ++r)
#pragma unroll
        for (int t = 0; t < NT; ++t) acc[r][t] = 0.f;
#pragma unroll 2
    for (int j = lane; j < nb; j += 32) {
        uint4 c[Q41_R];
        float dw[Q41_R], mw[Q41_R];
#pragma unroll
        for (int r = 0; r < Q41_R; ++r) {
            c[r] = __ldg(crow[r] + j);
            u32 dm = __ldg(drow[r] + j);
            dw[r] = h2f((u16)(dm & 0xffffu));
            mw[r] = h2f((u16)(dm >> 16));
        }
        if constexpr (RF) {
            int4 a0[NT], a1[NT];
            float dt[NT], st[NT];
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                // rows past n read row n − 1 again (no branch, no zeroing; never stored)
                const size_t tt = (size_t)min(t, max(n - 1, 0));
                const int4* qa4 = (const int4*)(q + tt * n_in + (size_t)j * 32);
                a0[t] = __ldg(qa4), a1[t] = __ldg(qa4 + 1);
                dt[t] = __ldg(da + tt * nb + j);
                st[t] = (float)__ldg(sa + tt * nb + j);
            }
#pragma unroll
            for (int r = 0; r < Q41_R; ++r) {
                const u32 M4 = 0x0f0f0f0fu, H4 = 0xf0f0f0f0u;
                const u32 l0 = c[r].x & M4, l1 = c[r].y & M4, l2 = c[r].z & M4, l3 = c[r].w & M4;
                const u32 h0 = c[r].x & H4, h1 = c[r].y & H4, h2 = c[r].z & H4, h3 = c[r].w & H4;
#pragma unroll
                for (int t = 0; t < NT; ++t) {
                    // the plain path's operations below, in its order
                    int lo = 0, hi = 0;
                    lo = dp4a_us(l0, a0[t].x, lo);
                    lo = dp4a_us(l1, a0[t].y, lo);
                    lo = dp4a_us(l2, a0[t].z, lo);
                    lo = dp4a_us(l3, a0[t].w, lo);
                    hi = dp4a_us(h0, a1[t].x, hi);
                    hi = dp4a_us(h1, a1[t].y, hi);
                    hi = dp4a_us(h2, a1[t].z, hi);
                    hi = dp4a_us(h3, a1[t].w, hi);
                    int is = lo + (hi >> 4);
                    acc[r][t] = fmaf(dt[t], fmaf(dw[r], (float)is, mw[r] * st[t]), acc[r][t]);
                }
            }
            continue;
        }
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            if (t < n) {
                const int4* qa4 = (const int4*)(q + (size_t)t * n_in + (size_t)j * 32);
                int4 a0 = __ldg(qa4), a1 = __ldg(qa4 + 1);
                float dt = __ldg(da + (size_t)t * nb + j);
                float st = (float)__ldg(sa + (size_t)t * nb + j);
#pragma unroll
                for (int r = 0; r < Q41_R; ++r) {
                    // low nibbles as they are, high nibbles masked in place (16·code, unsigned
                    // bytes): no shifts; the integer sum is exact, the same as shifting them down
                    const u32 M4 = 0x0f0f0f0fu, H4 = 0xf0f0f0f0u;
                    int lo = 0, hi = 0;
                    lo = dp4a_us(c[r].x & M4, a0.x, lo);
                    lo = dp4a_us(c[r].y & M4, a0.y, lo);
                    lo = dp4a_us(c[r].z & M4, a0.z, lo);
                    lo = dp4a_us(c[r].w & M4, a0.w, lo);
                    hi = dp4a_us(c[r].x & H4, a1.x, hi);
                    hi = dp4a_us(c[r].y & H4, a1.y, hi);
                    hi = dp4a_us(c[r].z & H4, a1.z, hi);
                    hi = dp4a_us(c[r].w & H4, a1.w, hi);
                    int is = lo + (hi >> 4);
                    acc[r][t] = fmaf(dt, fmaf(dw[r], (float)is, mw[r] * st), acc[r][t]);
                }
            }
        }
    }
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        if (t < n) {
#pragma unroll
            for (int r = 0; r < Q41_R; ++r) {
                float v = warp_sum(acc[r][t]);
                if (lane == 0 && o0 + r < no) {
                    float* yp = y + (size_t)t * no + o0 + r;
                    *yp = accumulate ? *yp + v : v;
                }
            }
        }
    }
}

#define MV_Q41_ENTRY(name, R, NT) MV_Q41_ENTRY_RF(name, R, NT, false)
#define MV_Q41_ENTRY_RF(name, R, NT, RF)                                                                        \
    extern "C" __global__ void __launch_bounds__(Q41_WARPS * 32)                                                \
        name(const uint4* c0, const u32* dm0, float* y0, int n0, const uint4* c1, const u32* dm1, float* y1,    \
             int n1, const uint4* c2, const u32* dm2, float* y2, int n2, const i8* __restrict__ q,              \
             const float* __restrict__ da, const int* __restrict__ sa, int n_in, int n, int accumulate) {       \
        PDL_ENTRY();                                                                                            \
        mv_q41_rows<R, NT, RF>(c0, dm0, y0, n0, c1, dm1, y1, n1, c2, dm2, y2, n2, q, da, sa, n_in, n, accumulate); \
    }
MV_Q41_ENTRY(mv_q41, 2, MAXN)
MV_Q41_ENTRY(mv_q41_n4, 2, 4)
MV_Q41_ENTRY_RF(mv_q41_n4f, 2, 4, true)

// Ring row of logical row t: (slot0 + t) mod cap, or t itself when cap <= 0.
__device__ __forceinline__ size_t dsp_ring_row(int t, int cap, int slot0) {
    return cap > 0 ? (size_t)((slot0 + t) % cap) : (size_t)t;
}

// Per-head RMSNorm ⊙ w, then NEOX RoPE over all hd dims (pairs (d, d + hd/2), θ_d = pos·base^(−2d/hd),
// in double like attn_prep) at position pos0 + t. grid (heads, n), block hd (<= 256, multiple of 32).
//   src [n, src_stride] f32, head h at columns [h·hd, (h+1)·hd); dst row dsp_ring_row(t) of
//   [*, dst_stride], same columns. src and dst must not overlap.
//   Two head sets in one launch (the draft's q and k heads): blocks h < heads1 take (src, w, dst),
//   blocks heads1.. take head h − heads1 of (src2, w2, dst2) with the same n, hd, positions and ring;
//   heads1 = gridDim.x when there is no second set. Each head's operations do not depend on the set.
//   par: null, or the draft graph's device parameters (DSP_PAR_*): pos0 = par[DSP_PAR_POS].
#define DSP_PAR_POS 0
#define DSP_PAR_OFF 1
#define DSP_PAR_LEN 2
#define DSP_PAR_SLOT 3
extern "C" __global__ void dsp_norm_rope(const float* src, int src_stride, const float* w, float eps, int hd,
                                         int pos0, float rope_base, float* dst, int dst_stride, int cap,
                                         int slot0, const int* par, int heads1, const float* src2,
                                         int src2_stride, const float* w2, float* dst2, int dst2_stride) {
    PDL_ENTRY();  // launched with programmatic stream serialization: wait first
    __shared__ float red[32], buf[256];
    int h = blockIdx.x, t = blockIdx.y, j = threadIdx.x;
    if (h >= heads1) {
        h -= heads1;
        src = src2, src_stride = src2_stride, w = w2, dst = dst2, dst_stride = dst2_stride;
    }
    if (par) {
        pos0 = par[DSP_PAR_POS];
        if (cap > 0) slot0 = par[DSP_PAR_SLOT];  // a captured stage writes the ring at run time
    }
    float x = src[(size_t)t * src_stride + h * hd + j];
    float ss = block_sum(x * x, red);
    float inv = 1.0f / sqrtf(ss / (float)hd + eps);
    buf[j] = x * inv * w[j];
    __syncthreads();
    int half = hd / 2;
    int dd = j < half ? j : j - half;
    double theta = (double)(pos0 + t) * pow((double)rope_base, -2.0 * dd / (double)hd);
    double sn, cs;
    sincos(theta, &sn, &cs);
    double a = buf[dd], b = buf[dd + half];
    float y = j < half ? (float)(a * cs - b * sn) : (float)(a * sn + b * cs);
    dst[dsp_ring_row(t, cap, slot0) * dst_stride + h * hd + j] = y;
}

// dst row dsp_ring_row(t) [width] = src row t [width] (src row stride src_stride). par: null, or
// the captured stage's device parameters, whose slot replaces slot0.
// grid (ceil(width / 256), n), block 256.
extern "C" __global__ void dsp_copy_rows(const float* src, int src_stride, int width, float* dst, int cap,
                                         int slot0, const int* par) {
    PDL_ENTRY();  // launched with programmatic stream serialization: wait first
    if (par) slot0 = par[DSP_PAR_SLOT];
    int t = blockIdx.y, c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= width) return;
    dst[dsp_ring_row(t, cap, slot0) * width + c] = src[(size_t)t * src_stride + c];
}

// Non-causal block attention, phase 1. The n (<= 8) block queries attend over T = len + n keys:
// logical key i < len is ring row (off + i) mod cap of the context cache kc/vc [cap, nkv·hd]; key
// i >= len is row i − len of the block's kb/vb [n, nkv·hd]. Keys are cut into chunks of
// dsp_chunk_len(T, spread); block (h, c) handles chunk c of q head h (kv head h / (nh / nkv)) for all n rows
// and writes part[t, h, c] = (Σ_i p_i·v_i [hd], m, l) with m the chunk max score and p_i = exp(s_i − m).
// grid (nh, nchunk), block 256, nchunk >= dsp_chunks(T, spread) (the part stride); chunks past T write
// nothing. qo [n, nh·hd] f32; hd a multiple of 32, <= 256. par: null, or the draft graph's device
// parameters, whose off and len replace the arguments (its grid is sized for a full ring).
#define DSP_CH 256
// Keys per chunk for T keys: T spread over `spread` chunks (the drafter's default 8: a short
// context still gives nh·8 blocks instead of nh), rounded up to a multiple of 32 and kept within
// 32..DSP_CH. A function of (T, spread) alone: the eager launch (sized for T) and the graph's
// (sized for the whole ring) cut the keys the same way and give the same bits. Host twins:
// `dsp_attn_chunk_len`, `dsp_attn_chunks` (spec.rs).
// chmax: the kernel's most keys per chunk (DSP_CH for dsp_attn_part*, DSP_GCH for dsp_attn_kv).
__device__ __forceinline__ int dsp_chunk_len(int T, int spread, int chmax) {
    const int c = ((T + spread - 1) / spread + 31) & ~31;
    return c < 32 ? 32 : c > chmax ? chmax : c;
}
__device__ __forceinline__ int dsp_chunks(int T, int spread, int chmax) {
    const int c = dsp_chunk_len(T, spread, chmax);
    return (T + c - 1) / c;
}
// EPL: elements per lane of a head row (hd / 32) that the lane arrays hold: exact for the entries
// below, 8 (with hd / 32 <= 8 guarded) for any other head dim. Per element the operations do not
// depend on EPL.
template <int EPL>
__device__ __forceinline__ void dsp_attn_part_body(const float* qo, const float* kc, const float* vc, int cap,
                                                   int off, int len, const float* kb, const float* vb, int n,
                                                   int nh, int nkv, int hd, float scale, int nchunk, float* part,
                                                   const int* par, int spread) {
    PDL_ENTRY();  // launched with programmatic stream serialization: wait first
    __shared__ __align__(16) float qs[MAXN][256];
    __shared__ float sc[MAXN][DSP_CH];
    __shared__ float red[32];
    __shared__ float sm_m[MAXN], sm_l[MAXN];
    int h = blockIdx.x, c = blockIdx.y, tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    if (par) {
        off = par[DSP_PAR_OFF];
        len = par[DSP_PAR_LEN];
    }
    int kvw = nkv * hd, g = h / (nh / nkv);
    int T = len + n;
    const int chl = dsp_chunk_len(T, spread, DSP_CH);
    int i0 = c * chl, cnt = min(chl, T - i0);
    if (cnt <= 0) return;  // a chunk past the keys (the whole block: before any barrier)
    for (int idx = tid; idx < n * hd; idx += blockDim.x)
        qs[idx / hd][idx % hd] = qo[(size_t)(idx / hd) * nh * hd + h * hd + idx % hd];
    __syncthreads();
    int epl = hd >> 5;  // elements per lane (<= 8)
    // this lane's columns (lane + 32e) of the V rows of chunk indices i, i + 8, ..: DSP_KU rows
    // (32 floats per lane), all loads issued before any is used (one key's loads alone would leave
    // the warp waiting on each in turn); rows past the chunk read as 0. A row is a context ring
    // row or a block row.
    constexpr int DSP_KU = 32 / EPL;
    auto load_rows = [&](const float* ring, const float* blk, int i, float (&v)[DSP_KU][EPL]) {
#pragma unroll
        for (int u = 0; u < DSP_KU; ++u) {
            const int iu = i + 8 * u, li = i0 + (iu < cnt ? iu : i);
            const float* r =
                (li < len ? ring + (size_t)((off + li) % cap) * kvw : blk + (size_t)(li - len) * kvw) + g * hd;
#pragma unroll
            for (int e = 0; e < EPL; ++e) v[u][e] = e < epl && iu < cnt ? r[lane + 32 * e] : 0.f;
        }
    };
    // scores: thread i takes key i of the chunk (cnt <= DSP_CH = blockDim.x) and dots its whole K
    // row, 4 columns at a time in increasing order, with every query row (q from shared memory,
    // the same address in every lane): no cross-lane reduction per key and row, and the row's
    // loads are independent of each other
    if (tid < cnt) {
        const int li = i0 + tid;
        const float4* r = (const float4*)((li < len ? kc + (size_t)((off + li) % cap) * kvw
                                                    : kb + (size_t)(li - len) * kvw) +
                                          g * hd);
        float a[MAXN];
#pragma unroll
        for (int t = 0; t < MAXN; ++t) a[t] = 0.f;
#pragma unroll 8
        for (int d4 = 0; d4 < (hd >> 2); ++d4) {
            const float4 k = __ldg(r + d4);
#pragma unroll
            for (int t = 0; t < MAXN; ++t)
                if (t < n) {
                    const float4 q = *(const float4*)&qs[t][4 * d4];
                    a[t] = fmaf(q.x, k.x, a[t]);
                    a[t] = fmaf(q.y, k.y, a[t]);
                    a[t] = fmaf(q.z, k.z, a[t]);
                    a[t] = fmaf(q.w, k.w, a[t]);
                }
        }
#pragma unroll
        for (int t = 0; t < MAXN; ++t)
            if (t < n) sc[t][tid] = a[t] * scale;
    }
    __syncthreads();
    for (int t = 0; t < n; ++t) {
        float m = NEG_INF;
        for (int i = tid; i < cnt; i += blockDim.x) m = fmaxf(m, sc[t][i]);
        m = block_max(m, red);
        float l = 0.f;
        for (int i = tid; i < cnt; i += blockDim.x) {
            float p = expf(sc[t][i] - m);
            sc[t][i] = p;
            l += p;
        }
        l = block_sum(l, red);
        if (tid == 0) {
            sm_m[t] = m;
            sm_l[t] = l;
        }
    }
    __syncthreads();
    // weighted V: warp w takes keys w, w + 8, ... (DSP_KU per step, loads first), lane the columns
    // lane + 32e; then the 8 warps' partial sums are added in warp order
    float o[MAXN][EPL];
#pragma unroll
    for (int t = 0; t < MAXN; ++t)
#pragma unroll
        for (int e = 0; e < EPL; ++e) o[t][e] = 0.f;
    for (int i = w; i < cnt; i += 8 * DSP_KU) {
        float vv[DSP_KU][EPL];
        load_rows(vc, vb, i, vv);
#pragma unroll
        for (int u = 0; u < DSP_KU; ++u) {
            const int iu = i + 8 * u;
            if (iu >= cnt) break;
#pragma unroll
            for (int t = 0; t < MAXN; ++t)
                if (t < n) {
                    const float p = sc[t][iu];
#pragma unroll
                    for (int e = 0; e < EPL; ++e) o[t][e] = fmaf(p, vv[u][e], o[t][e]);
                }
        }
    }
    // the warps' partial sums of one activation row at a time: [8 warps][256 columns]
    __shared__ float vsum[8][256];
#pragma unroll
    for (int t = 0; t < MAXN; ++t) {
        if (t >= n) break;
        __syncthreads();
#pragma unroll
        for (int e = 0; e < EPL; ++e)
            if (e < epl) vsum[w][lane + 32 * e] = o[t][e];
        __syncthreads();
        float* pp = part + (((size_t)t * nh + h) * nchunk + c) * (hd + 2);
        if (tid < hd) {
            float s = vsum[0][tid];
            for (int k2 = 1; k2 < 8; ++k2) s += vsum[k2][tid];
            pp[tid] = s;
            if (tid == 0) {
                pp[hd] = sm_m[t];
                pp[hd + 1] = sm_l[t];
            }
        }
    }
}

#define DSP_ATTN_ENTRY(NAME, EPL)                                                                          \
    extern "C" __global__ void __launch_bounds__(256)                                                    \
        NAME(const float* qo, const float* kc, const float* vc, int cap, int off, int len, const float* kb, \
             const float* vb, int n, int nh, int nkv, int hd, float scale, int nchunk, float* part,         \
             const int* par, int spread) {                                                              \
        dsp_attn_part_body<EPL>(qo, kc, vc, cap, off, len, kb, vb, n, nh, nkv, hd, scale, nchunk, part, par, \
                                spread);                                                                \
    }
// dsp_attn_part: any head dim (a multiple of 32 up to 256); _e1 / _e2 / _e4: exactly 32 / 64 / 128
// (fewer registers: the lane arrays hold what the head uses). Launcher: `Gpu::dsp_attention`.
DSP_ATTN_ENTRY(dsp_attn_part, 8)
DSP_ATTN_ENTRY(dsp_attn_part_e1, 1)
DSP_ATTN_ENTRY(dsp_attn_part_e2, 2)
DSP_ATTN_ENTRY(dsp_attn_part_e4, 4)

// Phase 1 with the keys shared by every q head of a kv head (opt-in: BONSAI_CUDA_DRAFT_ATTN=kv;
// see spec.rs DspAttnKernel::PerKvHead for why it is not the default): block (g, s) takes kv head g and slot s = (chunk c, group of query rows). The R =
// (nh / nkv)·n query rows of kv head g are row r = j·n + t for q head g·(nh / nkv) + j and block
// row t; each key and value row of a chunk is read once per row group instead of once per q head.
// Chunks of dsp_chunk_len(T, DSP_GSPREAD, DSP_GCH) keys (T alone decides them, as above). Groups:
// ng = clamp(nslot / nchunks, ngmin, R) of rb = ceil(R / ng) rows, so a short context (few chunks)
// still fills the grid, and the graph's grid (sized for a full ring) splits the rows of a short
// context the same way an eager launch sized for it would not need to: each row's float order is
// its own (no operation mixes rows), so any grouping gives the same bits.
//   scores: the chunk's keys 32 at a time through shared memory (coalesced loads), warp w the rows
//           w, w + 8, .., lane the key; each dot over the head in increasing dims, 4 at a time.
//   softmax: a warp per row (warp_max / warp_sum); m and l go to the row's partial.
//   weighted V: thread (dim d, row subset rs) over the chunk's keys in increasing order, V loads
//           coalesced across d, the probabilities of 4 keys per shared-memory load.
// grid (nkv, nslot), block 256; shared tiles (spec.rs `dsp_attn_kv_smem`, within DSP_GSMEM
// floats): qs [rbmax][hd] | ks [32][hd + 4] | sc [rbmax][DSP_GCH]; rbmax = ceil(R / ngmin). nslot >= dsp_chunks(T, ..)·ngmin; part as for dsp_attn_part (stride nchunk).
#define DSP_GCH 128     // most keys per chunk of dsp_attn_kv
#define DSP_GSPREAD 32  // most chunks a context spreads over before they reach DSP_GCH keys
#define DSP_GSMEM 10240  // floats of dsp_attn_kv's shared tiles (40 KB; spec.rs DSP_ATTN_KV_SMEM)
#define DSP_GRV 12      // most query rows per thread of the weighted V (a group's rows <= (256 / hd)·DSP_GRV)
extern "C" __global__ void __launch_bounds__(256)
    dsp_attn_kv(const float* qo, const float* kc, const float* vc, int cap, int off, int len, const float* kb,
                const float* vb, int n, int nh, int nkv, int hd, float scale, int nchunk, int ngmin, float* part,
                const int* par) {
    PDL_ENTRY();  // launched with programmatic stream serialization: wait first
    __shared__ __align__(16) float dsm[DSP_GSMEM];  // static (the launcher keeps a group within it)
    __shared__ const float* krow[DSP_GCH];
    __shared__ const float* vrow[DSP_GCH];
    const int g = blockIdx.x, tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    if (par) {
        off = par[DSP_PAR_OFF];
        len = par[DSP_PAR_LEN];
    }
    const int qpk = nh / nkv, R = qpk * n, kvw = nkv * hd, T = len + n;
    const int chl = dsp_chunk_len(T, DSP_GSPREAD, DSP_GCH), nch = (T + chl - 1) / chl;
    const int ng = max(ngmin, min(R, (int)gridDim.y / nch)), rb = (R + ng - 1) / ng;
    const int c = blockIdx.y / ng, r0 = (blockIdx.y % ng) * rb;
    if (c >= nch || r0 >= R) return;  // a slot past the keys or the rows (the whole block)
    const int i0 = c * chl, cnt = min(chl, T - i0), nr = min(rb, R - r0);
    const int rbmax = (R + ngmin - 1) / ngmin, h4 = hd >> 2, ksw = hd + 4;
    float* qs = dsm;                 // [rbmax][hd]
    float* ks = qs + rbmax * hd;     // [32][hd + 4]: +4 keeps a warp's float4 row reads conflict-free
    float* sc = ks + 32 * ksw;       // [rbmax][chl]
    for (int i = tid; i < cnt; i += blockDim.x) {
        const int li = i0 + i;
        const size_t ro = li < len ? (size_t)((off + li) % cap) * kvw : (size_t)(li - len) * kvw;
        krow[i] = (li < len ? kc : kb) + ro + g * hd;
        vrow[i] = (li < len ? vc : vb) + ro + g * hd;
    }
    for (int idx = tid; idx < nr * h4; idx += blockDim.x) {
        const int r = idx / h4, d4 = idx % h4, rr = r0 + r;
        const float* src = qo + (size_t)(rr % n) * nh * hd + (size_t)(g * qpk + rr / n) * hd;
        ((float4*)(qs + r * hd))[d4] = __ldg((const float4*)src + d4);
    }
    // a 32-key tile of K or V rows into ks [32][hd + 4] (rows past the chunk as 0): each thread's
    // loads issued before any store, coalesced along the rows
    auto put = [&](const float* const* rows, int kt) {
        for (int idx = tid; idx < 32 * h4; idx += blockDim.x) {
            const int i = idx / h4, d4 = idx % h4;
            *(float4*)(ks + i * ksw + 4 * d4) =
                kt + i < cnt ? __ldg((const float4*)rows[kt + i] + d4) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
    };
    for (int kt = 0; kt < cnt; kt += 32) {
        const int kn = min(32, cnt - kt);
        __syncthreads();  // krow / qs written; the previous tile's reads done
        put(krow, kt);
        __syncthreads();
        const float4* kr = (const float4*)(ks + lane * ksw);
        for (int rp = w; rp < nr; rp += 64) {
            const int nu = min(8, (nr - rp + 7) >> 3);  // this warp's rows rp, rp + 8, .. of the pass
            float a[8];
#pragma unroll
            for (int u = 0; u < 8; ++u) a[u] = 0.f;
#pragma unroll 4
            for (int d4 = 0; d4 < h4; ++d4) {
                const float4 k = kr[d4];
                // rows past the group end the loop (a warp-uniform branch, not 8 predicated rows)
#pragma unroll
                for (int u = 0; u < 8; ++u) {
                    if (u >= nu) break;
                    const float4 q = ((const float4*)(qs + (rp + 8 * u) * hd))[d4];
                    a[u] = fmaf(q.x, k.x, a[u]);
                    a[u] = fmaf(q.y, k.y, a[u]);
                    a[u] = fmaf(q.z, k.z, a[u]);
                    a[u] = fmaf(q.w, k.w, a[u]);
                }
            }
            if (lane < kn) {
#pragma unroll
                for (int u = 0; u < 8; ++u) {
                    if (u >= nu) break;
                    sc[(rp + 8 * u) * chl + kt + lane] = a[u] * scale;
                }
            }
        }
    }
    __syncthreads();
    // softmax of row r by warp r mod 8; keys past cnt get p = 0 (the V loop reads 4 at a time)
    for (int r = w; r < nr; r += 8) {
        float* sr = sc + r * chl;
        float m = NEG_INF;
        for (int i = lane; i < cnt; i += 32) m = fmaxf(m, sr[i]);
        m = warp_max(m);
        float l = 0.f;
        for (int i = lane; i < chl; i += 32) {
            const float p = i < cnt ? expf(sr[i] - m) : 0.f;
            sr[i] = p;
            l += p;
        }
        l = warp_sum(l);
        if (lane == 0) {
            const int rr = r0 + r;
            float* pp = part + (((size_t)(rr % n) * nh + g * qpk + rr / n) * nchunk + c) * (hd + 2);
            pp[hd] = m;
            pp[hd + 1] = l;
        }
    }
    __syncthreads();
    // weighted V: thread (d, rs) holds rows rs, rs + rsn, .. (rb <= rsn·DSP_GRV: the host's
    // dsp_attn_kv_min_groups), the V tiles through shared memory like the K ones
    const int rsn = blockDim.x / hd, d = tid % hd, rs = tid / hd;  // row subsets; warp-uniform rs
    const int nvu = rs < rsn ? min(DSP_GRV, (nr - rs + rsn - 1) / rsn) : 0;  // rows rs + rsn·u, u < nvu
    float o[DSP_GRV];
#pragma unroll
    for (int u = 0; u < DSP_GRV; ++u) o[u] = 0.f;
    for (int kt = 0; kt < cnt; kt += 32) {
        const int kn4 = (min(32, cnt - kt) + 3) & ~3;  // p = 0 past cnt (the softmax wrote it)
        __syncthreads();  // the scores / softmax, or the previous V tile, done with ks and sc
        put(vrow, kt);
        __syncthreads();
        if (rs < rsn) {
            for (int i = 0; i < kn4; i += 4) {
                float v[4];
#pragma unroll
                for (int e = 0; e < 4; ++e) v[e] = ks[(i + e) * ksw + d];
#pragma unroll
                for (int u = 0; u < DSP_GRV; ++u) {
                    if (u >= nvu) break;  // warp-uniform, as in the scores
                    const float4 p = *(const float4*)(sc + (rs + rsn * u) * chl + kt + i);
                    o[u] = fmaf(p.x, v[0], o[u]);
                    o[u] = fmaf(p.y, v[1], o[u]);
                    o[u] = fmaf(p.z, v[2], o[u]);
                    o[u] = fmaf(p.w, v[3], o[u]);
                }
            }
        }
    }
    if (rs >= rsn) return;
#pragma unroll
    for (int u = 0; u < DSP_GRV; ++u) {
        const int r = rs + rsn * u;
        if (r < nr) {
            const int rr = r0 + r;
            part[(((size_t)(rr % n) * nh + g * qpk + rr / n) * nchunk + c) * (hd + 2) + d] = o[u];
        }
    }
}

// Phase 2: merge the chunk partials of (h, t) in chunk order; write f32 (out) and int8-quantize
// (q/d/s, per-32 blocks of [n, nh·hd]). grid (nh, n), block hd. nchunk: the part stride; with par
// (the draft graph) only the dsp_chunks(len + n, spread, chmax) chunks that hold keys are merged,
// the same partials in the same order as the launch sized for them. (spread, chmax): the phase-1
// kernel's (8 or 1, DSP_CH for dsp_attn_part*; DSP_GSPREAD, DSP_GCH for dsp_attn_kv).
extern "C" __global__ void dsp_attn_merge(const float* part, int nh, int hd, int nchunk, float* out, i8* q,
                                          float* d, int* s, const int* par, int spread, int chmax) {
    PDL_ENTRY();  // launched with programmatic stream serialization: wait first
    int h = blockIdx.x, t = blockIdx.y, j = threadIdx.x;
    const float* pp = part + ((size_t)t * nh + h) * nchunk * (hd + 2);
    const int cnt =
        par ? min(nchunk, dsp_chunks(par[DSP_PAR_LEN] + (int)gridDim.y, spread, chmax)) : nchunk;
    float M = NEG_INF;
    for (int c = 0; c < cnt; ++c) M = fmaxf(M, pp[(size_t)c * (hd + 2) + hd]);
    float ls = 0.f, o = 0.f;
    for (int c = 0; c < cnt; ++c) {
        const float* pc = pp + (size_t)c * (hd + 2);
        float f = expf(pc[hd] - M);
        ls = fmaf(pc[hd + 1], f, ls);
        o = fmaf(pc[j], f, o);
    }
    float y = o / ls;
    size_t idx = ((size_t)t * nh + h) * hd + j;
    out[idx] = y;
    size_t b = idx >> 5;
    quant32(y, q + (b << 5), d + b, s + b);
}

// Element i of a plane of kind 0 (f32), 1 (bf16) or 2 (f16).
__device__ __forceinline__ float dsp_ld(const void* p, int kind, size_t i) {
    if (kind == 0) return __ldg((const float*)p + i);
    u16 v = __ldg((const u16*)p + i);
    return kind == 1 ? __uint_as_float(((u32)v) << 16) : h2f(v);
}

// One Markov step (MODEL.md §4.6): scores[v] = logits[v] + Σ_r b[v, r]·a[prev, r] with prev = *prev
// (device memory: the token just chosen), scores[mask] = −inf. a, b: planes [nv, rank] of kinds
// ka, kb (dsp_ld).
// grid ceil(nv / (8·DSP_MV)), block 256: a warp per DSP_MV vocab entries; lanes over r in
// increasing order, or, for two 16-bit planes of the same kind and rank a multiple of 8, 8
// consecutive r per lane (one 16-byte load of each table row).
// rev: block i takes the vocab entries of block gridDim.x − 1 − i. The draft's steps alternate it,
// so a step starts with the entries (and the rows of b) that the step before read last and the L2
// still holds; every entry's operations are the same either way.
#define DSP_MV 4  // vocab entries per warp
extern "C" __global__ void dsp_markov_scores(const float* logits, const void* a, int ka, const void* b, int kb,
                                             int rank, int nv, int mask, const int* prev, float* scores,
                                             int rev) {
    PDL_ENTRY();  // launched with programmatic stream serialization: wait first
    int lane = threadIdx.x & 31;
    const int bx = rev ? (int)gridDim.x - 1 - (int)blockIdx.x : (int)blockIdx.x;
    int v0 = (bx * 8 + (threadIdx.x >> 5)) * DSP_MV;
    if (v0 >= nv) return;
    int pv = *prev;
    size_t p = pv >= 0 && pv < nv ? (size_t)pv : 0;  // never read outside the table
    float acc[DSP_MV];
#pragma unroll
    for (int u = 0; u < DSP_MV; ++u) acc[u] = 0.f;
    if (kb != 0 && ka == kb && (rank & 7) == 0) {
        // 16-bit planes, rank a multiple of 8: lane l takes elements 8l .. 8l + 7 of each 256, one
        // 16-byte load per table row (the rows are 16-byte aligned: rank·2 bytes a row); the warp's
        // DSP_MV rows of b are loaded before any is used
        const uint4* ar = (const uint4*)((const u16*)a + p * rank);
        for (int c = lane; c < (rank >> 3); c += 32) {
            const uint4 aw = __ldg(ar + c);
            uint4 bw[DSP_MV];
#pragma unroll
            for (int u = 0; u < DSP_MV; ++u)
                bw[u] = v0 + u < nv ? __ldg((const uint4*)((const u16*)b + (size_t)(v0 + u) * rank) + c)
                                    : make_uint4(0, 0, 0, 0);
            const u32 aa[4] = {aw.x, aw.y, aw.z, aw.w};
#pragma unroll
            for (int u = 0; u < DSP_MV; ++u) {
                const u32 bb[4] = {bw[u].x, bw[u].y, bw[u].z, bw[u].w};
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    float b0, b1, a0, a1;
                    if (kb == 1) {
                        b0 = __uint_as_float(bb[i] << 16), b1 = __uint_as_float(bb[i] & 0xffff0000u);
                        a0 = __uint_as_float(aa[i] << 16), a1 = __uint_as_float(aa[i] & 0xffff0000u);
                    } else {
                        b0 = h2f((u16)(bb[i] & 0xffffu)), b1 = h2f((u16)(bb[i] >> 16));
                        a0 = h2f((u16)(aa[i] & 0xffffu)), a1 = h2f((u16)(aa[i] >> 16));
                    }
                    acc[u] = fmaf(b0, a0, acc[u]);
                    acc[u] = fmaf(b1, a1, acc[u]);
                }
            }
        }
    } else {
#pragma unroll
        for (int u = 0; u < DSP_MV; ++u)
            if (v0 + u < nv)
                for (int r = lane; r < rank; r += 32)
                    acc[u] = fmaf(dsp_ld(b, kb, (size_t)(v0 + u) * rank + r), dsp_ld(a, ka, p * rank + r), acc[u]);
    }
#pragma unroll
    for (int u = 0; u < DSP_MV; ++u) {
        const int v = v0 + u;
        const float sum = warp_sum(acc[u]);
        if (lane == 0 && v < nv) scores[v] = v == mask ? NEG_INF : logits[v] + sum;
    }
}
