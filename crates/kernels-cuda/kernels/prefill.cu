// Prefill (n > MAXN rows) variants of the GDN conv, the GDN recurrence and causal attention.
// Appended after gemm.cu by lib.rs (same translation unit: helpers and cp.async wrappers in scope).
// Decode and verify (n <= MAXN) never use these: they keep the batch-invariant kernels of bonsai.cu.

// ---- GDN conv over many rows --------------------------------------------------------------------

// Same math as gdn_conv, parallel over rows: row t's conv reads pre-conv inputs t-k+1..t (rows < 0
// from the OLD conv window), so rows are independent. The conv window is NOT updated here (blocks
// of other row tiles still read the old one): gdn_conv_window does it afterwards.
// grid (2·hk + hv + 1, ceil(n / GC_ROWS)), block 256 (8 warps). Warp w takes rows t0 + w + 8i of the
// block's tile; lane l handles channels 32m + l (m < dk/32 <= 4) of the head, so the per-row L2
// norm reduces exactly like gdn_conv's block_sum (warp m's xor tree, then m = 0, 1, .. in order):
// outputs equal gdn_conv's bit for bit. The conv taps are summed in gdn_conv's order (tap k-1 as a
// product, then taps 0..k-2 as fmas). The last block column does the gates of its rows.
//   mixed [n, conv_dim]; conv_state [k-1, conv_dim] oldest first (read only); convw [conv_dim, k];
//   out q/k [n, hk·dk], v [n, hv·dk]; bb/aa/beta_out/g_out [n, hv].
#define GC_ROWS 32

// The gates of rows t0..t1-1 (the extra block column of both conv kernels).
__device__ __forceinline__ void gdn_conv_gates(int t0, int t1, int hv, const float* __restrict__ bb,
                                               const float* __restrict__ aa, const float* __restrict__ dt_bias,
                                               const float* __restrict__ ssm_a, float* beta_out, float* g_out) {
    for (int i = t0 * hv + threadIdx.x; i < t1 * hv; i += blockDim.x) {
        int h = i % hv;
        beta_out[i] = sigmoidf_(bb[i]);
        float a = aa[i] + dt_bias[h];
        float sp = a > 20.f ? a : log1pf(expf(a));
        g_out[i] = ssm_a[h] * sp;
    }
}

// Row t of head `head` from its conv outputs y[m] (channel 32m + lane, m < nm): q / k heads are
// L2-normalized (gdn_conv's block_sum order: 0 + warp 0 + warp 1 + ..), v heads stored as they are.
__device__ __forceinline__ void gdn_conv_row_out(const float y[4], int t, int head, int hk, int hv, int dk, int nm,
                                                 int lane, float eps, float* qo, float* ko, float* vo) {
    if (head < 2 * hk) {
        float ss = 0.f;
#pragma unroll
        for (int m = 0; m < 4; ++m)
            if (m < nm) ss += warp_sum(y[m] * y[m]);
        float inv = 1.0f / fmaxf(sqrtf(ss), eps);
        float* dst = head < hk ? qo : ko;
        int hh = head < hk ? head : head - hk;
#pragma unroll
        for (int m = 0; m < 4; ++m)
            if (m < nm) dst[(size_t)t * hk * dk + hh * dk + 32 * m + lane] = y[m] * inv;
    } else {
#pragma unroll
        for (int m = 0; m < 4; ++m)
            if (m < nm) vo[(size_t)t * hv * dk + (head - 2 * hk) * dk + 32 * m + lane] = y[m];
    }
}

// The parameters of both row-parallel conv kernels (gdn_conv_args on the host).
#define GDN_CONV_ROWS_PARAMS                                                                              \
    const float* __restrict__ mixed, const float* __restrict__ conv_state, const float* __restrict__ convw, \
        int kconv, int hk, int hv, int dk, int n, float eps, float* qo, float* ko, float* vo,           \
        const float* __restrict__ bb, const float* __restrict__ aa, const float* __restrict__ dt_bias,  \
        const float* __restrict__ ssm_a, float* beta_out, float* g_out

extern "C" __global__ void __launch_bounds__(256) gdn_conv_rows(
    GDN_CONV_ROWS_PARAMS) {
    PDL_ENTRY();
    int head = blockIdx.x, t0 = blockIdx.y * GC_ROWS;
    int t1 = min(t0 + GC_ROWS, n);
    int conv_dim = 2 * hk * dk + hv * dk;
    if (head == 2 * hk + hv) {
        gdn_conv_gates(t0, t1, hv, bb, aa, dt_bias, ssm_a, beta_out, g_out);
        return;
    }
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    int nm = dk >> 5;
    for (int t = t0 + w; t < t1; t += 8) {
        float y[4];
#pragma unroll
        for (int m = 0; m < 4; ++m) {
            y[m] = 0.f;
            if (m < nm) {
                int ch = head * dk + 32 * m + lane;
                float xv = mixed[(size_t)t * conv_dim + ch];
                float acc = convw[ch * kconv + kconv - 1] * xv;
                for (int j = 0; j < kconv - 1; ++j) {
                    int tt = t - (kconv - 1) + j;  // input row of tap j (< 0: old window)
                    float xj = tt >= 0 ? mixed[(size_t)tt * conv_dim + ch] : conv_state[(tt + kconv - 1) * conv_dim + ch];
                    acc = fmaf(convw[ch * kconv + j], xj, acc);
                }
                y[m] = siluf_(acc);
            }
        }
        gdn_conv_row_out(y, t, head, hk, hv, dk, nm, lane, eps, qo, ko, vo);
    }
}

// gdn_conv_rows for 4 taps (the model's conv): warp w takes GC4_RW consecutive rows of the block's
// 8·GC4_RW, loads their inputs and the 3 rows before them at once (every input once per warp, all
// loads in flight together), then slides over them in registers. Same per-element operations and
// order as gdn_conv_rows (tap 3 as a product, taps 0..2 as fmas; the same L2-norm tree), so the
// same bits. grid (2·hk + hv + 1, ceil(n / (8·GC4_RW))), block 256.
#define GC4_RW 8
extern "C" __global__ void __launch_bounds__(256) gdn_conv_rows_k4(
    GDN_CONV_ROWS_PARAMS) {
    PDL_ENTRY();
    (void)kconv;  // 4
    int head = blockIdx.x, t0 = blockIdx.y * (8 * GC4_RW);
    int t1 = min(t0 + 8 * GC4_RW, n);
    int conv_dim = 2 * hk * dk + hv * dk;
    if (head == 2 * hk + hv) {
        gdn_conv_gates(t0, t1, hv, bb, aa, dt_bias, ssm_a, beta_out, g_out);
        return;
    }
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    int nm = dk >> 5;
    const int ta = t0 + w * GC4_RW, tb = min(ta + GC4_RW, t1);
    if (ta >= tb) return;  // warp-uniform
    float cw[4][4];               // [m][tap]
    float xw[GC4_RW + 3][4];      // [r][m]: input row ta - 3 + r (< 0: the old window)
#pragma unroll
    for (int m = 0; m < 4; ++m) {
        if (m >= nm) continue;
        const int ch = head * dk + 32 * m + lane;
#pragma unroll
        for (int j = 0; j < 4; ++j) cw[m][j] = convw[ch * 4 + j];
#pragma unroll
        for (int r = 0; r < GC4_RW + 3; ++r) {
            const int tt = ta - 3 + r;
            xw[r][m] = tt >= tb ? 0.f : tt >= 0 ? mixed[(size_t)tt * conv_dim + ch] : conv_state[(tt + 3) * conv_dim + ch];
        }
    }
#pragma unroll
    for (int r = 0; r < GC4_RW; ++r) {
        const int t = ta + r;
        if (t >= tb) break;
        float y[4];
#pragma unroll
        for (int m = 0; m < 4; ++m) {
            y[m] = 0.f;
            if (m < nm) {
                float acc = cw[m][3] * xw[r + 3][m];
                acc = fmaf(cw[m][0], xw[r][m], acc);
                acc = fmaf(cw[m][1], xw[r + 1][m], acc);
                acc = fmaf(cw[m][2], xw[r + 2][m], acc);
                y[m] = siluf_(acc);
            }
        }
        gdn_conv_row_out(y, t, head, hk, hv, dk, nm, lane, eps, qo, ko, vo);
    }
}

// The conv window after n rows: window[j] = X[n-k+1+j], X[t < 0] = old window[t + k-1]. One thread
// per channel reads its old window into registers before writing (k <= 8). Runs after
// gdn_conv_rows. grid ceil(conv_dim / 256), block 256.
extern "C" __global__ void gdn_conv_window(const float* __restrict__ mixed, float* conv_state, int conv_dim,
                                           int kconv, int n) {
    PDL_ENTRY();
    int ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= conv_dim) return;
    float old[7];
#pragma unroll
    for (int j = 0; j < 7; ++j) old[j] = j < kconv - 1 ? conv_state[j * conv_dim + ch] : 0.f;
#pragma unroll
    for (int j = 0; j < 7; ++j) {
        if (j < kconv - 1) {
            int tt = n - (kconv - 1) + j;
            float x = 0.f;
            if (tt >= 0) {
                x = mixed[(size_t)tt * conv_dim + ch];
            } else {
#pragma unroll
                for (int i = 0; i < 7; ++i)
                    if (i == tt + kconv - 1) x = old[i];
            }
            conv_state[j * conv_dim + ch] = x;
        }
    }
}

// ---- GDN recurrence over many rows --------------------------------------------------------------

// The gated delta rule of gdn_step over n rows (dk <= 128, dk % 32 == 0), equal within f32 rounding
// (not bit for bit: the sums run in a different order, and o is formed from the old state).
// grid (hv, dv / 16), block 128 (4 warps); warp w owns value columns j = 16·by + 4w + (lane >> 3),
// and the 8 lanes of a column split the key dim: lane ii = lane & 7 holds S[i, j] for
// i = 32m + 4ii + e (m < dk/32, e < 4) in registers for the whole launch. Per row, from the old
// state: u = Σ_i S k, a = Σ_i S q (lane partials, xor-tree over the 8 lanes of the column), then
//   δ = β (v − e^g u),  o = (e^g a + δ (k·q)) / √dk,  S ← e^g S + k δ
// (o = Σ_i S_new q expanded), so each row needs no block barrier. Rows come in tiles of GS_TR:
// k, q, v (the block's 16 columns), g, β of tile c+1 are copied to shared memory with cp.async
// while tile c runs (two buffers); k·q and e^g of a tile are computed once per tile.
//   S [hv, dk, dv]; q/k [n, hk, dk]; v [n, hv, dv]; g/beta [n, hv]; out [n, hv, dv].
#define GS_TR 16
// (cp_async4: kernels/gemm.cu)
// NMC: dk / 32 fixed at compile time (the 27B heads: 4), or 0 for any dk (read at run time).
template <int NMC>
__device__ __forceinline__ void gdn_step_seq_impl(float* S, const float* __restrict__ q, const float* __restrict__ k,
                                                  const float* __restrict__ v, const float* __restrict__ g,
                                                  const float* __restrict__ beta, int hk, int hv, int dk, int dv,
                                                  int n, float* out) {
    PDL_ENTRY();
    // with NMC the head dim is a compile-time constant: the tile copy's index divisions become
    // shifts (they were ~a quarter of the instructions per row)
    if (NMC) dk = 32 * NMC;
    __shared__ __align__(16) float ks[2][GS_TR][128];
    __shared__ __align__(16) float qs[2][GS_TR][128];
    __shared__ __align__(16) float vs[2][GS_TR][16];
    __shared__ float gs[2][GS_TR], bs[2][GS_TR], kq[GS_TR], dec[GS_TR];
    int h = blockIdx.x, tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    int ii = lane & 7, jl = w * 4 + (lane >> 3);
    int j0 = blockIdx.y * 16, j = j0 + jl;
    int kap = h % hk, nm = NMC ? NMC : dk >> 5;
    float* Sh = S + (size_t)h * dk * dv;
    float s[16];
#pragma unroll
    for (int m = 0; m < 4; ++m)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[4 * m + e] = m < nm ? Sh[(size_t)(32 * m + 4 * ii + e) * dv + j] : 0.f;
    float scale = 1.0f / sqrtf((float)dk);
    int ntile = (n + GS_TR - 1) / GS_TR;
    int cpr = dk >> 2;  // 16-byte chunks per k/q row
    // copy tile c into buffer c & 1 (rows past n clamp to n - 1: loaded, never used)
    auto issue = [&](int c) {
        int b = c & 1;
        for (int x = tid; x < 2 * GS_TR * cpr; x += 128) {
            int which = x / (GS_TR * cpr), rem = x % (GS_TR * cpr);
            int r = rem / cpr, cc = rem % cpr;
            int t = min(c * GS_TR + r, n - 1);
            const float* src = (which ? q : k) + ((size_t)t * hk + kap) * dk + 4 * cc;
            cp_async16(which ? &qs[b][r][4 * cc] : &ks[b][r][4 * cc], src);
        }
        if (tid < GS_TR * 4) {
            int r = tid >> 2, cc = tid & 3;
            int t = min(c * GS_TR + r, n - 1);
            cp_async16(&vs[b][r][4 * cc], v + ((size_t)t * hv + h) * dv + j0 + 4 * cc);
        } else if (tid < GS_TR * 5) {
            int r = tid - GS_TR * 4;
            int t = min(c * GS_TR + r, n - 1);
            cp_async4(&gs[b][r], g + (size_t)t * hv + h);
            cp_async4(&bs[b][r], beta + (size_t)t * hv + h);
        }
    };
    issue(0);
    cp_async_commit();
    for (int c = 0; c < ntile; ++c) {
        int b = c & 1;
        if (c + 1 < ntile) issue(c + 1);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        // per row of the tile: k·q (warp xor-tree) and the decay e^g
        for (int r = w; r < GS_TR; r += 4) {
            float p = 0.f;
            for (int i = lane; i < dk; i += 32) p = fmaf(ks[b][r][i], qs[b][r][i], p);
            p = warp_sum(p);
            if (lane == 0) {
                kq[r] = p;
                dec[r] = expf(gs[b][r]);
            }
        }
        __syncthreads();
        int rows = min(GS_TR, n - c * GS_TR);
        for (int r = 0; r < rows; ++r) {
            const float4* k4 = (const float4*)ks[b][r];
            const float4* q4 = (const float4*)qs[b][r];
            float kr[16], u0 = 0.f, u1 = 0.f, a0 = 0.f, a1 = 0.f;
#pragma unroll
            for (int m = 0; m < 4; ++m) {
                if (m < nm) {
                    float4 kk = k4[8 * m + ii], qq = q4[8 * m + ii];
                    kr[4 * m] = kk.x; kr[4 * m + 1] = kk.y; kr[4 * m + 2] = kk.z; kr[4 * m + 3] = kk.w;
                    u0 = fmaf(s[4 * m], kk.x, u0);
                    u1 = fmaf(s[4 * m + 1], kk.y, u1);
                    u0 = fmaf(s[4 * m + 2], kk.z, u0);
                    u1 = fmaf(s[4 * m + 3], kk.w, u1);
                    a0 = fmaf(s[4 * m], qq.x, a0);
                    a1 = fmaf(s[4 * m + 1], qq.y, a1);
                    a0 = fmaf(s[4 * m + 2], qq.z, a0);
                    a1 = fmaf(s[4 * m + 3], qq.w, a1);
                } else {
                    kr[4 * m] = kr[4 * m + 1] = kr[4 * m + 2] = kr[4 * m + 3] = 0.f;
                }
            }
            float u = u0 + u1, a = a0 + a1;
#pragma unroll
            for (int o = 1; o < 8; o <<= 1) {
                u += __shfl_xor_sync(0xffffffffu, u, o);
                a += __shfl_xor_sync(0xffffffffu, a, o);
            }
            float dcy = dec[r];
            float delta = bs[b][r] * (vs[b][r][jl] - dcy * u);
            float o = (dcy * a + delta * kq[r]) * scale;
#pragma unroll
            for (int x = 0; x < 16; ++x) s[x] = fmaf(kr[x], delta, s[x] * dcy);
            if (ii == 0) out[((size_t)(c * GS_TR + r) * hv + h) * dv + j] = o;
        }
        __syncthreads();  // buffer b is refilled by the next iteration's issue(c + 2)
    }
#pragma unroll
    for (int m = 0; m < 4; ++m)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            if (m < nm) Sh[(size_t)(32 * m + 4 * ii + e) * dv + j] = s[4 * m + e];
}
#define GS_ENTRY(NAME, NMC)                                                                             \
    extern "C" __global__ void __launch_bounds__(128)                                                   \
        NAME(float* S, const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v, \
             const float* __restrict__ g, const float* __restrict__ beta, int hk, int hv, int dk, int dv, \
             int n, float* out) {                                                                       \
        gdn_step_seq_impl<NMC>(S, q, k, v, g, beta, hk, hv, dk, dv, n, out);                             \
    }
GS_ENTRY(gdn_step_seq, 0)
GS_ENTRY(gdn_step_seq_d128, 4)

// ---- GDN recurrence over many rows, chunked (dk = dv = 128) -------------------------------------

// The recurrence of gdn_step_seq in chunks of GK_C = 64 rows, equal to it within f32 rounding (the
// sums run in another order). Within a chunk (local rows t, s; L_t = Σ_{r<=t} g_r, γ_t = e^{L_t}),
// the per-row update S_t = e^{g_t} S_{t-1} + k_t δ_tᵀ unrolls to
//   S_t = γ_t S0 + Σ_{s<=t} e^{L_t - L_s} k_s δ_sᵀ,   δ_t = β_t (v_t - e^{g_t} S_{t-1}ᵀ k_t),
// so the δ of a chunk solve one unit lower-triangular system (I + A) Δ = β ⊙ V - (β γ ⊙ K) S0 with
// A[t][s] = β_t e^{L_t - L_s} (k_t · k_s) for s < t. With T = (I + A)^-1:
//   U0 = T (β ⊙ V),  W = T (β γ ⊙ K)      (gdn_chunk_prep: every chunk in parallel)
//   Δ = U0 - W S0
//   O = (γ ⊙ (Q S0) + P Δ) / √dk,  P[t][s] = e^{L_t - L_s} (q_t · k_s) for s <= t
//   S ← γ_63 S0 + Σ_s e^{L_63 - L_s} k_s δ_sᵀ   (gdn_chunk_scan: chunks in order, value columns
//                                               in parallel)
// Rows past n are padded with g = β = 0 and k = q = v = 0: their δ is 0 and γ_63 = γ_{last row}.
// Exponents are always <= 0 (no overflow). Scratch per v-head h (npad = 64 ⌈n/64⌉ rows):
//   u0 [hv, npad, dv], wk [hv, npad, dk], pm [hv, nch, 64, 64], gam (γ_t) [hv, npad],
//   dl (e^{L_63 - L_t}) [hv, npad].
#define GK_C 64     // rows per chunk
#define GK_D 128    // dk = dv
#define GK_KST 132  // K / Q tile row stride (floats): 16-byte reads of 8 rows hit 32 banks
#define GK_AST 68   // A row stride (16-byte aligned rows)
#define GK_JS 16    // value columns per gdn_chunk_scan block
#define GK_WST 68   // W / Q half-tile row stride

// grid (hv, nch), block 256; dynamic shared memory (GDN_CHUNK_PREP_SMEM in lib.rs):
//   K [64][132] | Q [64][132] | A [64][68] | L [64] (f64) | γ [64] | β [64]
// L is summed in f64: the decay between rows s <= t is e^{L_t - L_s}, and with strong decays
// (|L| in the hundreds) an f32 prefix sum would lose that difference's low bits.
extern "C" __global__ void __launch_bounds__(256) gdn_chunk_prep_d128(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    const float* __restrict__ g, const float* __restrict__ beta, int hk, int hv, int n, float* __restrict__ u0,
    float* __restrict__ wk, float* __restrict__ pm, float* __restrict__ gam, float* __restrict__ dl) {
    PDL_ENTRY();
    extern __shared__ __align__(16) float gk_sm[];
    float* Ks = gk_sm;
    float* Qs = Ks + GK_C * GK_KST;
    float* As = Qs + GK_C * GK_KST;
    double* Ls = (double*)(As + GK_C * GK_AST);  // 8-byte aligned: the offset is 21248 floats
    float* Gs = (float*)(Ls + GK_C);
    float* Bs = Gs + GK_C;
    int h = blockIdx.x, c = blockIdx.y, nch = gridDim.y, tid = threadIdx.x;
    int kap = h % hk, t0 = c * GK_C, nr = min(GK_C, n - t0);
    size_t npad = (size_t)nch * GK_C;
    for (int x = tid; x < GK_C * (GK_D / 4); x += 256) {
        int r = x >> 5, c4 = (x & 31) * 4;
        float4 kk = make_float4(0.f, 0.f, 0.f, 0.f), qq = kk;
        if (r < nr) {
            size_t o = ((size_t)(t0 + r) * hk + kap) * GK_D + c4;
            kk = *(const float4*)(k + o);
            qq = *(const float4*)(q + o);
        }
        *(float4*)(Ks + r * GK_KST + c4) = kk;
        *(float4*)(Qs + r * GK_KST + c4) = qq;
    }
    if (tid < GK_C) {  // inclusive prefix sum of the log decay, per warp of 32 rows
        int lane = tid & 31;
        double x = tid < nr ? (double)g[(size_t)(t0 + tid) * hv + h] : 0.0;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            double y = __shfl_up_sync(0xffffffffu, x, o);
            if (lane >= o) x += y;
        }
        Ls[tid] = x;
        Bs[tid] = tid < nr ? beta[(size_t)(t0 + tid) * hv + h] : 0.f;
    }
    __syncthreads();
    if (tid < GK_C) {
        double x = Ls[tid] + (tid >= 32 ? Ls[31] : 0.0);
        __syncwarp();
        if (tid >= 32) Ls[tid] = x;
    }
    __syncthreads();
    if (tid < GK_C) Gs[tid] = expf((float)Ls[tid]);
    // k·k and q·k over the chunk: thread (tr, tc) takes rows tr + 16x, columns tc + 16y
    int tr = tid >> 4, tc = tid & 15;
    float kk[4][4], qk[4][4];
#pragma unroll
    for (int x = 0; x < 4; ++x)
#pragma unroll
        for (int y = 0; y < 4; ++y) kk[x][y] = qk[x][y] = 0.f;
#pragma unroll 2
    for (int i = 0; i < GK_D; i += 4) {
        float4 a[4], b[4], cc[4];
#pragma unroll
        for (int m = 0; m < 4; ++m) {
            a[m] = *(const float4*)(Ks + (tr + 16 * m) * GK_KST + i);
            b[m] = *(const float4*)(Qs + (tr + 16 * m) * GK_KST + i);
            cc[m] = *(const float4*)(Ks + (tc + 16 * m) * GK_KST + i);
        }
#pragma unroll
        for (int x = 0; x < 4; ++x)
#pragma unroll
            for (int y = 0; y < 4; ++y) {
                kk[x][y] = fmaf(a[x].x, cc[y].x, kk[x][y]);
                kk[x][y] = fmaf(a[x].y, cc[y].y, kk[x][y]);
                kk[x][y] = fmaf(a[x].z, cc[y].z, kk[x][y]);
                kk[x][y] = fmaf(a[x].w, cc[y].w, kk[x][y]);
                qk[x][y] = fmaf(b[x].x, cc[y].x, qk[x][y]);
                qk[x][y] = fmaf(b[x].y, cc[y].y, qk[x][y]);
                qk[x][y] = fmaf(b[x].z, cc[y].z, qk[x][y]);
                qk[x][y] = fmaf(b[x].w, cc[y].w, qk[x][y]);
            }
    }
    float* Pc = pm + ((size_t)h * nch + c) * GK_C * GK_C;
#pragma unroll
    for (int x = 0; x < 4; ++x)
#pragma unroll
        for (int y = 0; y < 4; ++y) {
            int t = tr + 16 * x, s = tc + 16 * y;
            float e = s <= t ? expf((float)(Ls[t] - Ls[s])) : 0.f;
            As[t * GK_AST + s] = s < t ? Bs[t] * e * kk[x][y] : 0.f;
            Pc[t * GK_C + s] = e * qk[x][y];
        }
    __syncthreads();
    // forward substitution, one right-hand column per thread: columns 0..127 are β ⊙ V (→ U0),
    // 128..255 β γ ⊙ K (→ W); the column lives in registers
    float xr[GK_C];
    int j = tid & (GK_D - 1);
    if (tid < GK_D) {
#pragma unroll
        for (int t = 0; t < GK_C; ++t)
            xr[t] = t < nr ? Bs[t] * v[((size_t)(t0 + t) * hv + h) * GK_D + j] : 0.f;
    } else {
#pragma unroll
        for (int t = 0; t < GK_C; ++t) xr[t] = Bs[t] * Gs[t] * Ks[t * GK_KST + j];
    }
#pragma unroll
    for (int t = 1; t < GK_C; ++t) {
        const float* Ar = As + t * GK_AST;
        float a0 = xr[t], a1 = 0.f;
#pragma unroll
        for (int s = 0; s < t; s += 4) {
            float4 av = *(const float4*)(Ar + s);
            a0 = fmaf(-av.x, xr[s], a0);
            if (s + 1 < t) a1 = fmaf(-av.y, xr[s + 1], a1);
            if (s + 2 < t) a0 = fmaf(-av.z, xr[s + 2], a0);
            if (s + 3 < t) a1 = fmaf(-av.w, xr[s + 3], a1);
        }
        xr[t] = a0 + a1;
    }
    float* dst = (tid < GK_D ? u0 : wk) + ((size_t)h * npad + t0) * GK_D + j;
#pragma unroll
    for (int t = 0; t < GK_C; ++t) dst[(size_t)t * GK_D] = xr[t];
    if (tid < GK_C) {
        gam[h * npad + t0 + tid] = Gs[tid];
        dl[h * npad + t0 + tid] = expf((float)(Ls[GK_C - 1] - Ls[tid]));
    }
}

// Shared pieces of the two chunk walks (NT threads per block).
// The block's state columns j0..j0+15 of head h: global S [dk, dv] <-> shared [128][sst].
template <int NT>
__device__ __forceinline__ void gk_state_load(float* Ss, int sst, const float* Sh, int j0) {
    for (int x = threadIdx.x; x < GK_D * GK_JS / 4; x += NT) {
        int i = x >> 2, cc = (x & 3) * 4;
        *(float4*)(Ss + i * sst + cc) = *(const float4*)(Sh + (size_t)i * GK_D + j0 + cc);
    }
}
template <int NT>
__device__ __forceinline__ void gk_state_store(const float* Ss, int sst, float* Sh, int j0) {
    for (int x = threadIdx.x; x < GK_D * GK_JS / 4; x += NT) {
        int i = x >> 2, cc = (x & 3) * 4;
        *(float4*)(Sh + (size_t)i * GK_D + j0 + cc) = *(const float4*)(Ss + i * sst + cc);
    }
}
// One 64-key half of the [W; Q] tile at row stride GK_WST: rows 0..63 the chunk's W rows (from
// row `wrow0` of wk), rows 64..127 its q rows (zero past nr); a W row and a q row per step. The
// tensor-core walk fills the same layout one row per step: with this loop ptxas spills there.
template <int NT>
__device__ __forceinline__ void gk_fill_wq_half(float* X, const float* __restrict__ wk, const float* __restrict__ q,
                                                size_t wrow0, int t0, int nr, int hk, int kap, int half) {
    for (int x = threadIdx.x; x < GK_C * 16; x += NT) {
        int r = x >> 4, cc = (x & 15) * 4, i = half * 64 + cc;
        float4 wv = *(const float4*)(wk + (wrow0 + r) * GK_D + i);
        float4 qv = make_float4(0.f, 0.f, 0.f, 0.f);
        if (r < nr) qv = *(const float4*)(q + ((size_t)(t0 + r) * hk + kap) * GK_D + i);
        *(float4*)(X + r * GK_WST + cc) = wv;
        *(float4*)(X + (GK_C + r) * GK_WST + cc) = qv;
    }
}
// The chunk's k rows at row stride kst (zero past nr).
template <int NT>
__device__ __forceinline__ void gk_fill_k(float* K, int kst, const float* __restrict__ k, int t0, int nr, int hk,
                                          int kap) {
    for (int x = threadIdx.x; x < GK_C * (GK_D / 4); x += NT) {
        int r = x >> 5, cc = (x & 31) * 4;
        float4 kv = make_float4(0.f, 0.f, 0.f, 0.f);
        if (r < nr) kv = *(const float4*)(k + ((size_t)(t0 + r) * hk + kap) * GK_D + cc);
        *(float4*)(K + r * kst + cc) = kv;
    }
}

// grid (hv, dv / 16), block 256; dynamic shared memory (GDN_CHUNK_SCAN_SMEM in lib.rs):
//   S [128][16] (the block's state columns) | W, Q half tiles [2][64][68] (then K [64][132]) |
//   Δ [64][16] | Δ scaled to the chunk end [64][16]
// Per chunk: thread (t = tid / 4, 4 columns) forms row t of W S0 and Q S0 over two 64-key halves,
// then Δ and O; then thread (key si = tid / 2, 8 columns) updates its state entries.
// The parameters of both chunk walks (the FP32 one and the tensor-core one).
#define GK_SCAN_PARAMS                                                                                  \
    float* S, const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ u0, \
        const float* __restrict__ wk, const float* __restrict__ pm, const float* __restrict__ gam,     \
        const float* __restrict__ dl, int hk, int hv, int n, float* out
extern "C" __global__ void __launch_bounds__(256) gdn_chunk_scan_d128(
    GK_SCAN_PARAMS) {
    PDL_ENTRY();
    extern __shared__ __align__(16) float gk_sm[];
    float* Ss = gk_sm;
    float* WQ = Ss + GK_D * GK_JS;
    float* Ds = WQ + 2 * GK_C * GK_WST;
    float* Dts = Ds + GK_C * GK_JS;
    int h = blockIdx.x, j0 = blockIdx.y * GK_JS, tid = threadIdx.x;
    int kap = h % hk, nch = (n + GK_C - 1) / GK_C;
    size_t npad = (size_t)nch * GK_C;
    float* Sh = S + (size_t)h * GK_D * GK_D;
    gk_state_load<256>(Ss, GK_JS, Sh, j0);
    int t = tid >> 2, c4 = (tid & 3) * 4;
    int si = tid >> 1, c8 = (tid & 1) * 8;
    float scale = 1.0f / sqrtf((float)GK_D);
    for (int c = 0; c < nch; ++c) {
        int t0 = c * GK_C, nr = min(GK_C, n - t0);
        float aw[4] = {0.f, 0.f, 0.f, 0.f}, aq[4] = {0.f, 0.f, 0.f, 0.f};
        for (int half = 0; half < 2; ++half) {
            __syncthreads();  // Ss written, WQ / K tile of the last pass read
            gk_fill_wq_half<256>(WQ, wk, q, (size_t)h * npad + t0, t0, nr, hk, kap, half);
            __syncthreads();
#pragma unroll 4
            for (int i = 0; i < 64; i += 4) {
                float4 w4 = *(const float4*)(WQ + t * GK_WST + i);
                float4 q4 = *(const float4*)(WQ + (GK_C + t) * GK_WST + i);
                float wv[4] = {w4.x, w4.y, w4.z, w4.w}, qv[4] = {q4.x, q4.y, q4.z, q4.w};
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    float4 s4 = *(const float4*)(Ss + (half * 64 + i + e) * GK_JS + c4);
                    aw[0] = fmaf(wv[e], s4.x, aw[0]);
                    aw[1] = fmaf(wv[e], s4.y, aw[1]);
                    aw[2] = fmaf(wv[e], s4.z, aw[2]);
                    aw[3] = fmaf(wv[e], s4.w, aw[3]);
                    aq[0] = fmaf(qv[e], s4.x, aq[0]);
                    aq[1] = fmaf(qv[e], s4.y, aq[1]);
                    aq[2] = fmaf(qv[e], s4.z, aq[2]);
                    aq[3] = fmaf(qv[e], s4.w, aq[3]);
                }
            }
        }
        __syncthreads();  // WQ read: the K tile takes its place
        float4 uv = *(const float4*)(u0 + ((size_t)h * npad + t0 + t) * GK_D + j0 + c4);
        float d[4] = {uv.x - aw[0], uv.y - aw[1], uv.z - aw[2], uv.w - aw[3]};
        float dlt = dl[h * npad + t0 + t];
        *(float4*)(Ds + t * GK_JS + c4) = make_float4(d[0], d[1], d[2], d[3]);
        *(float4*)(Dts + t * GK_JS + c4) = make_float4(dlt * d[0], dlt * d[1], dlt * d[2], dlt * d[3]);
        float* Ksm = WQ;
        gk_fill_k<256>(Ksm, GK_KST, k, t0, nr, hk, kap);
        __syncthreads();
        // O = (γ ⊙ Q S0 + P Δ) / √dk; P[t][s] = 0 for s > t
        float gt = gam[h * npad + t0 + t];
        float o[4] = {gt * aq[0], gt * aq[1], gt * aq[2], gt * aq[3]};
        const float* Pr = pm + (((size_t)h * nch + c) * GK_C + t) * GK_C;
        for (int s = 0; s <= t; s += 4) {
            float4 p4 = *(const float4*)(Pr + s);
            float pv[4] = {p4.x, p4.y, p4.z, p4.w};
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float4 d4 = *(const float4*)(Ds + (s + e) * GK_JS + c4);
                o[0] = fmaf(pv[e], d4.x, o[0]);
                o[1] = fmaf(pv[e], d4.y, o[1]);
                o[2] = fmaf(pv[e], d4.z, o[2]);
                o[3] = fmaf(pv[e], d4.w, o[3]);
            }
        }
        if (t < nr)
            *(float4*)(out + ((size_t)(t0 + t) * hv + h) * GK_D + j0 + c4) =
                make_float4(o[0] * scale, o[1] * scale, o[2] * scale, o[3] * scale);
        // S ← γ_63 S0 + Kᵀ Δ̃
        float gl = gam[h * npad + t0 + GK_C - 1];
        float sn[8];
#pragma unroll
        for (int x = 0; x < 8; ++x) sn[x] = gl * Ss[si * GK_JS + c8 + x];
#pragma unroll 4
        for (int s = 0; s < GK_C; ++s) {
            float kv = Ksm[s * GK_KST + si];
            float4 d0 = *(const float4*)(Dts + s * GK_JS + c8);
            float4 d1 = *(const float4*)(Dts + s * GK_JS + c8 + 4);
            sn[0] = fmaf(kv, d0.x, sn[0]);
            sn[1] = fmaf(kv, d0.y, sn[1]);
            sn[2] = fmaf(kv, d0.z, sn[2]);
            sn[3] = fmaf(kv, d0.w, sn[3]);
            sn[4] = fmaf(kv, d1.x, sn[4]);
            sn[5] = fmaf(kv, d1.y, sn[5]);
            sn[6] = fmaf(kv, d1.z, sn[6]);
            sn[7] = fmaf(kv, d1.w, sn[7]);
        }
#pragma unroll
        for (int x = 0; x < 8; ++x) Ss[si * GK_JS + c8 + x] = sn[x];
    }
    __syncthreads();
    gk_state_store<256>(Ss, GK_JS, Sh, j0);
}

// ---- the chunk walk on tensor cores (3xTF32) — opt-in: as accurate as the FP32 walk, no faster --------

// gdn_chunk_scan_d128's three products per chunk on mma.m16n8k8 TF32 with the 3xTF32 split
// (x = hi + lo, hi = tf32(x), lo = tf32(x - hi); D += lo·hi + hi·lo + hi·hi: products near f32).
// Fragments (g = lane / 4, q = lane % 4): A a0 (g, q), a1 (g+8, q), a2 (g, q+4), a3 (g+8, q+4);
// B b0 (k q, n g), b1 (k q+4, n g); C c0 (g, 2q), c1 (g, 2q+1), c2 (g+8, 2q), c3 (g+8, 2q+1).
// grid (hv, dv / 16), block 128 (4 warps); dynamic shared memory (GDN_CHUNK_TC_SMEM in lib.rs):
//   S [128][24] | [W; Q] half tile [128][68] (then the K tile [64][136]) | Δ [64][24] | Δ̃ [64][24]
// Per chunk: [W; Q] S with warp w on rows 32w..32w+31 (2 m-tiles × 2 n-tiles); warps 0-1 then
// write Δ = U0 - W S (and Δ̃ = Δ e^{L_63 - L_t}) and form S ← γ_63 S + Kᵀ Δ̃ on keys 64w..64w+63;
// warps 2-3 form O = (γ ⊙ Q S + P Δ) / √dk from their accumulators (P from global, k-steps past
// the m-tile's diagonal skipped). Strides: every fragment load hits 32 distinct banks
// (68: 4g + q; 24: 24q + g; 136: 8q + g, mod 32). `gdn_chunk_emu.rs` replays the indexing.
#define GT_SST 24   // S / Δ / Δ̃ row stride
#define GT_XST 68   // [W; Q] half-tile row stride
#define GT_KST 136  // K tile row stride
__device__ __forceinline__ u32 tf32_rna(float x) {
    u32 r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}
__device__ __forceinline__ void mma_tf32(float* c, const u32* a, const u32* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// c += a · b in 3xTF32 (a: 4 A-fragment values, b: 2 B-fragment values, f32)
__device__ __forceinline__ void mma_3xtf32(float* c, const float* a, const float* b) {
    u32 ah[4], al[4], bh[2], bl[2];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        ah[i] = tf32_rna(a[i]);
        al[i] = tf32_rna(a[i] - __uint_as_float(ah[i]));
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        bh[i] = tf32_rna(b[i]);
        bl[i] = tf32_rna(b[i] - __uint_as_float(bh[i]));
    }
    mma_tf32(c, al, bh);
    mma_tf32(c, ah, bl);
    mma_tf32(c, ah, bh);
}
extern "C" __global__ void __launch_bounds__(128) gdn_chunk_scan_tc_d128(
    GK_SCAN_PARAMS) {
    PDL_ENTRY();
    extern __shared__ __align__(16) float gk_sm[];
    float* Ss = gk_sm;
    float* Xs = Ss + GK_D * GT_SST;
    float* Ds = Xs + 2 * GK_C * GT_XST;
    float* Dts = Ds + GK_C * GT_SST;
    int h = blockIdx.x, j0 = blockIdx.y * GK_JS, tid = threadIdx.x;
    int lane = tid & 31, w = tid >> 5, g = lane >> 2, qd = lane & 3;
    int kap = h % hk, nch = (n + GK_C - 1) / GK_C;
    size_t npad = (size_t)nch * GK_C;
    float* Sh = S + (size_t)h * GK_D * GK_D;
    gk_state_load<128>(Ss, GT_SST, Sh, j0);
    float scale = 1.0f / sqrtf((float)GK_D);
    for (int c = 0; c < nch; ++c) {
        int t0 = c * GK_C, nr = min(GK_C, n - t0);
        float acc[2][2][4];  // [m-tile][n-tile][fragment]: rows 32w + 16mt of [W; Q] S
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.f;
        for (int half = 0; half < 2; ++half) {
            __syncthreads();  // Ss written, the last tile (or K tile) read
            for (int x = tid; x < 2 * GK_C * 16; x += 128) {
                int r = x >> 4, cc = (x & 15) * 4, i = half * 64 + cc;
                float4 xv = make_float4(0.f, 0.f, 0.f, 0.f);
                if (r < GK_C)
                    xv = *(const float4*)(wk + ((size_t)h * npad + t0 + r) * GK_D + i);
                else if (r - GK_C < nr)
                    xv = *(const float4*)(q + ((size_t)(t0 + r - GK_C) * hk + kap) * GK_D + i);
                *(float4*)(Xs + r * GT_XST + cc) = xv;
            }
            __syncthreads();
#pragma unroll 2
            for (int ks = 0; ks < 8; ++ks) {
                float bf[2][2];
#pragma unroll
                for (int nt = 0; nt < 2; ++nt) {
                    bf[nt][0] = Ss[(half * 64 + 8 * ks + qd) * GT_SST + 8 * nt + g];
                    bf[nt][1] = Ss[(half * 64 + 8 * ks + qd + 4) * GT_SST + 8 * nt + g];
                }
#pragma unroll
                for (int mt = 0; mt < 2; ++mt) {
                    const float* xr = Xs + (32 * w + 16 * mt + g) * GT_XST + 8 * ks + qd;
                    float af[4] = {xr[0], xr[8 * GT_XST], xr[4], xr[8 * GT_XST + 4]};
#pragma unroll
                    for (int nt = 0; nt < 2; ++nt) mma_3xtf32(acc[mt][nt], af, bf[nt]);
                }
            }
        }
        __syncthreads();  // the half tile read: the K tile takes its place
        if (w < 2) {
            // Δ = U0 - W S for rows 32w + 16mt + g (+8), columns 8nt + 2qd (+1)
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    int t = 32 * w + 16 * mt + g + 8 * hh;
                    float dlt = dl[h * npad + t0 + t];
#pragma unroll
                    for (int nt = 0; nt < 2; ++nt) {
                        int col = 8 * nt + 2 * qd;
                        float2 uv = *(const float2*)(u0 + ((size_t)h * npad + t0 + t) * GK_D + j0 + col);
                        float d0 = uv.x - acc[mt][nt][2 * hh], d1 = uv.y - acc[mt][nt][2 * hh + 1];
                        *(float2*)(Ds + t * GT_SST + col) = make_float2(d0, d1);
                        *(float2*)(Dts + t * GT_SST + col) = make_float2(dlt * d0, dlt * d1);
                    }
                }
        }
        float* Ksm = Xs;
        gk_fill_k<128>(Ksm, GT_KST, k, t0, nr, hk, kap);
        __syncthreads();
        if (w >= 2) {
            // O = (γ ⊙ Q S + P Δ) / √dk for Q rows 32(w-2) + 16mt + g (+8)
            const float* Pc = pm + ((size_t)h * nch + c) * GK_C * GK_C;
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
                int r0 = 32 * (w - 2) + 16 * mt;
                float ga = gam[h * npad + t0 + r0 + g], gb = gam[h * npad + t0 + r0 + g + 8];
#pragma unroll
                for (int nt = 0; nt < 2; ++nt) {
                    acc[mt][nt][0] *= ga;
                    acc[mt][nt][1] *= ga;
                    acc[mt][nt][2] *= gb;
                    acc[mt][nt][3] *= gb;
                }
                for (int ks = 0; 8 * ks <= r0 + 15; ++ks) {  // P[t][s] = 0 for s > t
                    const float* pr = Pc + (size_t)(r0 + g) * GK_C + 8 * ks + qd;
                    float af[4] = {pr[0], pr[8 * GK_C], pr[4], pr[8 * GK_C + 4]};
#pragma unroll
                    for (int nt = 0; nt < 2; ++nt) {
                        float bf[2] = {Ds[(8 * ks + qd) * GT_SST + 8 * nt + g], Ds[(8 * ks + qd + 4) * GT_SST + 8 * nt + g]};
                        mma_3xtf32(acc[mt][nt], af, bf);
                    }
                }
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    int t = r0 + g + 8 * hh;
                    if (t < nr) {
#pragma unroll
                        for (int nt = 0; nt < 2; ++nt)
                            *(float2*)(out + ((size_t)(t0 + t) * hv + h) * GK_D + j0 + 8 * nt + 2 * qd) =
                                make_float2(acc[mt][nt][2 * hh] * scale, acc[mt][nt][2 * hh + 1] * scale);
                    }
                }
            }
        } else {
            // S ← γ_63 S + Kᵀ Δ̃ for keys 64w + 16mt + g (+8)
            float gl = gam[h * npad + t0 + GK_C - 1];
#pragma unroll
            for (int mt = 0; mt < 4; ++mt) {
                int i0 = 64 * w + 16 * mt;
                float sn[2][4];
#pragma unroll
                for (int nt = 0; nt < 2; ++nt) {
                    int col = 8 * nt + 2 * qd;
                    sn[nt][0] = gl * Ss[(i0 + g) * GT_SST + col];
                    sn[nt][1] = gl * Ss[(i0 + g) * GT_SST + col + 1];
                    sn[nt][2] = gl * Ss[(i0 + g + 8) * GT_SST + col];
                    sn[nt][3] = gl * Ss[(i0 + g + 8) * GT_SST + col + 1];
                }
#pragma unroll 2
                for (int ks = 0; ks < 8; ++ks) {
                    const float* kr = Ksm + (8 * ks + qd) * GT_KST + i0 + g;
                    float af[4] = {kr[0], kr[8], kr[4 * GT_KST], kr[4 * GT_KST + 8]};
#pragma unroll
                    for (int nt = 0; nt < 2; ++nt) {
                        float bf[2] = {Dts[(8 * ks + qd) * GT_SST + 8 * nt + g], Dts[(8 * ks + qd + 4) * GT_SST + 8 * nt + g]};
                        mma_3xtf32(sn[nt], af, bf);
                    }
                }
#pragma unroll
                for (int nt = 0; nt < 2; ++nt) {
                    int col = 8 * nt + 2 * qd;
                    *(float2*)(Ss + (i0 + g) * GT_SST + col) = make_float2(sn[nt][0], sn[nt][1]);
                    *(float2*)(Ss + (i0 + g + 8) * GT_SST + col) = make_float2(sn[nt][2], sn[nt][3]);
                }
            }
        }
    }
    __syncthreads();
    gk_state_store<128>(Ss, GT_SST, Sh, j0);
}

// ---- causal prefill attention -------------------------------------------------------------------

// Flash attention on CUDA cores for n > MAXN query rows (f32 math, f16 K/V cache). Row t (position
// *pos0 + t) attends to positions 0..*pos0 + t; q head h uses kv head h / (nh / nkv). Then
// ⊙ σ(gate), written f32 (out, may be null) and int8-quantized exactly as attn_merge_quant does
// (quant32 over each 32-block of the output row). Equal to attn_decode within f32 rounding.
// grid (nh, ceil(n / AP_BQ)), block 128 (4 warps); dynamic shared memory (ap_smem_bytes):
//   Q [AP_BQ][HD] f32 | K [AP_BK][HD + 8] f16 (padded: conflict-free row reads) |
//   V [AP_BK][HD] f16 | P [AP_BK][AP_PST] f32 (key-major: a key's 8 rows of a warp are one float4 pair)
// Warp w owns query rows 8w..8w+7 of the tile. Per key tile of AP_BK = 32 positions: lane p scores
// key p against the warp's 8 rows (K row from shared memory, Q rows broadcast), an online softmax
// per row (warp max / sum), P to shared memory (warp-private columns), then lane l accumulates
// output dims l·EPL..l·EPL+EPL-1 of the 8 rows over the 32 keys. K and V tiles are double-staged with
// cp.async: V of tile i loads during the scores of tile i, K of tile i+1 during its P·V.
// Keys at or past L = *pos0 + n are masked and their loads clamped to L - 1 (always written).
#define AP_BQ 32
#define AP_BK 32
#define AP_PST (AP_BQ + 4)  // P row stride: 16-byte rows, 4-way (not 32-way) conflicts on writes
template <int HD>
__device__ __forceinline__ void attn_prefill_body(const float* __restrict__ qo, const float* __restrict__ qf,
                                                  const u16* __restrict__ kc, const u16* __restrict__ vc,
                                                  int n, int nh, int nkv, const int* pos0, float* out, i8* q8,
                                                  float* d8, int* s8) {
    const int EPL = HD / 32, KST = HD + 8;
    extern __shared__ __align__(16) unsigned char ap_smem[];
    float* Qs = (float*)ap_smem;
    u16* Ks = (u16*)(Qs + AP_BQ * HD);
    u16* Vs = Ks + AP_BK * KST;
    float* Ps = (float*)(Vs + AP_BK * HD);
    int h = blockIdx.x, t0 = blockIdx.y * AP_BQ;
    int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    int p0 = *pos0;
    int L = p0 + n;                          // keys 0..L-1 exist
    int Lt = p0 + min(t0 + AP_BQ, n);        // keys this tile needs
    int nkt = (Lt + AP_BK - 1) / AP_BK;
    int g = h / (nh / nkv), kvw = nkv * HD;
    float scale = 1.0f / sqrtf((float)HD);
    // Q tile (rows past n: zeros, never stored)
    for (int x = tid; x < AP_BQ * HD / 4; x += 128) {
        int r = x / (HD / 4), c4 = x % (HD / 4);
        float4 val;
        val.x = val.y = val.z = val.w = 0.f;
        if (t0 + r < n) val = *(const float4*)(qo + ((size_t)(t0 + r) * nh + h) * HD + 4 * c4);
        *(float4*)(Qs + r * HD + 4 * c4) = val;
    }
    const int CPR = HD / 8;  // 16-byte chunks per K/V row
    auto issue_k = [&](int kt) {
        for (int x = tid; x < AP_BK * CPR; x += 128) {
            int r = x / CPR, cc = x % CPR;
            int p = min(kt * AP_BK + r, L - 1);
            cp_async16(Ks + r * KST + 8 * cc, kc + (size_t)p * kvw + g * HD + 8 * cc);
        }
    };
    auto issue_v = [&](int kt) {
        for (int x = tid; x < AP_BK * CPR; x += 128) {
            int r = x / CPR, cc = x % CPR;
            int p = min(kt * AP_BK + r, L - 1);
            cp_async16(Vs + r * HD + 8 * cc, vc + (size_t)p * kvw + g * HD + 8 * cc);
        }
    };
    float m[8], l[8], acc[8][EPL];
#pragma unroll
    for (int r = 0; r < 8; ++r) {
        m[r] = NEG_INF;
        l[r] = 0.f;
#pragma unroll
        for (int e = 0; e < EPL; ++e) acc[r][e] = 0.f;
    }
    issue_k(0);
    cp_async_commit();
    issue_v(0);
    cp_async_commit();
    for (int kt = 0; kt < nkt; ++kt) {
        cp_async_wait<1>();  // K of tile kt
        __syncthreads();
        // scores: lane = key p, the warp's 8 rows
        float sc[8];
#pragma unroll
        for (int r = 0; r < 8; ++r) sc[r] = 0.f;
        const u16* kr = Ks + lane * KST;
#pragma unroll 2
        for (int d0 = 0; d0 < HD; d0 += 8) {
            uint4 kw = *(const uint4*)(kr + d0);
            float kf[8] = {lo_h(kw.x), hi_h(kw.x), lo_h(kw.y), hi_h(kw.y),
                           lo_h(kw.z), hi_h(kw.z), lo_h(kw.w), hi_h(kw.w)};
#pragma unroll
            for (int r = 0; r < 8; ++r) {
                const float4* qr = (const float4*)(Qs + (8 * w + r) * HD + d0);
                float4 qa = qr[0], qb = qr[1];
                float a = sc[r];
                a = fmaf(qa.x, kf[0], a);
                a = fmaf(qa.y, kf[1], a);
                a = fmaf(qa.z, kf[2], a);
                a = fmaf(qa.w, kf[3], a);
                a = fmaf(qb.x, kf[4], a);
                a = fmaf(qb.y, kf[5], a);
                a = fmaf(qb.z, kf[6], a);
                a = fmaf(qb.w, kf[7], a);
                sc[r] = a;
            }
        }
        int pk = kt * AP_BK + lane;  // this lane's key position
        float corr[8];
#pragma unroll
        for (int r = 0; r < 8; ++r) {
            int prow = p0 + t0 + 8 * w + r;  // the row's position
            float sv = (pk <= prow && pk < L) ? sc[r] * scale : NEG_INF;
            float mn = fmaxf(m[r], warp_max(sv));  // finite: key 0 is in tile 0 for every row
            corr[r] = expf(m[r] - mn);
            float pe = expf(sv - mn);
            l[r] = fmaf(l[r], corr[r], warp_sum(pe));
            m[r] = mn;
            Ps[lane * AP_PST + 8 * w + r] = pe;
        }
        __syncthreads();  // every warp is done with K
        if (kt + 1 < nkt) issue_k(kt + 1);
        cp_async_commit();
        cp_async_wait<1>();  // V of tile kt
        __syncthreads();
#pragma unroll
        for (int r = 0; r < 8; ++r)
#pragma unroll
            for (int e = 0; e < EPL; ++e) acc[r][e] *= corr[r];
#pragma unroll 4
        for (int p = 0; p < AP_BK; ++p) {
            u32 vw[EPL / 2];
            ld_h<EPL>(Vs + p * HD + lane * EPL, vw);
            float vf[EPL];
#pragma unroll
            for (int e = 0; e < EPL / 2; ++e) {
                vf[2 * e] = lo_h(vw[e]);
                vf[2 * e + 1] = hi_h(vw[e]);
            }
            const float4* pp = (const float4*)(Ps + p * AP_PST + 8 * w);
            float4 pa = pp[0], pb = pp[1];
            float pr[8] = {pa.x, pa.y, pa.z, pa.w, pb.x, pb.y, pb.z, pb.w};
#pragma unroll
            for (int r = 0; r < 8; ++r)
#pragma unroll
                for (int e = 0; e < EPL; ++e) acc[r][e] = fmaf(pr[r], vf[e], acc[r][e]);
        }
        __syncthreads();  // every warp is done with V and P
        if (kt + 1 < nkt) issue_v(kt + 1);
        cp_async_commit();
    }
    // normalize, gate, stage the tile's output rows in Qs, then quantize per 32-block
#pragma unroll
    for (int r = 0; r < 8; ++r) {
        int row = 8 * w + r, t = t0 + row;
#pragma unroll
        for (int e = 0; e < EPL; ++e) {
            int jd = lane * EPL + e;
            float y = 0.f;
            if (t < n) {
                float gate = qf[((size_t)t * nh + h) * 2 * HD + HD + jd];
                y = acc[r][e] / l[r] * sigmoidf_(gate);
            }
            Qs[row * HD + jd] = y;
        }
    }
    __syncthreads();
    for (int bi = w; bi < AP_BQ * (HD / 32); bi += 4) {
        int row = bi / (HD / 32), blk = bi % (HD / 32), t = t0 + row;
        if (t >= n) continue;  // warp-uniform
        float y = Qs[row * HD + 32 * blk + lane];
        size_t idx = ((size_t)t * nh + h) * HD + 32 * blk + lane;
        if (out) out[idx] = y;
        size_t b = idx >> 5;
        quant32(y, q8 + (b << 5), d8 + b, s8 + b);
    }
}

// ---- causal prefill attention on tensor cores -------------------------------------------------
//
// The same attention as attn_prefill_body (row t at position *pos0 + t attends to 0..*pos0 + t;
// online softmax with expf; O / l ⊙ σ(gate); quant32 per 32-block) with both products on
// mma.m16n8k16 (f16 in, f32 accumulate) in a two-term split that keeps f32 accuracy: K and V are
// f16 already (exact operands); Q and P are split into hi = f16(x) and lo = f16(x − hi), and every
// product runs as hi·B + lo·B (the dropped lo·lo-style error is ~2^-22 relative).
// CTA = 4 warps, AT_BQ = 64 query rows (warp w: rows 16w..16w+15, one m16 tile), key tiles of
// AT_BK = 32 positions aligned to position 0. Per key tile a warp computes S = Q·Kᵀ (16 × 32, C
// fragments in registers), masks and exponentiates it, and feeds P straight from the C layout as
// the A fragments of O += P·V (FA2's register reuse), O being 16 × HD f32 per warp in registers.
// A warp skips a key tile that is masked for all its 16 rows, and the O rescale when no row's
// maximum moved (exact no-ops: corr = 1, P = 0), so a row's arithmetic depends only on its own
// position: a launch split at any row gives the same bits. Row tiles run heaviest (most keys)
// first. Shared memory (f16 rows padded to ST = HD + 8: conflict-free ldmatrix):
//   Qh, Ql [AT_BQ][ST] | K [AT_BK][ST] | V [AT_BK][ST]; the output rows are staged as f32
//   [AT_BQ][HD] over Qh/Ql at the end.
// K of tile i+1 loads during P·V of tile i, V of tile i during its scores (cp.async); key loads
// past L = *pos0 + n are clamped to L − 1 (finite: P·V never meets a NaN). src/attn_tc_emu.rs
// replays this kernel lane by lane on the host.
// grid (nh, ceil(n / AT_BQ)), block 128, AT_SMEM(HD) bytes (attn_prefill_tc_smem on the host).
#define AT_BQ 64
#define AT_BK 32
#define AT_SMEM(HD) ((2 * AT_BQ + 2 * AT_BK) * ((HD) + 8) * 2)
__device__ __forceinline__ void ldsm_x4_t(u32* r, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}
// f32 pair -> (hi, lo) f16x2 pairs with hi + lo == the pair to ~2^-22
__device__ __forceinline__ void split_h2(float x0, float x1, u32& hi, u32& lo) {
    hi = pack_h2(x0, x1);
    lo = pack_h2(x0 - lo_h(hi), x1 - hi_h(hi));
}
template <int HD>
__device__ __forceinline__ void attn_prefill_tc_body(const float* __restrict__ qo, const float* __restrict__ qf,
                                                     const u16* __restrict__ kc, const u16* __restrict__ vc, int n,
                                                     int nh, int nkv, const int* pos0, float* out, i8* q8, float* d8,
                                                     int* s8) {
    constexpr int ST = HD + 8, NJ = HD / 8;  // f16 row stride; n8 tiles of the output
    extern __shared__ __align__(16) unsigned char at_smem[];
    u16* Qh = (u16*)at_smem;
    u16* Ql = Qh + AT_BQ * ST;
    u16* Ks = Ql + AT_BQ * ST;
    u16* Vs = Ks + AT_BK * ST;
    // the heaviest row tiles (the most keys) first: they start on SMs of their own
    const int h = blockIdx.x, t0 = (gridDim.y - 1 - blockIdx.y) * AT_BQ;
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, tg = lane & 3;
    const int p0 = *pos0;
    const int L = p0 + n;
    const int Lt = p0 + min(t0 + AT_BQ, n);
    const int nkt = (Lt + AT_BK - 1) / AT_BK;
    const int kvh = h / (nh / nkv), kvw = nkv * HD;
    const float scale = 1.0f / sqrtf((float)HD);
    // K / V tile loads: thread tid copies 16-byte chunk tid % CPR of rows tid / CPR + RPI·i
    constexpr int CPR = HD / 8, RPI = 128 / CPR;  // chunks per row; rows per pass of 128 threads
    const int ld_r = tid / CPR, ld_c = 8 * (tid % CPR);
    auto issue = [&](u16* dst, const u16* src, int kt) {
        const u16* s0 = src + kvh * HD + ld_c;
        u16* d0 = dst + ld_r * ST + ld_c;
#pragma unroll
        for (int i = 0; i < AT_BK / RPI; ++i) {
            const int p = min(kt * AT_BK + ld_r + RPI * i, L - 1);
            cp_async16(d0 + RPI * i * ST, s0 + (size_t)p * kvw);
        }
    };
    // Q tile as hi / lo f16 (rows past n: zeros, never stored); unrolled so that several loads
    // are in flight together
#pragma unroll 8
    for (int x = tid; x < AT_BQ * HD / 4; x += 128) {
        int r = x / (HD / 4), c4 = x % (HD / 4);
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        if (t0 + r < n) v = __ldg((const float4*)(qo + ((size_t)(t0 + r) * nh + h) * HD + 4 * c4));
        u32 h0, l0, h1, l1;
        split_h2(v.x, v.y, h0, l0);
        split_h2(v.z, v.w, h1, l1);
        *(uint2*)(Qh + r * ST + 4 * c4) = make_uint2(h0, h1);
        *(uint2*)(Ql + r * ST + 4 * c4) = make_uint2(l0, l1);
    }
    // ldmatrix lane addresses: A (Q rows 16w + (l & 7) + 8·((l >> 3) & 1), dims + 8·(l >> 4)),
    // B from K (keys (l & 7) + 8·(l >> 4), dims + 8·((l >> 3) & 1)), B from V transposed
    // (keys (l & 7) + 8·((l >> 3) & 1), dims + 8·(l >> 4))
    const u32 qa_off = (u32)(((16 * w + (lane & 7) + 8 * ((lane >> 3) & 1)) * ST + 8 * (lane >> 4)) * 2);
    const u32 qh_base = smem_u32(Qh) + qa_off, ql_base = smem_u32(Ql) + qa_off;
    const u32 k_base = smem_u32(Ks) + (u32)((((lane & 7) + 8 * (lane >> 4)) * ST + 8 * ((lane >> 3) & 1)) * 2);
    const u32 v_base = smem_u32(Vs) + (u32)((((lane & 7) + 8 * ((lane >> 3) & 1)) * ST + 8 * (lane >> 4)) * 2);
    issue(Ks, kc, 0);
    cp_async_commit();
    issue(Vs, vc, 0);
    cp_async_commit();
    const int prow0 = p0 + t0 + 16 * w + g;  // positions of this thread's rows g and g + 8
    const int wlast = p0 + t0 + 16 * w + 15;  // the warp's last row position
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
    float acc[NJ][4];
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
    for (int kt = 0; kt < nkt; ++kt) {
        cp_async_wait<1>();  // K of tile kt
        __syncthreads();
        const bool live = kt * AT_BK <= wlast;  // warp-uniform
        u32 ph[2][4], pl[2][4];                 // P as A fragments, k16 steps 0 / 1 of the tile
        if (live) {
            // hi and lo products in separate accumulators (8 independent MMA chains), added at the end
            float sc[4][4], sl[4][4];
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) sc[j][e] = sl[j][e] = 0.f;
#pragma unroll 4
            for (int kk = 0; kk < HD / 16; ++kk) {
                u32 ah[4], al[4], b0[4], b1[4];
                ldsm_x4(ah, qh_base + 32 * kk);
                ldsm_x4(al, ql_base + 32 * kk);
                ldsm_x4(b0, k_base + 32 * kk);
                ldsm_x4(b1, k_base + 32 * kk + 16 * ST * 2);
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const u32* b = j < 2 ? b0 : b1;
                    mma_f16(sc[j], ah[0], ah[1], ah[2], ah[3], b[2 * (j & 1)], b[2 * (j & 1) + 1]);
                    mma_f16(sl[j], al[0], al[1], al[2], al[3], b[2 * (j & 1)], b[2 * (j & 1) + 1]);
                }
            }
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) sc[j][e] += sl[j][e];
            // mask, online softmax (rows g: e 0-1, g + 8: e 2-3; a row's 32 keys over the quad)
            float mx[2] = {NEG_INF, NEG_INF};
            if (kt * AT_BK + AT_BK - 1 <= p0 + t0 + 16 * w) {
                // every key of the tile is visible to every row of the warp: no mask
#pragma unroll
                for (int j = 0; j < 4; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        sc[j][e] *= scale;
                        mx[e >> 1] = fmaxf(mx[e >> 1], sc[j][e]);
                    }
            } else {
#pragma unroll
                for (int j = 0; j < 4; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int pk = kt * AT_BK + 8 * j + 2 * tg + (e & 1);
                        const float sv = pk <= prow0 + 8 * (e >> 1) ? sc[j][e] * scale : NEG_INF;
                        sc[j][e] = sv;
                        mx[e >> 1] = fmaxf(mx[e >> 1], sv);
                    }
            }
            float corr[2], rs[2] = {0.f, 0.f};
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
                const float mn = fmaxf(m[r], mx[r]);  // finite: key 0 is in tile 0 for every row
                corr[r] = expf(m[r] - mn);
                m[r] = mn;
            }
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float pe = expf(sc[j][e] - m[e >> 1]);
                    sc[j][e] = pe;
                    rs[e >> 1] += pe;
                }
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                rs[r] += __shfl_xor_sync(0xffffffffu, rs[r], 1);
                rs[r] += __shfl_xor_sync(0xffffffffu, rs[r], 2);
                l[r] = fmaf(l[r], corr[r], rs[r]);
            }
            // rescale O unless no row of the warp has a new maximum (a multiply by 1 is exact: skipping
            // it changes nothing)
            if (!__all_sync(0xffffffffu, corr[0] == 1.0f && corr[1] == 1.0f)) {
#pragma unroll
                for (int j = 0; j < NJ; ++j) {
                    acc[j][0] *= corr[0];
                    acc[j][1] *= corr[0];
                    acc[j][2] *= corr[1];
                    acc[j][3] *= corr[1];
                }
            }
            // C of n8 tiles 2s, 2s + 1 = the A fragment of k16 step s
#pragma unroll
            for (int st = 0; st < 2; ++st) {
                split_h2(sc[2 * st][0], sc[2 * st][1], ph[st][0], pl[st][0]);
                split_h2(sc[2 * st][2], sc[2 * st][3], ph[st][1], pl[st][1]);
                split_h2(sc[2 * st + 1][0], sc[2 * st + 1][1], ph[st][2], pl[st][2]);
                split_h2(sc[2 * st + 1][2], sc[2 * st + 1][3], ph[st][3], pl[st][3]);
            }
        }
        __syncthreads();  // every warp is done with K
        if (kt + 1 < nkt) issue(Ks, kc, kt + 1);
        cp_async_commit();
        cp_async_wait<1>();  // V of tile kt
        __syncthreads();
        if (live) {
            // groups of PG output tile pairs: PG transposed V loads, then the 2·PG hi products, then
            // the 2·PG lo ones (each lo product waits on a hi product 2·PG MMAs back, not the one
            // just issued)
            constexpr int PG = NJ / 2 < 4 ? NJ / 2 : 4;
#pragma unroll
            for (int st = 0; st < 2; ++st) {
#pragma unroll
                for (int jq = 0; jq < NJ / 2; jq += PG) {
                    u32 b[PG][4];
#pragma unroll
                    for (int u = 0; u < PG; ++u) ldsm_x4_t(b[u], v_base + (u32)((16 * st * ST + 16 * (jq + u)) * 2));
#pragma unroll
                    for (int u = 0; u < PG; ++u) {
                        mma_f16(acc[2 * (jq + u)], ph[st][0], ph[st][1], ph[st][2], ph[st][3], b[u][0], b[u][1]);
                        mma_f16(acc[2 * (jq + u) + 1], ph[st][0], ph[st][1], ph[st][2], ph[st][3], b[u][2], b[u][3]);
                    }
#pragma unroll
                    for (int u = 0; u < PG; ++u) {
                        mma_f16(acc[2 * (jq + u)], pl[st][0], pl[st][1], pl[st][2], pl[st][3], b[u][0], b[u][1]);
                        mma_f16(acc[2 * (jq + u) + 1], pl[st][0], pl[st][1], pl[st][2], pl[st][3], b[u][2], b[u][3]);
                    }
                }
            }
        }
        __syncthreads();  // every warp is done with V
        if (kt + 1 < nkt) issue(Vs, vc, kt + 1);
        cp_async_commit();
    }
    cp_async_wait<0>();
    // O / l staged as f32 rows over Qh / Ql (every warp is past its last Q read), then gated and
    // quantized by the same warp: its 16 rows are one contiguous [16·HD] run of Os, taken as
    // float4 chunks (8 lanes per 32-block, quant32_x4), the gates of 4 chunks loaded ahead
    float* Os = (float*)at_smem;  // [AT_BQ][HD]
    const float il[2] = {1.0f / l[0], 1.0f / l[1]};
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = 16 * w + g + 8 * r;
            *(float2*)(Os + row * HD + 8 * j + 2 * tg) =
                make_float2(acc[j][2 * r] * il[r], acc[j][2 * r + 1] * il[r]);
        }
    __syncwarp();
    const float* Ow = Os + 16 * w * HD;
    for (int it0 = 0; it0 < HD / 8; it0 += 4) {  // HD/8 chunk iterations of 32 lanes
        float4 gt[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int e = 4 * (lane + 32 * (it0 + u)), t = t0 + 16 * w + e / HD;
            gt[u] = t < n ? *(const float4*)(qf + ((size_t)t * nh + h) * 2 * HD + HD + e % HD)
                          : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int e = 4 * (lane + 32 * (it0 + u)), t = t0 + 16 * w + e / HD;
            const float4 o4 = *(const float4*)(Ow + e);
            float y[4] = {o4.x * sigmoidf_(gt[u].x), o4.y * sigmoidf_(gt[u].y), o4.z * sigmoidf_(gt[u].z),
                          o4.w * sigmoidf_(gt[u].w)};
            const size_t idx = ((size_t)t * nh + h) * HD + e % HD;
            const bool ok = t < n;  // a whole 8-lane group shares the row
            if (ok && out) *(float4*)(out + idx) = make_float4(y[0], y[1], y[2], y[3]);
            quant32_x4(y, q8 + idx, d8 + (idx >> 5), s8 + (idx >> 5), ok);
        }
    }
}

// Both prefill attentions (attn_prefill_tc_body, attn_prefill_body) per head dim, same parameters;
// BOUNDS: the kernel's __launch_bounds__.
#define ATTN_PREFILL_ENTRY(NAME, BODY, HD, BOUNDS)                                                    \
    extern "C" __global__ void BOUNDS NAME(                                                           \
        const float* qo, const float* qf, const u16* kc, const u16* vc, int n, int nh, int nkv,       \
        const int* pos0, float* out, i8* q, float* d, int* s) {                                       \
        PDL_ENTRY();                                                                                  \
        BODY<HD>(qo, qf, kc, vc, n, nh, nkv, pos0, out, q, d, s);                                     \
    }
ATTN_PREFILL_ENTRY(attn_prefill_tc_hd64, attn_prefill_tc_body, 64, __launch_bounds__(128, 2))
ATTN_PREFILL_ENTRY(attn_prefill_tc_hd128, attn_prefill_tc_body, 128, __launch_bounds__(128, 2))
ATTN_PREFILL_ENTRY(attn_prefill_tc_hd256, attn_prefill_tc_body, 256, __launch_bounds__(128, 2))
ATTN_PREFILL_ENTRY(attn_prefill_hd64, attn_prefill_body, 64, __launch_bounds__(128))
ATTN_PREFILL_ENTRY(attn_prefill_hd128, attn_prefill_body, 128, __launch_bounds__(128))
ATTN_PREFILL_ENTRY(attn_prefill_hd256, attn_prefill_body, 256, __launch_bounds__(128))

