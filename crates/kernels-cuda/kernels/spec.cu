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
// grid (hv + ceil(conv_dim / 256), dv / 32), block 256 (8 warps).
//   S [hv, dk, dv]; conv_state [kconv-1, conv_dim] oldest first; rec [>= n, rec_w] as above.
// Blocks x < hv: the delta rule of v-head x for value columns [32·y, 32·y + 32), written as a copy of
// gdn_step's recurrence: the same loads, the same float operations in the same order (warp w owns
// key rows [w·R, (w+1)·R), R = dk/8; lane = value column; the u reduction over the 8 warps in warp
// order), so the state equals what gdn_step leaves bit for bit. Only the output o is not computed
// (it never feeds back into S). KEEP IN SYNC with gdn_step in bonsai.cu: any change to its
// arithmetic must be mirrored here (the GPU tests compare the two bit for bit).
// Blocks x >= hv (row y == 0 only): the conv window, one channel per thread: for each row drop the
// oldest window row and append the row's pre-conv input, exactly as gdn_conv updates it.
extern "C" __global__ void gdn_replay(float* S, float* conv_state, const float* rec, int rec_w, int hk, int hv,
                                      int dk, int dv, int kconv, int n) {
    __shared__ float ks[128], red[8][32];
    int conv_dim = 2 * hk * dk + hv * dv;
    if ((int)blockIdx.x >= hv) {
        if (blockIdx.y != 0) return;
        int ch = (blockIdx.x - hv) * blockDim.x + threadIdx.x;
        if (ch >= conv_dim || kconv < 2) return;
        for (int t = 0; t < n; ++t) {
            for (int j = 0; j + 1 < kconv - 1; ++j) conv_state[j * conv_dim + ch] = conv_state[(j + 1) * conv_dim + ch];
            conv_state[(kconv - 2) * conv_dim + ch] = rec[(size_t)t * rec_w + ch];
        }
        return;
    }
    int koff = conv_dim, voff = conv_dim + hk * dk, goff = voff + hv * dv, boff = goff + hv;
    int h = blockIdx.x, lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    int j = blockIdx.y * 32 + lane;
    int R = dk / 8;
    int kap = h % hk;
    float* Sh = S + (size_t)h * dk * dv;
    float s[16];
#pragma unroll
    for (int r = 0; r < 16; ++r) s[r] = r < R ? Sh[(size_t)(w * R + r) * dv + j] : 0.f;
    for (int t = 0; t < n; ++t) {
        const float* row = rec + (size_t)t * rec_w;
        __syncthreads();
        for (int i = threadIdx.x; i < dk; i += blockDim.x) ks[i] = row[koff + kap * dk + i];
        __syncthreads();
        float decay = expf(row[goff + h]);
        float u = 0.f;
#pragma unroll
        for (int r = 0; r < 16; ++r)
            if (r < R) {
                s[r] *= decay;
                u = fmaf(s[r], ks[w * R + r], u);
            }
        red[w][lane] = u;
        __syncthreads();
        float ut = 0.f;
        for (int i = 0; i < 8; ++i) ut += red[i][lane];
        float delta = row[boff + h] * (row[voff + h * dv + j] - ut);
#pragma unroll
        for (int r = 0; r < 16; ++r)
            if (r < R) s[r] = fmaf(ks[w * R + r], delta, s[r]);
        // (the next row's first __syncthreads orders these red/ks reads before their rewrite)
    }
#pragma unroll
    for (int r = 0; r < 16; ++r)
        if (r < R) Sh[(size_t)(w * R + r) * dv + j] = s[r];
}
