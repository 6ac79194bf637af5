//! The CPU backend: runs from the mmap (Q1_0 re-laid once into the mask layout where the CPU runs
//! the AVX2 or AVX-512 kernels), int8-activation low-bit matmuls from `bonsai_kernels_cpu::ops`, f32 residual and
//! GDN state, f16 KV cache.

use std::ops::Range;
use std::sync::Arc;

use bonsai_kernels_cpu::attn::{attention_gated, AttnShape, KvSource};
use bonsai_kernels_cpu::{ops, par, q1m, q2m, reference as r, QuantType};
use half::f16;

use super::{gdn_rec_width, Backend, GdnMode, KvType, Step};
use crate::config::TargetConfig;
use crate::error::{Error, Result};
use crate::gguf::Gguf;
use crate::model::{decode_step_eager, AttnWeights, GdnWeights, MlpWeights, SeqState, Weights};

/// Rows per chunk of the chunked delta rule in prefill ([`ops::gdn_chunked`]), counted from the
/// start of each prefill forward.
const GDN_CHUNK: usize = 64;

#[derive(Clone, Copy, Debug, Default)]
pub struct CpuBackend {
    /// Storage of the attention KV cache.
    pub kv: KvType,
}

impl CpuBackend {
    pub const fn new(kv: KvType) -> CpuBackend {
        CpuBackend { kv }
    }
}

/// A weight matrix `[n_in, n_out]` read in place from the mapped file, or — Q1_0 and the Q2 types
/// where the CPU kernels run AVX2 or AVX-512 — re-laid once at load into the mask layout ([`q1m`],
/// [`q2m`]) that those mat-vecs read without unpacking (the same results bit for bit).
pub struct CpuMat {
    g: Arc<Gguf>,
    idx: usize,
    pub qt: QuantType,
    pub n_in: usize,
    pub n_out: usize,
    /// `[n_out, row_bytes(n_in)]` the rows in their mask layout (Q1_0 or Q2), in anonymous memory
    /// asked to be backed by huge pages; the file's pages are released.
    masks: Option<memmap2::MmapMut>,
}

impl CpuMat {
    /// The matrix bytes in the file: `n_out` rows of `row_bytes(n_in)`. Checked at load.
    fn data(&self) -> &[u8] {
        let t = &self.g.tensors()[self.idx];
        self.g
            .tensor_data(t)
            .expect("tensor extent validated at load")
    }

    /// This matrix with its output `y` `[n, n_out]`, as [`ops::matmul_q_many`] takes it: the mask
    /// layout where it has one, else the file's bytes.
    fn with_output<'a>(&'a self, y: &'a mut [f32]) -> ops::MatQ<'a> {
        let (w, masks) = match &self.masks {
            Some(wm) => (&wm[..], true),
            None => (self.data(), false),
        };
        ops::MatQ {
            w,
            qt: self.qt,
            masks,
            n_out: self.n_out,
            y,
        }
    }

    /// Row `o` dequantized into `out` (`n_in` values).
    fn dequantize_row(&self, o: usize, out: &mut [f32]) {
        let rb = self.qt.row_bytes(self.n_in).expect("validated");
        match &self.masks {
            Some(wm) => {
                let mut row = vec![0u8; rb];
                let src = &wm[o * rb..(o + 1) * rb];
                if self.qt == QuantType::Q1_0 {
                    q1m::unpack_row(src, self.n_in, &mut row);
                } else {
                    q2m::unpack_row(self.qt, src, self.n_in, &mut row);
                }
                bonsai_kernels_cpu::quant::dequantize_row(self.qt, &row, out);
            }
            None => bonsai_kernels_cpu::quant::dequantize_row(
                self.qt,
                &self.data()[o * rb..(o + 1) * rb],
                out,
            ),
        }
    }
}

/// Whether matrices of `qt` go into their mask layout: Q1_0 or a Q2 type, the active ISA is AVX2
/// or AVX-512, and `BONSAI_CPU_Q1M` (Q1_0) / `BONSAI_CPU_Q2M` (Q2) is not `0`.
fn use_mask_layout(qt: QuantType) -> bool {
    let var = if qt == QuantType::Q1_0 {
        "BONSAI_CPU_Q1M"
    } else {
        "BONSAI_CPU_Q2M"
    };
    ops::mask_layout_available(qt) && std::env::var(var).map_or(true, |v| v != "0")
}

/// Activation rows: `data` is `[n, width]` f32.
pub struct CpuAct {
    pub n: usize,
    pub width: usize,
    pub data: Vec<f32>,
}

/// One attention layer's cache, head-major: per kv head its K and V rows `[len, hd]`, f16 or
/// q8_0. The attention reads one head's keys a chunk of positions at a time, which is one
/// contiguous run here; with position-major rows `[len, n_kv·hd]` it was `hd` elements at a
/// stride of `n_kv·hd` (27B at 8,192 positions, f32 test cache: 8.1–8.3 → 4.6–4.9 ms per decode
/// call, `bench_attention` with `BENCH_KV=head`). A q8_0 block (32 elements) never straddles two
/// heads (`hd % 32 == 0` is required), so the codes and scales are the position-major ones.
pub struct CpuKv {
    hd: usize,
    len: usize,
    k: Vec<KvRows>, // [n_kv] × [len, hd]
    v: Vec<KvRows>, // [n_kv] × [len, hd]
}

impl CpuKv {
    /// `n_kv·hd`, the width of one position's K (or V) row.
    fn width(&self) -> usize {
        self.k.len() * self.hd
    }

    /// Keep (or make room for) exactly `rows` positions.
    fn set_rows(&mut self, rows: usize) {
        for r in self.k.iter_mut().chain(self.v.iter_mut()) {
            r.set_rows(rows, self.hd);
        }
    }

    /// Stores position `pos`'s K and V rows (`[n_kv·hd]` each, heads in order).
    fn write(&mut self, pos: usize, k: &[f32], v: &[f32]) {
        let hd = self.hd;
        for (g, (kr, vr)) in self.k.iter_mut().zip(self.v.iter_mut()).enumerate() {
            kr.write(pos, hd, &k[g * hd..(g + 1) * hd]);
            vr.write(pos, hd, &v[g * hd..(g + 1) * hd]);
        }
    }
}

/// K or V rows of one layer. q8_0 is ggml's block: 32 int8 codes with one f16 scale
/// `d = amax/127`, kept here as two planes (codes, scales).
#[derive(Clone)]
enum KvRows {
    F16(Vec<f16>), // [len, width]
    Q8 {
        q: Vec<i8>,  // [len, width]
        d: Vec<f16>, // [len, width / 32]
    },
}

impl KvRows {
    fn new(t: KvType) -> KvRows {
        match t {
            KvType::F16 => KvRows::F16(Vec::new()),
            KvType::Q8_0 => KvRows::Q8 {
                q: Vec::new(),
                d: Vec::new(),
            },
        }
    }

    /// Keep (or make room for) exactly `rows` rows.
    fn set_rows(&mut self, rows: usize, width: usize) {
        match self {
            KvRows::F16(v) => v.resize(rows * width, f16::ZERO),
            KvRows::Q8 { q, d } => {
                q.resize(rows * width, 0);
                d.resize(rows * width / 32, f16::ZERO);
            }
        }
    }

    fn write(&mut self, pos: usize, width: usize, src: &[f32]) {
        match self {
            KvRows::F16(v) => {
                for (o, x) in v[pos * width..(pos + 1) * width].iter_mut().zip(src) {
                    *o = f16::from_f32(*x);
                }
            }
            KvRows::Q8 { q, d } => {
                let nb = width / 32;
                for (b, xb) in src.chunks_exact(32).enumerate() {
                    let amax = xb.iter().fold(0f32, |m, x| m.max(x.abs()));
                    let scale = f16::from_f32(amax / 127.0);
                    let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
                    d[pos * nb + b] = scale;
                    for (o, x) in q[pos * width + 32 * b..pos * width + 32 * (b + 1)]
                        .iter_mut()
                        .zip(xb)
                    {
                        *o = ops::round_to_i8(x * inv);
                    }
                }
            }
        }
    }

    /// `out` = rows `pos ..` (as many as `out` holds: `out.len() / width`) as f32, in one pass
    /// over their contiguous elements (`width` a multiple of 32 for q8_0).
    fn read_rows(&self, pos: usize, width: usize, out: &mut [f32]) {
        let e0 = pos * width;
        match self {
            KvRows::F16(v) => ops::f16_to_f32(&v[e0..e0 + out.len()], out),
            KvRows::Q8 { q, d } => {
                for (b, ob) in out.chunks_exact_mut(32).enumerate() {
                    let sc = d[e0 / 32 + b].to_f32();
                    for (o, &c) in ob.iter_mut().zip(&q[e0 + 32 * b..e0 + 32 * (b + 1)]) {
                        *o = c as f32 * sc;
                    }
                }
            }
        }
    }
}

/// A layer's cache as the attention op reads it: consecutive rows of one kv head, converted to
/// f32.
struct CpuKvSource<'a> {
    kv: &'a CpuKv,
}

impl KvSource for CpuKvSource<'_> {
    fn keys(&self, pos: usize, g: usize, hd: usize, out: &mut [f32]) {
        debug_assert_eq!(hd, self.kv.hd);
        self.kv.k[g].read_rows(pos, hd, out);
    }
    fn values(&self, pos: usize, g: usize, hd: usize, out: &mut [f32]) {
        debug_assert_eq!(hd, self.kv.hd);
        self.kv.v[g].read_rows(pos, hd, out);
    }
}

/// One GDN layer's state: conv window `[k−1, conv_dim]` (oldest first) and S `[H_v, d_k, d_v]`.
#[derive(Clone)]
pub struct CpuGdn {
    conv: Vec<f32>,
    s: Vec<f32>,
}

struct GdnDims {
    hk: usize,
    hv: usize,
    dk: usize,
    dv: usize,
    conv_dim: usize,
    kconv: usize,
}

fn gdn_dims(cfg: &TargetConfig) -> GdnDims {
    let dk = cfg.ssm_d_state;
    let hv = cfg.ssm_dt_rank;
    let dv = cfg.ssm_inner / hv;
    GdnDims {
        hk: cfg.ssm_n_group,
        hv,
        dk,
        dv,
        conv_dim: 2 * cfg.ssm_n_group * dk + cfg.ssm_inner,
        kconv: cfg.ssm_conv_kernel,
    }
}

/// Rows per task of the row-parallel element-wise passes (prefill); with fewer than two tasks'
/// worth of rows (decode, a verify) they run inline, where a parallel loop would cost more.
const ROWS_PER_TASK: usize = 4;

/// `f(t, row_t)` for every `width`-element row of `data`, in parallel over groups of rows when
/// there are enough of them. Each call sees one row only, so the results do not depend on it.
fn for_rows<F: Fn(usize, &mut [f32]) + Sync + Send>(data: &mut [f32], width: usize, f: F) {
    if width == 0 {
        return;
    }
    if data.len() < 2 * ROWS_PER_TASK * width {
        data.chunks_exact_mut(width)
            .enumerate()
            .for_each(|(t, row)| f(t, row));
    } else {
        par::for_each_chunk_mut(data, ROWS_PER_TASK * width, 1, |ci, rows| {
            for (j, row) in rows.chunks_exact_mut(width).enumerate() {
                f(ci * ROWS_PER_TASK + j, row);
            }
        });
    }
}

/// `x += y` (the residual), row-parallel as [`for_rows`]. x, y: `[n, width]`.
fn add_rows(x: &mut CpuAct, y: &[f32]) {
    let w = x.width;
    for_rows(&mut x.data, w, |t, xr| {
        for (xi, yi) in xr.iter_mut().zip(&y[t * w..(t + 1) * w]) {
            *xi += *yi;
        }
    });
}

/// `out[t] = rmsnorm(x[t]) ⊙ w` for every row. x, out: `[n, width]`.
fn rmsnorm_rows(x: &CpuAct, w: &[f32], eps: f32, out: &mut [f32]) {
    let width = x.width;
    for_rows(out, width, |t, or| {
        r::rmsnorm(&x.data[t * width..(t + 1) * width], w, eps, or)
    });
}

/// y: `[n, n_out]` = x `[n, n_in]` · Wᵀ for several matrices sharing one input (activations quantized once).
fn project(x: &[f32], n: usize, n_in: usize, outs: &mut [(&CpuMat, &mut Vec<f32>)]) {
    let any_lowbit = outs.iter().any(|(m, _)| m.qt.is_lowbit());
    let xq = if any_lowbit {
        Some(ops::quantize_acts(x, n, n_in))
    } else {
        None
    };
    for (m, y) in outs.iter_mut() {
        debug_assert_eq!(m.n_in, n_in);
        y.resize(n * m.n_out, 0.0);
    }
    match &xq {
        // one call for all: a decode row's low-bit matrices share one parallel loop (any other
        // matrix takes matmul_q's f32 path, which is ops::matmul's)
        Some(q) => {
            let mut mats: Vec<ops::MatQ> = outs
                .iter_mut()
                .map(|(m, y)| m.with_output(&mut y[..]))
                .collect();
            ops::matmul_q_many(&mut mats, q);
        }
        None => {
            for (m, y) in outs.iter_mut() {
                ops::matmul(m.data(), m.qt, m.n_in, m.n_out, x, n, y);
            }
        }
    }
}

/// The GDN mixer over the step's rows; with `rec`, also records each row's replay inputs.
fn gdn_impl(
    cfg: &TargetConfig,
    w: &GdnWeights<CpuBackend>,
    st: &mut CpuGdn,
    x: &mut CpuAct,
    s: &Step,
    rec: Option<&mut CpuAct>,
) -> Result<()> {
    let d = gdn_dims(cfg);
    let (n, e) = (x.n, x.width);
    let eps = cfg.rms_eps;
    // 1. projections of the normed input.
    let mut xn = vec![0f32; n * e]; // [n, n_embd]
    rmsnorm_rows(x, &w.attn_norm, eps, &mut xn);
    let (mut mixed, mut z, mut bb, mut aa) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    project(
        &xn,
        n,
        e,
        &mut [
            (&w.qkv, &mut mixed),
            (&w.gate, &mut z),
            (&w.beta, &mut bb),
            (&w.alpha, &mut aa),
        ],
    );
    // mixed: [n, conv_dim], z: [n, H_v·d_v], bb/aa: [n, H_v]

    // 2. causal conv + SiLU per row; 3. split and L2-normalize q, k; 4. gates.
    let qk = d.hk * d.dk;
    let vd = d.hv * d.dv;
    let mut q = vec![0f32; n * qk]; // [n, H_k, d_k]
    let mut k = vec![0f32; n * qk]; // [n, H_k, d_k]
    let mut v = vec![0f32; n * vd]; // [n, H_v, d_v]
    let mut beta = vec![0f32; n * d.hv]; // [n, H_v]
    let mut g = vec![0f32; n * d.hv]; // [n, H_v]
    let cd = d.conv_dim;
    let mut c = vec![0f32; n * cd]; // [n, conv_dim]

    // the reference conv sums, then the engine's SiLU (`ops::silu_fast`), over channel chunks;
    // several rows in one loop (the same bits as row after row)
    if n == 1 {
        ops::conv1d_silu_step(&mut st.conv, &mixed, &w.conv1d, d.kconv, &mut c);
    } else {
        ops::conv1d_silu_rows(&mut st.conv, &mixed, &w.conv1d, d.kconv, n, &mut c);
    }
    for_rows(&mut q, qk, |t, qt| {
        qt.copy_from_slice(&c[t * cd..t * cd + qk]);
        r::l2norm_heads(qt, d.dk, eps);
    });
    for_rows(&mut k, qk, |t, kt| {
        kt.copy_from_slice(&c[t * cd + qk..t * cd + 2 * qk]);
        r::l2norm_heads(kt, d.dk, eps);
    });
    for_rows(&mut v, vd, |t, vt| {
        vt.copy_from_slice(&c[t * cd + 2 * qk..(t + 1) * cd])
    });
    for t in 0..n {
        for h in 0..d.hv {
            let i = t * d.hv + h;
            beta[i] = r::sigmoid(bb[i]);
            g[i] = w.ssm_a[h] * r::softplus(aa[i] + w.dt_bias[h]);
        }
    }
    if let Some(rec) = rec {
        // rec: [n, gdn_rec_width] rows of mixed ‖ k ‖ v ‖ g ‖ β
        rec.n = n;
        rec.width = gdn_rec_width(cfg);
        rec.data.clear();
        for t in 0..n {
            rec.data
                .extend_from_slice(&mixed[t * d.conv_dim..(t + 1) * d.conv_dim]);
            rec.data.extend_from_slice(&k[t * qk..(t + 1) * qk]);
            rec.data.extend_from_slice(&v[t * vd..(t + 1) * vd]);
            rec.data.extend_from_slice(&g[t * d.hv..(t + 1) * d.hv]);
            rec.data.extend_from_slice(&beta[t * d.hv..(t + 1) * d.hv]);
        }
    }
    // 5. delta rule over the rows: o [n, H_v, d_v]
    let mut o = vec![0f32; n * vd];
    match s.gdn_mode {
        GdnMode::Recurrent => {
            for t in 0..n {
                ops::gdn_step(
                    &mut st.s,
                    &q[t * qk..(t + 1) * qk],
                    &k[t * qk..(t + 1) * qk],
                    &v[t * vd..(t + 1) * vd],
                    &g[t * d.hv..(t + 1) * d.hv],
                    &beta[t * d.hv..(t + 1) * d.hv],
                    d.hk,
                    d.dk,
                    d.dv,
                    &mut o[t * vd..(t + 1) * vd],
                );
            }
        }
        GdnMode::Chunked => {
            ops::gdn_chunked(
                &mut st.s, &q, &k, &v, &g, &beta, n, d.hk, d.dk, d.dv, GDN_CHUNK, &mut o,
            );
        }
    }
    // 6. gated RMSNorm per head: y_h = rmsnorm(o_h) ⊙ ssm_norm ⊙ SiLU(z_h)
    for_rows(&mut o, vd, |t, ot| {
        r::rmsnorm_heads(ot, d.dv, &w.ssm_norm, eps);
        ops::silu_op(ops::SiluOp::MulByGate, ot, &z[t * vd..(t + 1) * vd]);
    });
    // 7. out projection + residual
    let mut y = Vec::new();
    project(&o, n, vd, &mut [(&w.ssm_out, &mut y)]);
    add_rows(x, &y);
    Ok(())
}

impl Backend for CpuBackend {
    type Mat = CpuMat;
    type Vector = Vec<f32>;
    type Act = CpuAct;
    type Kv = CpuKv;
    type Gdn = CpuGdn;

    fn name(&self) -> String {
        format!(
            "cpu ({} threads, {:?})",
            rayon::current_num_threads(),
            ops::active_isa()
        )
    }

    /// 64, the delta rule's chunk: a prefill forward that starts at a multiple of it runs the rule
    /// over the same 64-row chunks as one that starts earlier on that grid, and every other op of
    /// the forward (projections with per-row activation scales, norms, RoPE, attention over the
    /// cache) computes a row alone. So any split at its multiples gives every row the same bits (the
    /// prompt-cache tests compare a resumed prefill with a fresh one bit for bit).
    fn prefill_granule(&self) -> Option<usize> {
        Some(GDN_CHUNK)
    }

    fn load_mat(&self, g: &Arc<Gguf>, name: &str, n_in: usize, n_out: usize) -> Result<CpuMat> {
        let (idx, qt, _) = g.matrix(name, n_in, n_out)?;
        let mut m = CpuMat {
            g: g.clone(),
            idx,
            qt,
            n_in,
            n_out,
            masks: None,
        };
        if n_in >= q1m::PAIR_ELEMS && use_mask_layout(qt) {
            let data = m.data();
            let mut buf = memmap2::MmapMut::map_anon(data.len()).map_err(|e| {
                Error::Backend(format!("cpu: {} bytes for {name}: {e}", data.len()))
            })?;
            // huge pages: fewer page faults while packing, fewer TLB misses while decoding
            #[cfg(target_os = "linux")]
            let _ = buf.advise(memmap2::Advice::HugePage);
            g.prefault(data);
            // a Q2 matrix with the unused code 3 stays in the file layout (`q2m::pack_into`)
            let packed = if qt == QuantType::Q1_0 {
                q1m::pack_into(data, n_in, n_out, &mut buf);
                true
            } else {
                q2m::pack_into(qt, data, n_in, n_out, &mut buf)
            };
            if packed {
                g.release(data);
                m.masks = Some(buf);
            }
        }
        Ok(m)
    }

    fn load_vector(&self, g: &Arc<Gguf>, name: &str, n: usize) -> Result<Vec<f32>> {
        let v = g.vector(name, n)?;
        Ok(v)
    }

    fn new_act(&self, n: usize, width: usize) -> CpuAct {
        CpuAct {
            n,
            width,
            data: vec![0.0; n * width],
        }
    }

    fn new_kv(&self, cfg: &TargetConfig, _n_ctx: usize) -> Result<CpuKv> {
        if self.kv == KvType::Q8_0 && cfg.head_dim % 32 != 0 {
            return Err(Error::InvalidRequest(format!(
                "kv_cache=\"q8_0\" needs a head dim that is a multiple of 32, the model has {}",
                cfg.head_dim
            )));
        }
        // Grows on demand up to n_ctx; memory is paid only for positions in use.
        Ok(CpuKv {
            hd: cfg.head_dim,
            len: 0,
            k: (0..cfg.n_head_kv).map(|_| KvRows::new(self.kv)).collect(),
            v: (0..cfg.n_head_kv).map(|_| KvRows::new(self.kv)).collect(),
        })
    }

    fn new_gdn(&self, cfg: &TargetConfig) -> Result<CpuGdn> {
        let d = gdn_dims(cfg);
        Ok(CpuGdn {
            conv: vec![0.0; (d.kconv - 1) * d.conv_dim],
            s: vec![0.0; d.hv * d.dk * d.dv],
        })
    }

    fn reset_gdn(&self, st: &mut CpuGdn) {
        st.conv.fill(0.0);
        st.s.fill(0.0);
    }

    fn copy_gdn(&self, src: &CpuGdn, dst: &mut CpuGdn) {
        dst.conv.copy_from_slice(&src.conv);
        dst.s.copy_from_slice(&src.s);
    }

    fn truncate_kv(&self, kv: &mut CpuKv, len: usize) {
        kv.len = kv.len.min(len);
        kv.set_rows(kv.len);
    }

    fn copy_kv(&self, src: &CpuKv, dst: &mut CpuKv) {
        dst.len = src.len;
        dst.hd = src.hd;
        dst.k.clone_from(&src.k);
        dst.v.clone_from(&src.v);
    }

    fn gdn_to_host(&self, st: &CpuGdn) -> Result<Vec<f32>> {
        let mut out = st.conv.clone();
        out.extend_from_slice(&st.s);
        Ok(out)
    }

    fn kv_to_host(&self, kv: &CpuKv) -> Result<(usize, Vec<f32>)> {
        let (len, w, hd) = (kv.len, kv.width(), kv.hd);
        let mut out = vec![0f32; 2 * len * w]; // [K rows ‖ V rows] f32, position-major
        let (ko, vo) = out.split_at_mut(len * w);
        for p in 0..len {
            for (g, (kr, vr)) in kv.k.iter().zip(&kv.v).enumerate() {
                let o = p * w + g * hd;
                kr.read_rows(p, hd, &mut ko[o..o + hd]);
                vr.read_rows(p, hd, &mut vo[o..o + hd]);
            }
        }
        Ok((len, out))
    }

    fn gdn_block_rec(
        &self,
        cfg: &TargetConfig,
        w: &GdnWeights<Self>,
        st: &mut CpuGdn,
        x: &mut CpuAct,
        s: &Step,
        rec: &mut CpuAct,
    ) -> Result<()> {
        if s.gdn_mode != GdnMode::Recurrent {
            return Err(Error::Backend(
                "gdn_block_rec records recurrent steps only".into(),
            ));
        }
        gdn_impl(cfg, w, st, x, s, Some(rec))
    }

    fn gdn_replay(
        &self,
        cfg: &TargetConfig,
        st: &mut CpuGdn,
        rec: &CpuAct,
        n: usize,
    ) -> Result<()> {
        let d = gdn_dims(cfg);
        if n > rec.n || rec.width != gdn_rec_width(cfg) {
            return Err(Error::Backend(format!(
                "gdn_replay: {n} rows requested, the record holds {} rows of width {}",
                rec.n, rec.width
            )));
        }
        let (qk, vd, cd) = (d.hk * d.dk, d.hv * d.dv, d.conv_dim);
        let mut dummy = vec![0f32; vd]; // [H_v, d_v] output, discarded
        for row in rec.data.chunks_exact(rec.width).take(n) {
            let (mixed, rest) = row.split_at(cd);
            let (k, rest) = rest.split_at(qk);
            let (v, rest) = rest.split_at(vd);
            let (g, beta) = rest.split_at(d.hv);
            // the conv window after a row: drop the oldest row, append this row's pre-conv input
            if d.kconv > 1 {
                st.conv.copy_within(cd.., 0);
                st.conv[(d.kconv - 2) * cd..].copy_from_slice(mixed);
            }
            // the state update does not read q: pass k in its place
            ops::gdn_step(&mut st.s, k, k, v, g, beta, d.hk, d.dk, d.dv, &mut dummy);
        }
        Ok(())
    }

    fn embed(&self, table: &CpuMat, ids: &[u32], x: &mut CpuAct) -> Result<()> {
        for (t, &id) in ids.iter().enumerate() {
            let id = id as usize;
            if id >= table.n_out {
                return Err(Error::InvalidRequest(format!(
                    "token id {id} out of range ({})",
                    table.n_out
                )));
            }
            table.dequantize_row(id, &mut x.data[t * x.width..(t + 1) * x.width]);
        }
        Ok(())
    }

    fn gdn_block(
        &self,
        cfg: &TargetConfig,
        w: &GdnWeights<Self>,
        st: &mut CpuGdn,
        x: &mut CpuAct,
        s: &Step,
    ) -> Result<()> {
        gdn_impl(cfg, w, st, x, s, None)
    }

    fn attn_block(
        &self,
        cfg: &TargetConfig,
        w: &AttnWeights<Self>,
        kv: &mut CpuKv,
        x: &mut CpuAct,
        s: &Step,
    ) -> Result<()> {
        let (n, e) = (x.n, x.width);
        let eps = cfg.rms_eps;
        let (nh, nkv, hd) = (cfg.n_head, cfg.n_head_kv, cfg.head_dim);
        if kv.len != s.pos {
            return Err(Error::Backend(format!(
                "KV cache holds {} rows, step starts at {}",
                kv.len, s.pos
            )));
        }
        // 1. projections
        let mut xn = vec![0f32; n * e]; // [n, n_embd]
        rmsnorm_rows(x, &w.attn_norm, eps, &mut xn);
        let (mut qf, mut kf, mut vf) = (Vec::new(), Vec::new(), Vec::new());
        project(
            &xn,
            n,
            e,
            &mut [(&w.q, &mut qf), (&w.k, &mut kf), (&w.v, &mut vf)],
        );
        // qf: [n, n_head, 2, hd] (q ‖ gate per head), kf/vf: [n, n_kv·hd]

        // 2. split q / gate, per-head RMSNorm, partial NEOX RoPE; append K/V (f16).
        let mut q = vec![0f32; n * nh * hd]; // [n, n_head, hd]
        let mut gate = vec![0f32; n * nh * hd]; // [n, n_head, hd]
        let kvw = nkv * hd;
        kv.set_rows(s.pos + n);
        for_rows(&mut q, nh * hd, |t, qt| {
            for (h, qh) in qt.chunks_exact_mut(hd).enumerate() {
                qh.copy_from_slice(&qf[(t * nh + h) * 2 * hd..(t * nh + h) * 2 * hd + hd]);
            }
            r::rmsnorm_heads(qt, hd, &w.q_norm, eps);
            r::rope_neox(qt, hd, cfg.n_rot, s.pos + t, cfg.rope_base);
        });
        for_rows(&mut gate, nh * hd, |t, gt| {
            for (h, gh) in gt.chunks_exact_mut(hd).enumerate() {
                gh.copy_from_slice(&qf[(t * nh + h) * 2 * hd + hd..(t * nh + h + 1) * 2 * hd]);
            }
        });
        for_rows(&mut kf, kvw, |t, kt| {
            r::rmsnorm_heads(kt, hd, &w.k_norm, eps);
            r::rope_neox(kt, hd, cfg.n_rot, s.pos + t, cfg.rope_base);
        });
        for t in 0..n {
            kv.write(
                s.pos + t,
                &kf[t * kvw..(t + 1) * kvw],
                &vf[t * kvw..(t + 1) * kvw],
            );
        }
        kv.len = s.pos + n;

        // 3. causal attention over positions ≤ pos, grouped GQA, then the σ(gate), in fixed chunks
        //    of key positions (`attn`: every (row, head) result is the same whatever n is, so
        //    verify rows equal single-token steps; a task converts one chunk of K/V to f32, never
        //    a whole prefix).
        let mut att = vec![0f32; n * nh * hd]; // [n, n_head, hd]
        let src = CpuKvSource { kv };
        let shape = AttnShape {
            n,
            pos0: s.pos,
            n_head: nh,
            n_kv: nkv,
            hd,
            scale: 1.0 / (hd as f32).sqrt(),
        };
        attention_gated(&src, &q, &gate, shape, &mut att);
        // 4. out projection + residual
        let mut y = Vec::new();
        project(&att, n, nh * hd, &mut [(&w.out, &mut y)]);
        add_rows(x, &y);
        Ok(())
    }

    fn mlp_block(&self, cfg: &TargetConfig, w: &MlpWeights<Self>, x: &mut CpuAct) -> Result<()> {
        let (n, e) = (x.n, x.width);
        let mut u = vec![0f32; n * e]; // [n, n_embd]
        rmsnorm_rows(x, &w.post_norm, cfg.rms_eps, &mut u);
        let (mut gt, mut up) = (Vec::new(), Vec::new()); // [n, n_ff] each
        project(&u, n, e, &mut [(&w.gate, &mut gt), (&w.up, &mut up)]);
        let nff = cfg.n_ff;
        for_rows(&mut gt, nff, |t, g| {
            ops::silu_op(ops::SiluOp::GateMulUp, g, &up[t * nff..(t + 1) * nff])
        });
        let mut y = Vec::new(); // [n, n_embd]
        project(&gt, n, nff, &mut [(&w.down, &mut y)]);
        add_rows(x, &y);
        Ok(())
    }

    fn head(
        &self,
        cfg: &TargetConfig,
        norm: &Vec<f32>,
        out: &CpuMat,
        x: &CpuAct,
        rows: Range<usize>,
        logits: &mut [f32],
    ) -> Result<()> {
        let e = x.width;
        let nr = rows.len();
        let mut xn = vec![0f32; nr * e]; // [rows, n_embd]
        for (i, row) in rows.enumerate() {
            r::rmsnorm(
                &x.data[row * e..(row + 1) * e],
                norm,
                cfg.rms_eps,
                &mut xn[i * e..(i + 1) * e],
            );
        }
        let mut y = Vec::new();
        project(&xn, nr, e, &mut [(out, &mut y)]);
        logits.copy_from_slice(&y);
        Ok(())
    }

    fn read_row(&self, x: &CpuAct, row: usize, out: &mut [f32]) {
        out.copy_from_slice(&x.data[row * x.width..(row + 1) * x.width]);
    }

    /// The plain forward over one row.
    fn decode_step(
        &self,
        cfg: &TargetConfig,
        w: &Weights<Self>,
        st: &mut SeqState<Self>,
        id: u32,
        logits: &mut Vec<f32>,
    ) -> Result<()> {
        decode_step_eager(self, cfg, w, st, id, logits)
    }
}
