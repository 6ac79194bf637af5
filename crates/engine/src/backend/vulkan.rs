//! The Vulkan backend: the qwen35 forward as `bonsai_kernels_vulkan` dispatches, with f32 GDN
//! state and f32 activations between kernels.
//!
//! Low-bit matrices stay low-bit on the device (their blocks split at load into a scale plane and
//! a code plane laid out for the mat-vec); other types are dequantized to f32 at load. The KV cache
//! is f16 or ggml q8_0 (`kv_cache="q8_0"`, the CPU backend's rounding). The low-bit mat-vecs take
//! their activations as [`ActMode`] says: int8 per 32 elements (the CPU engine's quantization and
//! float order, with packed int8 dot products; the default where the driver accelerates them), or
//! f32 (the exact f32-activation products of MODEL.md §1.3, closer to f32 than the CPU engine's).
//! With int8, the matrices that read one input are loaded side by side (`load_mats`) and run as
//! one dispatch, and the RMS norm before them quantizes its own output. Every shader computes a
//! row the same way whatever the row count, so a speculative verify row equals the decode row bit
//! for bit, and greedy speculative output equals plain greedy output.
//!
//! Blocks are recorded into one pending command buffer (`Vulkan::record`) and submitted when the
//! host needs a result (the logits, a tapped row, a state export) or a buffer is freed: a decode
//! step is one submission. On the H200 the 27B files decode at 100.2 (Q1_0) / 93.3 (Q2_0) tok/s
//! with int8 activations and 61.2 / 53.3 with f32, bound by ~600 dispatches a step at 5–6 µs
//! each at least (`crates/kernels-vulkan/README.md`).

use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard};

use bonsai_kernels_cpu::quant::{dequantize_row, QuantType};
use bonsai_kernels_vulkan::retile::{split_blocks, split_blocks_dot, LowBit};
use bonsai_kernels_vulkan::{
    gdn_step_groups, mv_dot_groups, mv_groups, q8_blocks, quant_q8_groups, Buffer, Cmd, Kernel,
    Push, VkError, Vulkan,
};

use super::{gdn_rec_width, Backend, KvType, Step};
use crate::config::TargetConfig;
use crate::error::{Error, Result};
use crate::gguf::Gguf;
use crate::model::{decode_step_eager, AttnWeights, GdnWeights, MlpWeights, SeqState, Weights};

fn be(e: VkError) -> Error {
    Error::Backend(e.to_string())
}

/// Limits of the shaders (`gdn_step`: d_k ≤ 128, a multiple of 4; attention: head dim ≤ 512).
const MAX_DK: usize = bonsai_kernels_vulkan::GDN_MAX_DK;
const MAX_HD: usize = 512;

pub struct VulkanBackend {
    vk: Vulkan,
    /// Storage of the attention KV cache.
    kv_type: KvType,
    scratch: Mutex<Vec<Option<Buffer>>>,
    /// `BONSAI_VK_EAGER_SUBMIT=1`: submit and wait after every block (the behaviour before the
    /// deferred submission; kept for the A/B in bench/vulkan_submit.py).
    eager_submit: bool,
    /// The RoPE table `[n, n_rot/2, (cos, sin)]` of the last (pos, n, n_rot, base bits): every
    /// attention layer of a forward reads the same one, so it is uploaded once per forward.
    rope: Mutex<Option<(RopeKey, Buffer)>>,
    /// Low-bit mat-vecs take int8 activations (`quant_q8` + `mv_dot_*`: the CPU engine's numerics)
    /// instead of f32 ones. See [`ActMode`].
    int8: bool,
}

/// What a RoPE table is for: (first position, rows, n_rot, rope base bits).
type RopeKey = (usize, usize, usize, u32);

/// How the low-bit mat-vecs take their activations (`BONSAI_VK_ACT=f32|int8`, else `auto`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActMode {
    /// f32 activations: the exact f32-activation products of MODEL.md §1.3.
    F32,
    /// int8 activations per 32 elements, the CPU engine's quantization and float order; needs
    /// `shaderIntegerDotProduct`.
    Int8,
    /// int8 where the driver says packed int8 dot products are accelerated, else f32.
    Auto,
}

impl ActMode {
    fn from_env() -> Result<ActMode> {
        match std::env::var("BONSAI_VK_ACT").as_deref() {
            Err(_) | Ok("") | Ok("auto") => Ok(ActMode::Auto),
            Ok("f32") => Ok(ActMode::F32),
            Ok("int8") => Ok(ActMode::Int8),
            Ok(other) => Err(Error::BackendUnavailable(format!(
                "BONSAI_VK_ACT={other}: expected f32, int8 or auto"
            ))),
        }
    }
}

/// A weight matrix `[n_in, n_out]` on the device, plus where its rows are in the file (for `embed`).
pub struct VkMat {
    kernel: Kernel,
    /// `kernel` is an int8-activation mat-vec (`mv_dot_*`): codes `[n_out, n_in / 32, words]`,
    /// scales two f16 per word (`split_blocks_dot`).
    dot: bool,
    codes: Arc<Buffer>, // [n_out, nblk, words] u32, or the f32 matrix, from byte codes_off
    scales: Arc<Buffer>, // [n_out, nblk] f32 (unused for f32), from byte scales_off
    codes_off: u64,
    scales_off: u64,
    /// First row in the buffers `load_mats` shares between matrices of one input (else 0).
    row0: usize,
    pub n_in: usize,
    pub n_out: usize,
    g: Arc<Gguf>,
    idx: usize,
    qt: QuantType,
}

/// A small f32 vector on the device.
pub struct VkVector {
    buf: Buffer,
}

/// Activation rows `[n, width]` f32 (the buffer holds at least `n` rows).
pub struct VkAct {
    pub n: usize,
    pub width: usize,
    buf: Buffer,
}

/// One attention layer's cache, `len` rows in use: K and V `[n_ctx, n_kv·hd]` f16, or q8_0 (i8
/// codes `[n_ctx, n_kv·hd]`, four per word, then f32 scales `[n_ctx, n_kv·hd / 32]` from word
/// `sc_off`).
pub struct VkKv {
    k: Buffer,
    v: Buffer,
    len: usize,
    n_ctx: usize,
    width: usize,
    q8: bool,
    sc_off: usize,
}

/// Bytes of `rows` cache rows of `width`: (codes or f16 values, q8 scales).
fn kv_bytes(q8: bool, width: usize, rows: usize) -> (u64, u64) {
    if q8 {
        ((rows * width) as u64, f4(rows * width / 32))
    } else {
        (2 * (rows * width) as u64, 0)
    }
}

impl VkKv {
    /// Bytes of the first `rows` rows: (codes or f16 values, scales).
    fn row_bytes(&self, rows: usize) -> (u64, u64) {
        kv_bytes(self.q8, self.width, rows)
    }
}

/// One GDN layer's state: conv window `[k−1, conv_dim]` and S `[H_v, d_k, d_v]`, f32.
pub struct VkGdn {
    conv: Buffer,
    s: Buffer,
}

struct Dims {
    hk: usize,
    hv: usize,
    dk: usize,
    dv: usize,
    qk: usize, // H_k·d_k
    vd: usize, // H_v·d_v
    cd: usize, // conv_dim
    kconv: usize,
}

fn dims(cfg: &TargetConfig) -> Dims {
    let dk = cfg.ssm_d_state;
    let hv = cfg.ssm_dt_rank;
    let dv = cfg.ssm_inner / hv.max(1);
    let qk = cfg.ssm_n_group * dk;
    Dims {
        hk: cfg.ssm_n_group,
        hv,
        dk,
        dv,
        qk,
        vd: hv * dv,
        cd: 2 * qk + cfg.ssm_inner,
        kconv: cfg.ssm_conv_kernel,
    }
}

fn f4(n: usize) -> u64 {
    4 * n as u64
}

/// The scratch buffers of one block, by slot.
struct Scratch<'a>(MutexGuard<'a, Vec<Option<Buffer>>>);

impl Scratch<'_> {
    fn b(&self, i: usize) -> &Buffer {
        self.0[i]
            .as_ref()
            .expect("slot sized by VulkanBackend::scratch")
    }
}

fn norm(
    c: &mut Cmd,
    x: &Buffer,
    x_off: u64,
    w: &Buffer,
    y: &Buffer,
    z: Option<(&Buffer, u64)>,
    groups: usize,
    gw: usize,
    eps: f32,
) {
    let p = Push::new().addr(x, x_off).addr(w, 0).addr(y, 0);
    let p = match z {
        Some((z, off)) => p.addr(z, off),
        None => p.null(),
    };
    let p = p
        .u32(groups as u32)
        .u32(gw as u32)
        .f32(eps)
        .u32(z.is_some() as u32);
    c.dispatch(Kernel::Rmsnorm, groups as u32, &p);
}

/// f32 words of a scratch slot holding `n` rows of `width` quantized by `quant_q8`.
fn q8_words(n: usize, width: usize) -> usize {
    n * q8_blocks(width) * 10
}

/// Byte offsets of (codes, scales, sums) in a `q8_words` slot: `[n, nb8 · 32]` i8, then
/// `[n, nb8]` f32, then `[n, nb8]` i32.
fn q8_offsets(n: usize, width: usize) -> (u64, u64, u64) {
    let nb8 = (n * q8_blocks(width)) as u64;
    (0, 32 * nb8, 36 * nb8)
}

/// [`norm`] that also quantizes its output into `q` (`rmsnorm_q8`: `n` activation rows of
/// `groups / n` groups of `gw`, gw a multiple of 32) where the mat-vecs take int8 activations,
/// else plain [`norm`].
#[allow(clippy::too_many_arguments)]
fn norm_q8(
    c: &mut Cmd,
    on: bool,
    x: &Buffer,
    x_off: u64,
    w: &Buffer,
    y: &Buffer,
    z: Option<(&Buffer, u64)>,
    q: &Buffer,
    n: usize,
    groups: usize,
    gw: usize,
    eps: f32,
) {
    if !on || gw % 32 != 0 || n == 0 || groups % n != 0 {
        norm(c, x, x_off, w, y, z, groups, gw, eps);
        quant(c, on, y, q, n, groups / n.max(1) * gw);
        return;
    }
    let width = groups / n * gw;
    let (oq, od, os) = q8_offsets(n, width);
    let p = Push::new().addr(x, x_off).addr(w, 0).addr(y, 0);
    let p = match z {
        Some((z, off)) => p.addr(z, off),
        None => p.null(),
    };
    // a workgroup per 256 values of a group
    let wgs = (groups * gw.div_ceil(256)) as u32;
    let p = p
        .addr(q, oq)
        .addr(q, od)
        .addr(q, os)
        .u32(wgs)
        .u32(gw as u32)
        .f32(eps)
        .u32(z.is_some() as u32)
        .u32((groups / n) as u32)
        .u32(q8_blocks(width) as u32);
    c.dispatch(Kernel::RmsnormQ8, wgs, &p);
}

/// `q ← quant_q8(x)` for `n` rows of `width` (nothing when the mat-vecs take f32 activations).
fn quant(c: &mut Cmd, on: bool, x: &Buffer, q: &Buffer, n: usize, width: usize) {
    // a width off the 32-element blocks feeds no int8 kernel (their n_in is whole weight blocks)
    if !on || width % 32 != 0 {
        return;
    }
    let (oq, od, os) = q8_offsets(n, width);
    let g = quant_q8_groups(n, width);
    let p = Push::new()
        .addr(x, 0)
        .addr(q, oq)
        .addr(q, od)
        .addr(q, os)
        .u32(g)
        .u32(n as u32)
        .u32(width as u32)
        .u32(q8_blocks(width) as u32);
    c.dispatch(Kernel::QuantQ8, g, &p);
}

/// `y[t] (+)= W x[t]` for `n` rows; `q` holds `x` quantized by [`quant`] (read by the int8
/// kernels only).
fn mv(c: &mut Cmd, m: &VkMat, x: &Buffer, q: &Buffer, y: &Buffer, n: usize, acc: bool) {
    mv_at(c, m, x, q, y, 0, n, acc);
}

/// [`mv`] with the output `[n, n_out]` from byte `y_off` of `y`.
#[allow(clippy::too_many_arguments)]
fn mv_at(
    c: &mut Cmd,
    m: &VkMat,
    x: &Buffer,
    q: &Buffer,
    y: &Buffer,
    y_off: u64,
    n: usize,
    acc: bool,
) {
    if m.dot {
        let no = m.n_out as u32;
        mv_dot_segments(c, m, m.n_out, [no; 3], [0; 3], q, y, y_off, n, acc);
        return;
    }
    let groups = mv_groups(m.n_out, n);
    let p = Push::new()
        .addr(&m.codes, m.codes_off)
        .addr(&m.scales, m.scales_off)
        .addr(x, 0)
        .addr(y, y_off)
        .u32(groups)
        .u32(m.n_in as u32)
        .u32(m.n_out as u32)
        .u32(acc as u32);
    c.dispatch(m.kernel, groups, &p);
}

/// One `mv_dot_*` dispatch over `n_out` rows from `m`'s first row (`m` and the matrices placed
/// after it by `load_mats`), the outputs split at the row ends `seg` and stored from the element
/// offsets `yoff` (`mv_dot.comp`).
#[allow(clippy::too_many_arguments)]
fn mv_dot_segments(
    c: &mut Cmd,
    m: &VkMat,
    n_out: usize,
    seg: [u32; 3],
    yoff: [u32; 3],
    q: &Buffer,
    y: &Buffer,
    y_off: u64,
    n: usize,
    acc: bool,
) {
    let (oq, od, os) = q8_offsets(n, m.n_in);
    let groups = mv_dot_groups(n_out, n);
    let p = Push::new()
        .addr(&m.codes, m.codes_off)
        .addr(&m.scales, m.scales_off)
        .addr(q, oq)
        .addr(q, od)
        .addr(q, os)
        .addr(y, y_off)
        .u32(n as u32)
        .u32(m.n_in as u32)
        .u32(n_out as u32)
        .u32(acc as u32)
        .u32(seg[0])
        .u32(seg[1])
        .u32(seg[2])
        .u32(yoff[0])
        .u32(yoff[1])
        .u32(yoff[2]);
    c.dispatch(m.kernel, groups, &p);
}

/// Where the outputs of matrices that read one input go in one buffer: segment i, `[n, n_out_i]`,
/// from a 4-element boundary. Returns each segment's first element and the total in elements.
fn seg_layout(mats: &[&VkMat], n: usize) -> (Vec<usize>, usize) {
    let mut at = Vec::with_capacity(mats.len());
    let mut end = 0;
    for m in mats {
        at.push(end);
        end += m.n_out.next_multiple_of(4) * n;
    }
    (at, end)
}

/// `y ← W_i x` for each of `mats` (≤ 4, one input), stored as [`seg_layout`] says: one
/// dispatch when they are int8 matrices `load_mats` placed side by side, else one each.
fn mv_group(c: &mut Cmd, mats: &[&VkMat], x: &Buffer, q: &Buffer, y: &Buffer, n: usize) {
    let (at, _) = seg_layout(mats, n);
    let first = mats[0];
    let side_by_side = mats.len() <= 4
        && mats
            .iter()
            .all(|m| m.dot && m.kernel == first.kernel && m.n_in == first.n_in)
        && mats
            .windows(2)
            .all(|w| Arc::ptr_eq(&w[0].codes, &w[1].codes) && w[1].row0 == w[0].row0 + w[0].n_out);
    if !side_by_side {
        for (m, &a) in mats.iter().zip(&at) {
            mv_at(c, m, x, q, y, f4(a), n, false);
        }
        return;
    }
    let total: usize = mats.iter().map(|m| m.n_out).sum();
    let (mut seg, mut yoff) = ([total as u32; 3], [0u32; 3]);
    let mut end = 0;
    for (i, m) in mats.iter().enumerate().take(3) {
        end += m.n_out;
        seg[i] = end as u32;
        if let Some(&a) = at.get(i + 1) {
            yoff[i] = a as u32;
        }
    }
    mv_dot_segments(c, first, total, seg, yoff, q, y, 0, n, false);
}

/// The mat-vec kernel and code layout of a low-bit `qt` (`int8`: the int8-activation kernels);
/// `None` for the types dequantized to f32.
fn lowbit_kernel(qt: QuantType, int8: bool) -> Option<(Kernel, LowBit)> {
    let (k, lb) = match qt {
        QuantType::Q1_0 => ((Kernel::MvQ1, Kernel::MvDotQ1), LowBit::Q1),
        QuantType::Q2_0G128 | QuantType::PQ2_0 => ((Kernel::MvQ2, Kernel::MvDotQ2), LowBit::Q2g128),
        QuantType::Q2_0G64 => ((Kernel::MvQ2g64, Kernel::MvDotQ2g64), LowBit::Q2g64),
        _ => return None,
    };
    Some((if int8 { k.1 } else { k.0 }, lb))
}

/// The load error for a tensor whose bytes are not whole rows of blocks.
fn bad_rows(name: &str, bytes: usize, n_in: usize, n_out: usize, qt: QuantType) -> Error {
    Error::Backend(format!(
        "{name}: {bytes} bytes are not {n_out} rows of {n_in} {} elements",
        qt.name()
    ))
}

impl VulkanBackend {
    /// Open the best Vulkan device; `allow_cpu` also accepts a CPU implementation (lavapipe).
    /// The activation mode comes from `BONSAI_VK_ACT` ([`ActMode`]).
    pub fn new(allow_cpu: bool, kv_type: KvType) -> Result<VulkanBackend> {
        Self::with_act(allow_cpu, kv_type, ActMode::from_env()?)
    }

    /// [`VulkanBackend::new`] with the activation mode given.
    pub fn with_act(allow_cpu: bool, kv_type: KvType, mode: ActMode) -> Result<VulkanBackend> {
        let vk = Vulkan::new(allow_cpu).map_err(|e| Error::BackendUnavailable(e.to_string()))?;
        let info = vk.info();
        let int8 = match mode {
            ActMode::F32 => false,
            ActMode::Auto => info.int_dot && info.int_dot_fast,
            ActMode::Int8 if info.int_dot => true,
            ActMode::Int8 => {
                return Err(Error::BackendUnavailable(format!(
                    "BONSAI_VK_ACT=int8: {} has no shaderIntegerDotProduct",
                    vk.name()
                )))
            }
        };
        Ok(VulkanBackend {
            vk,
            kv_type,
            scratch: Mutex::new(Vec::new()),
            eager_submit: std::env::var("BONSAI_VK_EAGER_SUBMIT").as_deref() == Ok("1"),
            rope: Mutex::new(None),
            int8,
        })
    }

    /// Test / debug import: overwrite the rows of `x` with `rows` (`[x.n, x.width]` host f32).
    pub fn write_act(&self, x: &mut VkAct, rows: &[f32]) -> Result<()> {
        if rows.len() != x.n * x.width {
            return Err(Error::Backend(format!(
                "write_act: {} values for {} rows × {}",
                rows.len(),
                x.n,
                x.width
            )));
        }
        self.vk.upload_f32(&x.buf, 0, rows).map_err(be)
    }

    /// Whether the low-bit mat-vecs take int8 activations (see [`ActMode`]).
    pub fn int8_activations(&self) -> bool {
        self.int8
    }

    /// Whether `device="auto"` should pick Vulkan: a loader and a non-CPU device are present.
    pub fn available() -> bool {
        Vulkan::gpu_available()
    }

    /// Record a block's commands (submitted later, or now with `BONSAI_VK_EAGER_SUBMIT=1`).
    fn rec(
        &self,
        f: impl FnOnce(&mut Cmd) -> bonsai_kernels_vulkan::Result<()>,
    ) -> bonsai_kernels_vulkan::Result<()> {
        self.vk.record(f)?;
        if self.eager_submit {
            self.vk.flush()?;
        }
        Ok(())
    }

    /// Scratch slots `0..sizes.len()` with at least `sizes[i]` f32 each.
    fn scratch(&self, sizes: &[usize]) -> Result<Scratch<'_>> {
        let mut g = self
            .scratch
            .lock()
            .map_err(|_| Error::Backend("vulkan: scratch lock poisoned".into()))?;
        if g.len() < sizes.len() {
            g.resize_with(sizes.len(), || None);
        }
        for (slot, &n) in g.iter_mut().zip(sizes) {
            if slot.as_ref().is_none_or(|b| b.size() < f4(n)) {
                *slot = None;
                *slot = Some(
                    self.vk
                        .alloc(f4(n.max(1)).next_power_of_two())
                        .map_err(be)?,
                );
            }
        }
        Ok(Scratch(g))
    }

    fn check_act(x: &VkAct, width: usize, what: &str) -> Result<()> {
        if x.width != width || x.buf.size() < f4(x.n * x.width) {
            return Err(Error::Backend(format!(
                "vulkan {what}: activation of {} rows × {} does not fit the model width {width}",
                x.n, x.width
            )));
        }
        Ok(())
    }

    fn gdn_run(
        &self,
        cfg: &TargetConfig,
        w: &GdnWeights<Self>,
        st: &mut VkGdn,
        x: &mut VkAct,
        mut rec: Option<&mut VkAct>,
    ) -> Result<()> {
        let d = dims(cfg);
        let (n, e) = (x.n, cfg.n_embd);
        Self::check_act(x, e, "gdn_block")?;
        let rw = gdn_rec_width(cfg);
        if let Some(r) = rec.as_deref_mut() {
            if r.buf.size() < f4(n * rw) {
                r.buf = self.vk.alloc(f4(n * rw)).map_err(be)?;
            }
            r.n = n;
            r.width = rw;
        }
        // slots: 0 xn [n, e] · 1 the in-projections: mixed [n, cd], z [n, vd], bb [n, hv],
        //        aa [n, hv] (`seg_layout`) · 2–4 unused
        //        5 conv out [n, cd] · 6 qk [n, 2·qk] · 7 g [n, hv] · 8 β [n, hv] · 9 o [n, vd]
        //        10 xn as int8 · 11 o as int8 (`q8_words`)
        let q8 = self.int8;
        let inp = [&w.qkv, &w.gate, &w.beta, &w.alpha];
        let (at, in_len) = seg_layout(&inp, n);
        let (o_mixed, o_z, o_bb, o_aa) = (f4(at[0]), f4(at[1]), f4(at[2]), f4(at[3]));
        let s = self.scratch(&[
            n * e,
            in_len,
            1,
            1,
            1,
            n * d.cd,
            n * 2 * d.qk,
            n * d.hv,
            n * d.hv,
            n * d.vd,
            q8_words(n, e),
            q8_words(n, d.vd),
        ])?;
        let eps = cfg.rms_eps;
        self.rec(|c| {
            norm_q8(
                c,
                q8,
                &x.buf,
                0,
                &w.attn_norm.buf,
                s.b(0),
                None,
                s.b(10),
                n,
                n,
                e,
                eps,
            );
            mv_group(c, &inp, s.b(0), s.b(10), s.b(1), n);
            let cg = d.cd.div_ceil(64) as u32;
            let p = Push::new()
                .addr(s.b(1), o_mixed)
                .addr(&w.conv1d.buf, 0)
                .addr(&st.conv, 0)
                .addr(s.b(5), 0)
                .u32(cg)
                .u32(d.cd as u32)
                .u32(d.kconv as u32)
                .u32(n as u32)
                .u32(d.cd as u32)
                .u32(1);
            c.dispatch(Kernel::GdnConv, cg, &p);
            let pg = (n * (2 * d.hk + 1)) as u32;
            let p = Push::new()
                .addr(s.b(5), 0)
                .addr(s.b(6), 0)
                .addr(s.b(1), o_bb)
                .addr(s.b(1), o_aa)
                .addr(&w.ssm_a.buf, 0)
                .addr(&w.dt_bias.buf, 0)
                .addr(s.b(7), 0)
                .addr(s.b(8), 0)
                .u32(pg)
                .u32(d.cd as u32)
                .u32(d.dk as u32)
                .u32(d.hk as u32)
                .u32(d.hv as u32)
                .f32(eps);
            c.dispatch(Kernel::GdnPrep, pg, &p);
            if let Some(r) = rec.as_deref() {
                // record row t: mixed ‖ k ‖ v ‖ g ‖ β
                for t in 0..n {
                    let base = f4(t * rw);
                    c.copy(s.b(1), o_mixed + f4(t * d.cd), &r.buf, base, f4(d.cd))?;
                    let at = base + f4(d.cd);
                    c.copy(s.b(6), f4(t * 2 * d.qk + d.qk), &r.buf, at, f4(d.qk))?;
                    let at = at + f4(d.qk);
                    c.copy(s.b(5), f4(t * d.cd + 2 * d.qk), &r.buf, at, f4(d.vd))?;
                    let at = at + f4(d.vd);
                    c.copy(s.b(7), f4(t * d.hv), &r.buf, at, f4(d.hv))?;
                    let at = at + f4(d.hv);
                    c.copy(s.b(8), f4(t * d.hv), &r.buf, at, f4(d.hv))?;
                }
            }
            let p = Push::new()
                .addr(&st.s, 0)
                .addr(s.b(6), 0)
                .addr(s.b(6), f4(d.qk))
                .addr(s.b(5), f4(2 * d.qk))
                .addr(s.b(7), 0)
                .addr(s.b(8), 0)
                .addr(s.b(9), 0)
                .u32(gdn_step_groups(d.hv, d.dv))
                .u32(d.dk as u32)
                .u32(d.dv as u32)
                .u32(d.hk as u32)
                .u32(n as u32)
                .u32((2 * d.qk) as u32)
                .u32((2 * d.qk) as u32)
                .u32(d.cd as u32)
                .u32(d.hv as u32)
                .u32(d.vd as u32)
                .u32(1);
            c.dispatch(Kernel::GdnStep, gdn_step_groups(d.hv, d.dv), &p);
            // gated norm per head, in place: o = rmsnorm(o) ⊙ ssm_norm ⊙ SiLU(z)
            norm_q8(
                c,
                q8,
                s.b(9),
                0,
                &w.ssm_norm.buf,
                s.b(9),
                Some((s.b(1), o_z)),
                s.b(11),
                n,
                n * d.hv,
                d.dv,
                eps,
            );
            mv(c, &w.ssm_out, s.b(9), s.b(11), &x.buf, n, true);
            Ok(())
        })
        .map_err(be)
    }
}

impl Backend for VulkanBackend {
    type Mat = VkMat;
    type Vector = VkVector;
    type Act = VkAct;
    type Kv = VkKv;
    type Gdn = VkGdn;

    fn name(&self) -> String {
        let act = if self.int8 { "int8" } else { "f32" };
        format!("{}, {act} activations", self.vk.name())
    }

    fn load_mat(&self, g: &Arc<Gguf>, name: &str, n_in: usize, n_out: usize) -> Result<VkMat> {
        let (idx, qt, _) = g.matrix(name, n_in, n_out)?;
        let data = g.tensor_data(&g.tensors()[idx])?;
        let lowbit = lowbit_kernel(qt, self.int8);
        let bad_bytes = || bad_rows(name, data.len(), n_in, n_out, qt);
        let (kernel, codes, scales) = match lowbit {
            Some((k, lb)) if self.int8 => {
                let (codes, scales) =
                    split_blocks_dot(lb, data, n_in, n_out).ok_or_else(bad_bytes)?;
                (
                    k,
                    Arc::new(self.vk.buffer_u32(&codes).map_err(be)?),
                    Arc::new(self.vk.buffer_u32(&scales).map_err(be)?),
                )
            }
            Some((k, lb)) => {
                let (codes, scales) = split_blocks(lb, data, n_in, n_out).ok_or_else(bad_bytes)?;
                (
                    k,
                    Arc::new(self.vk.buffer_u32(&codes).map_err(be)?),
                    Arc::new(self.vk.buffer_f32(&scales).map_err(be)?),
                )
            }
            None => {
                if n_in % 4 != 0 {
                    return Err(Error::Unsupported(format!(
                        "{name}: the Vulkan backend reads {} matrices as f32 in groups of 4 and \
                         needs n_in % 4 == 0, found {n_in}",
                        qt.name()
                    )));
                }
                // other types: f32 on the device, row by row from the file's blocks
                let rb = qt.row_bytes(n_in).ok_or_else(|| {
                    Error::Backend(format!(
                        "{name}: {n_in} is not a whole number of {} blocks",
                        qt.name()
                    ))
                })?;
                let mut f = vec![0f32; n_in * n_out]; // [n_out, n_in]
                for (o, row) in f.chunks_exact_mut(n_in).enumerate() {
                    dequantize_row(qt, &data[o * rb..(o + 1) * rb], row);
                }
                let words: Vec<u32> = f.iter().map(|v| v.to_bits()).collect();
                (
                    Kernel::MvF32,
                    Arc::new(self.vk.buffer_u32(&words).map_err(be)?),
                    Arc::new(self.vk.alloc(4).map_err(be)?),
                )
            }
        };
        Ok(VkMat {
            kernel,
            dot: kernel.needs_int_dot(),
            codes,
            scales,
            codes_off: 0,
            scales_off: 0,
            row0: 0,
            n_in,
            n_out,
            g: g.clone(),
            idx,
            qt,
        })
    }

    /// With int8 activations, low-bit matrices of one kind and one input width go side by side
    /// into one code buffer and one scale buffer (rows in order), so `mv_group` computes them
    /// with one dispatch; anything else loads one by one.
    fn load_mats(&self, g: &Arc<Gguf>, specs: &[(&str, usize, usize)]) -> Result<Vec<VkMat>> {
        let one_by_one = || -> Result<Vec<VkMat>> {
            specs
                .iter()
                .map(|&(name, n_in, n_out)| self.load_mat(g, name, n_in, n_out))
                .collect()
        };
        if !self.int8 || specs.len() < 2 || specs.len() > 4 {
            return one_by_one();
        }
        let mut metas = Vec::with_capacity(specs.len());
        for &(name, n_in, n_out) in specs {
            let (idx, qt, _) = g.matrix(name, n_in, n_out)?;
            metas.push((idx, qt, lowbit_kernel(qt, true)));
        }
        let (k0, n_in) = (metas[0].2, specs[0].1);
        if k0.is_none() || metas.iter().any(|m| m.2 != k0) || specs.iter().any(|s| s.1 != n_in) {
            return one_by_one();
        }
        let (kernel, lb) = k0.expect("checked");
        let (mut codes, mut scales) = (Vec::new(), Vec::new());
        let mut rows = Vec::with_capacity(specs.len()); // (first row, first code word, first scale word)
        let mut row0 = 0;
        for (&(name, n_in, n_out), &(idx, qt, _)) in specs.iter().zip(&metas) {
            let data = g.tensor_data(&g.tensors()[idx])?;
            let (c, sc) = split_blocks_dot(lb, data, n_in, n_out)
                .ok_or_else(|| bad_rows(name, data.len(), n_in, n_out, qt))?;
            rows.push((row0, codes.len(), scales.len()));
            row0 += n_out;
            codes.extend_from_slice(&c);
            scales.extend_from_slice(&sc);
        }
        let codes = Arc::new(self.vk.buffer_u32(&codes).map_err(be)?);
        let scales = Arc::new(self.vk.buffer_u32(&scales).map_err(be)?);
        Ok(specs
            .iter()
            .zip(&metas)
            .zip(rows)
            .map(
                |((&(_, n_in, n_out), &(idx, qt, _)), (row0, cw, sw))| VkMat {
                    kernel,
                    dot: true,
                    codes: codes.clone(),
                    scales: scales.clone(),
                    codes_off: f4(cw),
                    scales_off: f4(sw),
                    row0,
                    n_in,
                    n_out,
                    g: g.clone(),
                    idx,
                    qt,
                },
            )
            .collect())
    }

    fn load_vector(&self, g: &Arc<Gguf>, name: &str, n: usize) -> Result<VkVector> {
        let v = g.vector(name, n)?;
        Ok(VkVector {
            buf: self.vk.buffer_f32(&v).map_err(be)?,
        })
    }

    fn new_act(&self, n: usize, width: usize) -> VkAct {
        VkAct {
            n,
            width,
            buf: self
                .vk
                .alloc(f4(n * width))
                .expect("vulkan: activation allocation failed"),
        }
    }

    fn new_kv(&self, cfg: &TargetConfig, n_ctx: usize) -> Result<VkKv> {
        let width = cfg.n_head_kv * cfg.head_dim;
        if cfg.head_dim > MAX_HD || cfg.head_dim % 2 != 0 {
            return Err(Error::Unsupported(format!(
                "the Vulkan backend handles even head dims up to {MAX_HD}, the model has {}",
                cfg.head_dim
            )));
        }
        let q8 = self.kv_type == KvType::Q8_0;
        if q8 && cfg.head_dim % 32 != 0 {
            return Err(Error::InvalidRequest(format!(
                "kv_cache=\"q8_0\" needs a head dim that is a multiple of 32, the model has {}",
                cfg.head_dim
            )));
        }
        let (codes, scales) = kv_bytes(q8, width, n_ctx);
        Ok(VkKv {
            k: self.vk.alloc(codes + scales).map_err(be)?,
            v: self.vk.alloc(codes + scales).map_err(be)?,
            len: 0,
            n_ctx,
            width,
            q8,
            sc_off: n_ctx * width / 4, // q8: the scales follow n_ctx·width code bytes
        })
    }

    fn new_gdn(&self, cfg: &TargetConfig) -> Result<VkGdn> {
        let d = dims(cfg);
        if d.dk > MAX_DK
            || d.dk % 4 != 0
            || d.hk == 0
            || d.hv % d.hk != 0
            || cfg.ssm_inner % d.hv.max(1) != 0
        {
            return Err(Error::Unsupported(format!(
                "the Vulkan backend handles GDN key dims up to {MAX_DK} (multiples of 4) with H_v a \
                 multiple of H_k; the model has d_k {}, H_k {}, H_v {}",
                d.dk, d.hk, d.hv
            )));
        }
        Ok(VkGdn {
            conv: self.vk.alloc(f4((d.kconv.max(1) - 1) * d.cd)).map_err(be)?,
            s: self.vk.alloc(f4(d.hv * d.dk * d.dv)).map_err(be)?,
        })
    }

    fn reset_gdn(&self, st: &mut VkGdn) {
        self.rec(|c| {
            c.fill(&st.conv, 0, st.conv.size(), 0);
            c.fill(&st.s, 0, st.s.size(), 0);
            Ok(())
        })
        .expect("vulkan: reset_gdn");
    }

    fn copy_gdn(&self, src: &VkGdn, dst: &mut VkGdn) {
        self.rec(|c| {
            c.copy(&src.conv, 0, &dst.conv, 0, src.conv.size())?;
            c.copy(&src.s, 0, &dst.s, 0, src.s.size())
        })
        .expect("vulkan: copy_gdn");
    }

    fn truncate_kv(&self, kv: &mut VkKv, len: usize) {
        kv.len = kv.len.min(len);
    }

    fn copy_kv(&self, src: &VkKv, dst: &mut VkKv) {
        assert!(
            src.len <= dst.n_ctx && src.q8 == dst.q8 && src.width == dst.width,
            "copy_kv: destination of another shape"
        );
        let (codes, scales) = src.row_bytes(src.len);
        let (s_at, d_at) = (f4(src.sc_off), f4(dst.sc_off));
        self.rec(|c| {
            c.copy(&src.k, 0, &dst.k, 0, codes)?;
            c.copy(&src.v, 0, &dst.v, 0, codes)?;
            c.copy(&src.k, s_at, &dst.k, d_at, scales)?;
            c.copy(&src.v, s_at, &dst.v, d_at, scales)
        })
        .expect("vulkan: copy_kv");
        dst.len = src.len;
    }

    fn gdn_to_host(&self, st: &VkGdn) -> Result<Vec<f32>> {
        let (nc, ns) = ((st.conv.size() / 4) as usize, (st.s.size() / 4) as usize);
        let mut out = vec![0f32; nc + ns];
        self.vk
            .download_f32(&st.conv, 0, &mut out[..nc])
            .map_err(be)?;
        self.vk.download_f32(&st.s, 0, &mut out[nc..]).map_err(be)?;
        Ok(out)
    }

    fn kv_to_host(&self, kv: &VkKv) -> Result<(usize, Vec<f32>)> {
        let n = kv.len * kv.width;
        let (codes, scales) = kv.row_bytes(kv.len);
        let mut out = Vec::with_capacity(2 * n); // [K rows ‖ V rows] f32
        for b in [&kv.k, &kv.v] {
            let mut raw = vec![0u8; codes as usize];
            self.vk.download(b, 0, &mut raw).map_err(be)?;
            if kv.q8 {
                let mut d = vec![0f32; (scales / 4) as usize];
                self.vk.download_f32(b, kv.sc_off, &mut d).map_err(be)?;
                out.extend(
                    raw.iter()
                        .enumerate()
                        .map(|(i, &c)| c as i8 as f32 * d[i / 32]),
                );
            } else {
                out.extend(
                    raw.chunks_exact(2)
                        .map(|h| half::f16::from_le_bytes([h[0], h[1]]).to_f32()),
                );
            }
        }
        Ok((kv.len, out))
    }

    fn gdn_block_rec(
        &self,
        cfg: &TargetConfig,
        w: &GdnWeights<Self>,
        st: &mut VkGdn,
        x: &mut VkAct,
        s: &Step,
        rec: &mut VkAct,
    ) -> Result<()> {
        if s.gdn_mode != super::GdnMode::Recurrent {
            return Err(Error::Backend(
                "gdn_block_rec records recurrent steps only".into(),
            ));
        }
        self.gdn_run(cfg, w, st, x, Some(rec))
    }

    fn gdn_replay(&self, cfg: &TargetConfig, st: &mut VkGdn, rec: &VkAct, n: usize) -> Result<()> {
        let d = dims(cfg);
        let rw = gdn_rec_width(cfg);
        if n > rec.n || rec.width != rw {
            return Err(Error::Backend(format!(
                "gdn_replay: {n} rows requested, the record holds {} rows of width {}",
                rec.n, rec.width
            )));
        }
        if n == 0 {
            return Ok(());
        }
        self.rec(|c| {
            let cg = d.cd.div_ceil(64) as u32;
            let p = Push::new()
                .addr(&rec.buf, 0)
                .null()
                .addr(&st.conv, 0)
                .null()
                .u32(cg)
                .u32(d.cd as u32)
                .u32(d.kconv as u32)
                .u32(n as u32)
                .u32(rw as u32)
                .u32(0);
            c.dispatch(Kernel::GdnConv, cg, &p);
            // the state update does not read q: k in its place
            let k_at = f4(d.cd);
            let p = Push::new()
                .addr(&st.s, 0)
                .addr(&rec.buf, k_at)
                .addr(&rec.buf, k_at)
                .addr(&rec.buf, f4(d.cd + d.qk))
                .addr(&rec.buf, f4(d.cd + d.qk + d.vd))
                .addr(&rec.buf, f4(d.cd + d.qk + d.vd + d.hv))
                .null()
                .u32(gdn_step_groups(d.hv, d.dv))
                .u32(d.dk as u32)
                .u32(d.dv as u32)
                .u32(d.hk as u32)
                .u32(n as u32)
                .u32(rw as u32)
                .u32(rw as u32)
                .u32(rw as u32)
                .u32(rw as u32)
                .u32(0)
                .u32(0);
            c.dispatch(Kernel::GdnStep, gdn_step_groups(d.hv, d.dv), &p);
            Ok(())
        })
        .map_err(be)
    }

    fn embed(&self, table: &VkMat, ids: &[u32], x: &mut VkAct) -> Result<()> {
        let e = table.n_in;
        Self::check_act(x, e, "embed")?;
        if ids.len() > x.n {
            return Err(Error::Backend(format!(
                "vulkan embed: {} ids for {} rows",
                ids.len(),
                x.n
            )));
        }
        let rb = table.qt.row_bytes(e).expect("validated at load");
        let data = table.g.tensor_data(&table.g.tensors()[table.idx])?;
        let mut rows = vec![0f32; ids.len() * e]; // [n, n_embd]
        for (t, &id) in ids.iter().enumerate() {
            let id = id as usize;
            if id >= table.n_out {
                return Err(Error::InvalidRequest(format!(
                    "token id {id} out of range ({})",
                    table.n_out
                )));
            }
            dequantize_row(
                table.qt,
                &data[id * rb..(id + 1) * rb],
                &mut rows[t * e..(t + 1) * e],
            );
        }
        self.vk.upload_f32(&x.buf, 0, &rows).map_err(be)
    }

    fn gdn_block(
        &self,
        cfg: &TargetConfig,
        w: &GdnWeights<Self>,
        st: &mut VkGdn,
        x: &mut VkAct,
        _s: &Step,
    ) -> Result<()> {
        // GdnMode::Chunked (prefill) runs the recurrent rule row by row: the same math (MODEL.md
        // §3.3 is an exact reformulation), one dispatch over all the rows.
        self.gdn_run(cfg, w, st, x, None)
    }

    fn attn_block(
        &self,
        cfg: &TargetConfig,
        w: &AttnWeights<Self>,
        kv: &mut VkKv,
        x: &mut VkAct,
        s: &Step,
    ) -> Result<()> {
        let (n, e) = (x.n, cfg.n_embd);
        Self::check_act(x, e, "attn_block")?;
        let (nh, nkv, hd) = (cfg.n_head, cfg.n_head_kv, cfg.head_dim);
        if kv.len != s.pos {
            return Err(Error::Backend(format!(
                "KV cache holds {} rows, step starts at {}",
                kv.len, s.pos
            )));
        }
        if s.pos + n > kv.n_ctx {
            return Err(Error::ContextOverflow(format!(
                "{} positions requested, the KV cache holds {}",
                s.pos + n,
                kv.n_ctx
            )));
        }
        let half = cfg.n_rot / 2;
        let key = (s.pos, n, cfg.n_rot, cfg.rope_base.to_bits());
        let mut rope_slot = self
            .rope
            .lock()
            .map_err(|_| Error::Backend("vulkan: rope lock poisoned".into()))?;
        let rope = if rope_slot.as_ref().is_some_and(|(k, _)| *k == key) {
            None // this forward's table is on the device already
        } else {
            // base^(−2d/n_rot) per rotated pair, the same for every row
            let freq: Vec<f64> = (0..half)
                .map(|d| (cfg.rope_base as f64).powf(-2.0 * d as f64 / cfg.n_rot as f64))
                .collect();
            let mut rope = Vec::with_capacity(n * half * 2); // [n, n_rot/2, (cos, sin)]
            for t in 0..n {
                for &f in &freq {
                    let th = (s.pos + t) as f64 * f;
                    rope.push(th.cos() as f32);
                    rope.push(th.sin() as f32);
                }
            }
            let need = f4(rope.len().max(1));
            if rope_slot.as_ref().is_none_or(|(_, b)| b.size() < need) {
                *rope_slot = None;
                let b = self.vk.alloc(need.next_power_of_two()).map_err(be)?;
                *rope_slot = Some((key, b));
            }
            Some(rope)
        };
        let (k, rb) = rope_slot.as_mut().expect("set above");
        *k = key;
        let rb: &Buffer = rb;
        // slots: 0 xn [n, e] · 1 qf [n, H·2·hd], kf [n, kvw], vf [n, kvw] (`seg_layout`)
        //        2, 3, 6 unused · 4 q [n, H·hd] · 5 attention out [n, H·hd] · 7 xn as int8
        //        8 out as int8
        let q8 = self.int8;
        let inp = [&w.q, &w.k, &w.v];
        let (at, in_len) = seg_layout(&inp, n);
        let (o_q, o_k, o_v) = (f4(at[0]), f4(at[1]), f4(at[2]));
        let sc = self.scratch(&[
            n * e,
            in_len,
            1,
            1,
            n * nh * hd,
            n * nh * hd,
            1,
            q8_words(n, e),
            q8_words(n, nh * hd),
        ])?;
        let eps = cfg.rms_eps;
        self.rec(|c| {
            if let Some(rope) = &rope {
                c.update(rb, 0, bonsai_kernels_vulkan::f32_bytes(rope))?;
            }
            norm_q8(
                c,
                q8,
                &x.buf,
                0,
                &w.attn_norm.buf,
                sc.b(0),
                None,
                sc.b(7),
                n,
                n,
                e,
                eps,
            );
            mv_group(c, &inp, sc.b(0), sc.b(7), sc.b(1), n);
            let pg = (n * (nh + 2 * nkv)) as u32;
            let p = Push::new()
                .addr(sc.b(1), o_q)
                .addr(sc.b(1), o_k)
                .addr(sc.b(1), o_v)
                .addr(&w.q_norm.buf, 0)
                .addr(&w.k_norm.buf, 0)
                .addr(rb, 0)
                .addr(sc.b(4), 0)
                .addr(&kv.k, 0)
                .addr(&kv.v, 0)
                .u32(pg)
                .u32(nh as u32)
                .u32(nkv as u32)
                .u32(hd as u32)
                .u32(cfg.n_rot as u32)
                .u32(s.pos as u32)
                .f32(eps)
                .u32(kv.q8 as u32)
                .u32(kv.sc_off as u32);
            c.dispatch(Kernel::AttnPrep, pg, &p);
            let ag = (n * nh) as u32;
            let p = Push::new()
                .addr(sc.b(4), 0)
                .addr(sc.b(1), o_q)
                .addr(&kv.k, 0)
                .addr(&kv.v, 0)
                .addr(sc.b(5), 0)
                .u32(ag)
                .u32(nh as u32)
                .u32(nkv as u32)
                .u32(hd as u32)
                .u32(s.pos as u32)
                .f32(1.0 / (hd as f32).sqrt())
                .u32(kv.q8 as u32)
                .u32(kv.sc_off as u32);
            c.dispatch(Kernel::Attn, ag, &p);
            quant(c, q8, sc.b(5), sc.b(8), n, nh * hd);
            mv(c, &w.out, sc.b(5), sc.b(8), &x.buf, n, true);
            Ok(())
        })
        .map_err(be)?;
        kv.len = s.pos + n;
        Ok(())
    }

    fn mlp_block(&self, cfg: &TargetConfig, w: &MlpWeights<Self>, x: &mut VkAct) -> Result<()> {
        let (n, e, ff) = (x.n, cfg.n_embd, cfg.n_ff);
        Self::check_act(x, e, "mlp_block")?;
        // slots: 0 u [n, e] · 1 gate [n, n_ff], up [n, n_ff] (`seg_layout`; the SwiGLU
        //        overwrites the gate) · 2 unused · 3 u as int8 · 4 SwiGLU as int8
        let q8 = self.int8;
        let inp = [&w.gate, &w.up];
        let (at, in_len) = seg_layout(&inp, n);
        let (o_gate, o_up) = (f4(at[0]), f4(at[1]));
        let s = self.scratch(&[n * e, in_len, 1, q8_words(n, e), q8_words(n, ff)])?;
        self.rec(|c| {
            norm_q8(
                c,
                q8,
                &x.buf,
                0,
                &w.post_norm.buf,
                s.b(0),
                None,
                s.b(3),
                n,
                n,
                e,
                cfg.rms_eps,
            );
            mv_group(c, &inp, s.b(0), s.b(3), s.b(1), n);
            let count = n * ff;
            let groups = count.div_ceil(256) as u32;
            let p = Push::new()
                .addr(s.b(1), o_gate)
                .addr(s.b(1), o_up)
                .addr(s.b(1), o_gate)
                .u32(groups)
                .u32(count as u32);
            c.dispatch(Kernel::Swiglu, groups, &p);
            quant(c, q8, s.b(1), s.b(4), n, ff);
            mv(c, &w.down, s.b(1), s.b(4), &x.buf, n, true); // o_gate = 0
            Ok(())
        })
        .map_err(be)
    }

    fn head(
        &self,
        cfg: &TargetConfig,
        norm_w: &VkVector,
        out: &VkMat,
        x: &VkAct,
        rows: Range<usize>,
        logits: &mut [f32],
    ) -> Result<()> {
        let e = cfg.n_embd;
        Self::check_act(x, e, "head")?;
        let nr = rows.len();
        if rows.end > x.n || logits.len() != nr * out.n_out {
            return Err(Error::Backend(format!(
                "vulkan head: rows {rows:?} of {} with {} logits",
                x.n,
                logits.len()
            )));
        }
        // slots: 0 xn [rows, e] · 1 logits [rows, n_vocab] · 2 xn as int8
        let s = self.scratch(&[nr * e, nr * out.n_out, q8_words(nr, e)])?;
        self.rec(|c| {
            norm_q8(
                c,
                self.int8,
                &x.buf,
                f4(rows.start * e),
                &norm_w.buf,
                s.b(0),
                None,
                s.b(2),
                nr,
                nr,
                e,
                cfg.rms_eps,
            );
            mv(c, out, s.b(0), s.b(2), s.b(1), nr, false);
            Ok(())
        })
        .map_err(be)?;
        self.vk.download_f32(s.b(1), 0, logits).map_err(be)
    }

    fn read_row(&self, x: &VkAct, row: usize, out: &mut [f32]) {
        self.vk
            .download_f32(&x.buf, row * x.width, out)
            .expect("vulkan: read_row");
    }

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
