//! Launchers of `kernels/spec.cu`: the DSpark round's GDN verify record and replay rollback
//! (MODEL.md §4.9 option C), and the DSpark drafter's ops (Q4_1 mat-vec, per-head norm + full NEOX
//! RoPE into a ring cache, non-causal block attention, the Markov step).

use crate::{cdiv, push_seg_args, Arg, CudaError, Gpu, MvSeg, Result, MAX_ROWS};

/// Most matrices one [`Gpu::mv_q41`] launch covers.
pub const Q41_MAX_SEGS: usize = 3;
/// Vocab entries per warp of [`Gpu::dsp_markov_scores`] (`DSP_MV` in the source).
const DSP_MARKOV_PER_WARP: usize = 4;
/// Most GDN layers one `gdn_replay_layers` launch replays (`REPLAY_MAX_LAYERS` in the source).
pub const REPLAY_MAX_LAYERS: usize = 64;
/// Threads of a replay block (`REPLAY_THREADS` in the source).
const REPLAY_THREADS: usize = 128;
/// Most keys per chunk of the per-head block attention ([`DspAttnKernel::PerHead`]; `DSP_CH` in
/// the source).
pub const DSP_ATTN_CHUNK: usize = 256;
/// Most chunks [`DspAttnKernel::PerHead`] spreads a short context over.
pub const DSP_ATTN_SPREAD: usize = 8;
/// Most keys per chunk of [`DspAttnKernel::PerKvHead`] (`DSP_GCH` in the source).
pub const DSP_ATTN_KV_CHUNK: usize = 128;
/// Most chunks [`DspAttnKernel::PerKvHead`] spreads a context over before they reach
/// [`DSP_ATTN_KV_CHUNK`] keys (`DSP_GSPREAD` in the source).
pub const DSP_ATTN_KV_SPREAD: usize = 32;
/// Blocks [`DspAttnKernel::PerKvHead`] aims to fill by splitting the query rows into groups
/// (about four blocks per SM of an H200: a block's score and weighted-V loops issue an FMA chain
/// per row, so the SM needs several blocks' warps to keep its pipes busy); `BONSAI_CUDA_DSP_KV_SLOTS`
/// (read once) overrides it for measurements.
const DSP_ATTN_KV_SLOTS: usize = 512;

fn dsp_attn_kv_slots_target() -> usize {
    static T: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *T.get_or_init(|| {
        std::env::var("BONSAI_CUDA_DSP_KV_SLOTS")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|&v: &usize| (1..=65535).contains(&v))
            .unwrap_or(DSP_ATTN_KV_SLOTS)
    })
}
/// Shared memory of one [`DspAttnKernel::PerKvHead`] block's tiles (`DSP_GSMEM` floats, static in
/// the kernel): past it the query rows are split into more groups.
const DSP_ATTN_KV_SMEM: usize = 40 << 10;

/// How [`Gpu::dsp_attention`]'s first phase cuts the keys into chunks and assigns the blocks.
/// Both give the same attention within float rounding; each is bit-stable on its own (eager and
/// graph launches agree).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DspAttnKernel {
    /// `dsp_attn_part*`: a block per (q head, chunk of up to [`DSP_ATTN_CHUNK`] keys), the keys
    /// spread over up to `spread` chunks (1..=[`DSP_ATTN_SPREAD`]; 1: one chunk per 256 keys, the
    /// layout before 2026-12-04). Every q head reads its kv head's keys and values itself.
    PerHead { spread: usize },
    /// `dsp_attn_kv`: a block per (kv head, chunk of up to [`DSP_ATTN_KV_CHUNK`] keys, group of
    /// query rows), the keys spread over up to [`DSP_ATTN_KV_SPREAD`] chunks: all `nh / nkv · n`
    /// query rows of a kv head share one read of each key and value row. 1.01–1.22× faster drafts
    /// from 64 to 4,000 context rows on the H200; the GPU drafter's default since 2026-12-04 (the
    /// draft stalls that had kept it opt-in were a cold page cache under the host's embedding
    /// rows, with either kernel — `crates/kernels-cuda/README.md`).
    PerKvHead,
}

impl DspAttnKernel {
    /// (spread, most keys per chunk) of this kernel's chunking.
    pub fn chunking(self) -> (usize, usize) {
        match self {
            DspAttnKernel::PerHead { spread } => (spread, DSP_ATTN_CHUNK),
            DspAttnKernel::PerKvHead => (DSP_ATTN_KV_SPREAD, DSP_ATTN_KV_CHUNK),
        }
    }
}

/// Keys per chunk of [`Gpu::dsp_attention`] for `t` keys (`dsp_chunk_len` in the source): `t`
/// spread over the kernel's spread, rounded up to a multiple of 32, within 32 and the kernel's
/// most keys per chunk. A function of (`t`, kernel) alone, so eager and graph launches agree bit
/// for bit.
pub fn dsp_attn_chunk_len(t: usize, k: DspAttnKernel) -> usize {
    let (spread, chmax) = k.chunking();
    (t.div_ceil(spread.max(1)).div_ceil(32) * 32).clamp(32, chmax)
}

/// Chunks of [`Gpu::dsp_attention`] that hold keys, for `t` keys (`dsp_chunks` in the source).
pub fn dsp_attn_chunks(t: usize, k: DspAttnKernel) -> usize {
    t.div_ceil(dsp_attn_chunk_len(t, k))
}

/// The most chunks any key count up to `t_max` uses with any [`DspAttnKernel`]: the partials
/// stride and the graph's grid.
pub fn dsp_attn_max_chunks(t_max: usize) -> usize {
    // up to spread · chmax keys a chunk holds ≥ t / spread of them (and ≥ 32); past that every
    // chunk but the last is full
    let most = |spread: usize, chmax: usize| {
        spread
            .min(t_max.div_ceil(32))
            .max(t_max.div_ceil(chmax))
            .max(1)
    };
    most(DSP_ATTN_SPREAD, DSP_ATTN_CHUNK).max(most(DSP_ATTN_KV_SPREAD, DSP_ATTN_KV_CHUNK))
}

/// f32 elements of [`Gpu::dsp_attention`]'s partials scratch for `n` rows, `nh` heads of `hd`, up
/// to `t` keys: `[n, nh, dsp_attn_max_chunks(t), hd + 2]`.
pub fn dsp_attn_part_floats(n: usize, nh: usize, hd: usize, t: usize) -> usize {
    n * nh * dsp_attn_max_chunks(t) * (hd + 2)
}

/// Shared memory (bytes) of a [`DspAttnKernel::PerKvHead`] block's tiles holding `rb` query rows
/// of head dim `hd`: `qs [rb][hd] | ks [32][hd + 4] | sc [rb][DSP_ATTN_KV_CHUNK]` f32.
pub fn dsp_attn_kv_smem(rb: usize, hd: usize) -> usize {
    4 * (rb * hd + 32 * (hd + 4) + rb * DSP_ATTN_KV_CHUNK)
}

/// Most query rows one thread of [`DspAttnKernel::PerKvHead`]'s weighted V holds (`DSP_GRV`).
const DSP_ATTN_KV_ROWS_PER_THREAD: usize = 12;

/// The fewest query-row groups of [`DspAttnKernel::PerKvHead`] for `r` rows of head dim `hd`:
/// each group's tiles within [`DSP_ATTN_KV_SMEM`] of shared memory, and its rows within what the
/// weighted V's threads hold (256 / hd row subsets of [`DSP_ATTN_KV_ROWS_PER_THREAD`] rows).
fn dsp_attn_kv_min_groups(r: usize, hd: usize) -> usize {
    let most_rows = (256 / hd) * DSP_ATTN_KV_ROWS_PER_THREAD;
    (1..=r)
        .find(|&ng| {
            let rb = r.div_ceil(ng);
            rb <= most_rows && dsp_attn_kv_smem(rb, hd) <= DSP_ATTN_KV_SMEM
        })
        .unwrap_or(r)
}

/// The slots (grid.y) of a [`DspAttnKernel::PerKvHead`] launch over `nch` chunks for `nkv` kv heads
/// and `r` query rows per kv head, at least `ngmin` row groups per chunk: enough groups that the
/// grid reaches about [`DSP_ATTN_KV_SLOTS`] blocks, and never more groups than rows. The kernel
/// derives the groups from (slots, its own chunk count), so a graph's grid sized for a full ring
/// splits a short context's rows too.
fn dsp_attn_kv_slots(nch: usize, nkv: usize, r: usize, ngmin: usize, target: usize) -> usize {
    let want = target.div_ceil(nkv * nch).clamp(ngmin, r.max(ngmin));
    nch * want
}

/// One head set of [`Gpu::dsp_norm_rope_sets`]: `heads` heads of `src` (`[n, src_stride]`) normed
/// with `w` into `dst` (`[*, dst_stride]`).
#[derive(Clone, Copy, Debug)]
pub struct NormRopeSet {
    pub src: u64,
    pub src_stride: usize,
    pub heads: usize,
    pub w: u64,
    pub dst: u64,
    pub dst_stride: usize,
}

/// The element type of a [`Gpu::dsp_markov_scores`] plane.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PlaneKind {
    F32 = 0,
    Bf16 = 1,
    F16 = 2,
}

/// The device parameters a captured draft or stage reads at run time (`DSP_PAR_*` in the source):
/// `i32` slots `[pos0, off, len, slot]`, written before each replay. `pos0` is the first row's
/// position ([`Gpu::dsp_norm_rope`]), `off` / `len` the live context rows of the ring
/// ([`Gpu::dsp_attention`]), `slot` the ring row a stage writes its first row to
/// ([`Gpu::dsp_norm_rope`] with a ring, [`Gpu::dsp_copy_rows`]).
pub struct DspPar;

impl DspPar {
    /// i32 slots.
    pub const SLOTS: usize = 4;
    pub const POS: usize = 0;
    pub const OFF: usize = 1;
    pub const LEN: usize = 2;
    pub const SLOT: usize = 3;
}

/// A ring of `cap` rows (`cap == 0`: plain rows `0..n`) that a write starts at row `slot0`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ring {
    pub cap: usize,
    pub slot0: usize,
}

impl Ring {
    /// Rows `0..n` of a plain buffer.
    pub const PLAIN: Ring = Ring { cap: 0, slot0: 0 };
}

/// f32 elements of one GDN verify-record row: `mixed` (conv_dim) ‖ `k` (hk·dk) ‖ `v` (hv·dv) ‖ `g`
/// (hv) ‖ `β` (hv), with `conv_dim = 2·hk·dk + hv·dv`.
pub fn gdn_rec_width(hk: usize, hv: usize, dk: usize, dv: usize) -> usize {
    let conv_dim = 2 * hk * dk + hv * dv;
    conv_dim + hk * dk + hv * dv + 2 * hv
}

/// The checks and parameter list both Q4_1 launchers share: the segments (as `push_seg_args`,
/// `rpw` rows per unit), then q, d, s, n_in, n, accumulate. `None` when no segment has a row;
/// else the arguments and the unit count.
fn q41_args(
    name: &str,
    segs: &[MvSeg],
    (q, d, s): (u64, u64, u64),
    n_in: usize,
    n: usize,
    accumulate: bool,
    rpw: usize,
) -> Result<Option<(Vec<Arg>, usize)>> {
    if !(1..=MAX_ROWS).contains(&n) || !(1..=Q41_MAX_SEGS).contains(&segs.len()) {
        return Err(CudaError(format!(
            "{name}: {n} rows / {} segments (at most {MAX_ROWS} / {Q41_MAX_SEGS})",
            segs.len()
        )));
    }
    if n_in == 0 || n_in % 32 != 0 || n_in > i32::MAX as usize {
        return Err(CudaError(format!(
            "{name}: n_in {n_in} is not a positive multiple of 32"
        )));
    }
    let mut args = Vec::with_capacity(4 * Q41_MAX_SEGS + 7);
    let units = push_seg_args(&mut args, segs, Q41_MAX_SEGS, rpw);
    if units == 0 {
        return Ok(None);
    }
    args.extend([
        Arg::P(q),
        Arg::P(d),
        Arg::P(s),
        Arg::I(n_in as i32),
        Arg::I(n as i32),
        Arg::I(accumulate as i32),
    ]);
    Ok(Some((args, units)))
}

impl Gpu {
    /// Write `n` verify-record rows `rec[t] = mixed[t] ‖ k[t] ‖ v[t] ‖ g[t] ‖ beta[t]` (plain copies).
    /// mixed `[n, 2·hk·dk + hv·dv]`, k `[n, hk·dk]`, v `[n, hv·dv]`, g / beta `[n, hv]`, rec
    /// `[n, gdn_rec_width]`, all f32.
    #[allow(clippy::too_many_arguments)]
    pub fn gdn_rec_write(
        &self,
        mixed: u64,
        k: u64,
        v: u64,
        g: u64,
        beta: u64,
        hk: usize,
        hv: usize,
        dk: usize,
        dv: usize,
        n: usize,
        rec: u64,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let conv_dim = 2 * hk * dk + hv * dv;
        let width = gdn_rec_width(hk, hv, dk, dv);
        if width > i32::MAX as usize || n > u16::MAX as usize {
            return Err(CudaError(format!(
                "gdn_rec_write: record of {n} rows × {width} is too large"
            )));
        }
        self.launch(
            self.f.gdn_rec_write,
            (cdiv(width, 256), n as u32, 1),
            (256, 1, 1),
            &[
                Arg::P(mixed),
                Arg::P(k),
                Arg::P(v),
                Arg::P(g),
                Arg::P(beta),
                Arg::I(conv_dim as i32),
                Arg::I((hk * dk) as i32),
                Arg::I((hv * dv) as i32),
                Arg::I(hv as i32),
                Arg::P(rec),
            ],
        )
    }

    /// Advance a GDN layer's recurrent state `s` (`[hv, dk, dv]`) and conv window `conv_state`
    /// (`[kconv − 1, conv_dim]`, oldest first) over the first `n` rows of the verify record `rec`
    /// (`[≥ n, rec_w]`, [`gdn_rec_width`]), with no outputs. The state equals what `gdn_conv` +
    /// `gdn_step` leave after the same rows, bit for bit. Same limits as [`Gpu::gdn_step`], and a
    /// conv kernel of at most 8 taps. With `src = Some((s_src, conv_src))` the state and window
    /// are read from there (the round's snapshot) and the result written to `s` / `conv_state`:
    /// a restore copy and the replay in one launch.
    #[allow(clippy::too_many_arguments)]
    pub fn gdn_replay(
        &self,
        s: u64,
        conv_state: u64,
        src: Option<(u64, u64)>,
        rec: u64,
        rec_w: usize,
        hk: usize,
        hv: usize,
        dk: usize,
        dv: usize,
        kconv: usize,
        n: usize,
    ) -> Result<()> {
        replay_shape_ok("gdn_replay", rec_w, hk, hv, dk, dv, kconv)?;
        if n == 0 && src.is_none() {
            return Ok(());
        }
        let mut args = vec![
            Arg::P(s),
            Arg::P(conv_state),
            Arg::P(src.map_or(s, |(ss, _)| ss)),
            Arg::P(src.map_or(conv_state, |(_, cs)| cs)),
            Arg::P(rec),
        ];
        args.extend(replay_dims(rec_w, hk, hv, dk, dv, kconv, n));
        self.launch(
            self.f.gdn_replay,
            replay_grid(hk, hv, dk, dv, 1),
            (REPLAY_THREADS as u32, 1, 1),
            &args,
        )
    }
}

impl Gpu {
    /// [`Gpu::gdn_replay`] of every layer of `tab` in one launch per [`REPLAY_MAX_LAYERS`]
    /// layers (they are independent): layer `z`'s state, conv window, snapshot state, snapshot
    /// window and record are the five device pointers `tab[5z..5z + 5]` (a snapshot equal to the
    /// state replays in place). Every layer has the shapes given and its record `n` valid rows.
    /// The same bits as a `gdn_replay` per layer (one kernel body).
    #[allow(clippy::too_many_arguments)]
    pub fn gdn_replay_layers(
        &self,
        tab: &[[u64; 5]],
        rec_w: usize,
        hk: usize,
        hv: usize,
        dk: usize,
        dv: usize,
        kconv: usize,
        n: usize,
    ) -> Result<()> {
        replay_shape_ok("gdn_replay_layers", rec_w, hk, hv, dk, dv, kconv)?;
        for chunk in tab.chunks(REPLAY_MAX_LAYERS) {
            // the kernel's by-value table: every slot, the unused ones zero
            let mut blob = vec![0u64; 5 * REPLAY_MAX_LAYERS];
            for (z, p) in chunk.iter().enumerate() {
                blob[5 * z..5 * z + 5].copy_from_slice(p);
            }
            self.launch_blob(
                self.f.gdn_replay_layers,
                replay_grid(hk, hv, dk, dv, chunk.len()),
                (REPLAY_THREADS as u32, 1, 1),
                &blob,
                &replay_dims(rec_w, hk, hv, dk, dv, kconv, n),
            )?;
        }
        Ok(())
    }
}

/// The replay kernels' grid for `layers` layers: a block per v-head and 32 value columns, then
/// the conv-window blocks (row 0), and the layers along z.
fn replay_grid(hk: usize, hv: usize, dk: usize, dv: usize, layers: usize) -> (u32, u32, u32) {
    let conv_dim = 2 * hk * dk + hv * dv;
    (
        (hv as u32) + cdiv(conv_dim, REPLAY_THREADS),
        (dv / 32) as u32,
        layers as u32,
    )
}

/// The replay kernels' scalar parameters after their pointers: rec_w, hk, hv, dk, dv, kconv, n.
fn replay_dims(
    rec_w: usize,
    hk: usize,
    hv: usize,
    dk: usize,
    dv: usize,
    kconv: usize,
    n: usize,
) -> [Arg; 7] {
    [rec_w, hk, hv, dk, dv, kconv, n].map(|v| Arg::I(v as i32))
}

/// The shapes the replay kernels take: the limits of [`Gpu::gdn_step`], a conv kernel of at most
/// 8 taps, and a record row of [`gdn_rec_width`].
fn replay_shape_ok(
    name: &str,
    rec_w: usize,
    hk: usize,
    hv: usize,
    dk: usize,
    dv: usize,
    kconv: usize,
) -> Result<()> {
    if dk > 128 || dk % 8 != 0 || dv % 32 != 0 || kconv == 0 || kconv > 8 {
        return Err(CudaError(format!(
            "{name}: needs dk <= 128 and a multiple of 8, dv a multiple of 32, 1 <= kconv <= 8 \
             (dk {dk}, dv {dv}, kconv {kconv})"
        )));
    }
    if rec_w != gdn_rec_width(hk, hv, dk, dv) {
        return Err(CudaError(format!(
            "{name}: record width {rec_w}, expected {}",
            gdn_rec_width(hk, hv, dk, dv)
        )));
    }
    Ok(())
}

impl Gpu {
    /// Q4_1 mat-vec (re-tiled by [`crate::retile_q41`]) over up to [`Q41_MAX_SEGS`] matrices of the
    /// same `n_in` that share the int8 activations `q [n, n_in]`, `d`/`s [n, n_in/32]`
    /// (`n <= MAX_ROWS`): segment `i` writes (or adds to) `y_i [n, n_out_i]`. `MvSeg::scales` is the
    /// `(d, m)` plane. Row t of the result does not depend on n: `mv_q41_n4` (n ≤ 4; its rows-first
    /// form `mv_q41_n4f` with [`Gpu::mv_rows_first`]) and `mv_q41` do the same float operations
    /// per row.
    #[allow(clippy::too_many_arguments)]
    pub fn mv_q41(
        &self,
        segs: &[MvSeg],
        q: u64,
        d: u64,
        s: u64,
        n_in: usize,
        n: usize,
        accumulate: bool,
    ) -> Result<()> {
        // up to 4 rows (a draft block) in the kernel whose registers hold 4 rows
        let f = if n <= 4 && self.mv_rows_first() {
            self.f.mv_q41_n4f
        } else if n <= 4 {
            self.f.mv_q41_n4
        } else {
            self.f.mv_q41
        };
        let Some((args, groups)) = q41_args("mv_q41", segs, (q, d, s), n_in, n, accumulate, 2)?
        else {
            return Ok(());
        };
        self.launch(f, (cdiv(groups, 4), 1, 1), (128, 1, 1), &args)
    }

    /// Whether the drafter's Q4_1 matrices take the tensor-core kernel ([`Self::mv_q41t`], their
    /// records from [`crate::retile_q41t`]) instead of `mv_q41`: opt-in (`BONSAI_CUDA_Q41_TC=1`,
    /// sm_90+: bulk copies with mbarriers). A load-time choice: the two read different layouts.
    /// Off by default: on the H200 it drafts 3–7 % faster but the 1-row context staging of a
    /// rejected round costs it more, so the 27B round cost did not move (kernels-cuda README).
    pub fn q41_tc(&self) -> bool {
        self.hopper() && std::env::var("BONSAI_CUDA_Q41_TC").is_ok_and(|v| v == "1")
    }

    /// Whether the drafter's LM head (Q4_1, `[E, V]`) takes the tensor-core layout
    /// ([`Self::mv_q41t`]) even where [`Self::q41_tc`] is off: on by default on sm_90+
    /// (`BONSAI_CUDA_Q41_TC_HEAD=0` off; read at the drafter's load). The head runs only in the
    /// draft's 4-row block, never in the 1-row context staging that made [`Self::q41_tc`] lose,
    /// and alone it is the widest Q4_1 launch (248,320 rows): 270 → 235 µs per launch from DRAM
    /// on the H200 (`bench/results/cuda-q41-tc-timing-27b.json`).
    pub fn q41_tc_head(&self) -> bool {
        self.hopper() && std::env::var("BONSAI_CUDA_Q41_TC_HEAD").map_or(true, |v| v != "0")
    }

    /// [`Self::mv_q41`] on the tensor cores (`mvt_q41`, `kernels/mvq41t.cu`): each segment's
    /// `codes` is a matrix re-tiled by [`crate::retile_q41t`] (its `scales` are unused), `y`
    /// `[n, n_out]`. Per weight row and activation row the float operations depend on `n_in` alone
    /// ([`crate::mv_q41t_host`] is the kernel's twin), so row t does not depend on n. sm_90+.
    #[allow(clippy::too_many_arguments)]
    pub fn mv_q41t(
        &self,
        segs: &[MvSeg],
        q: u64,
        d: u64,
        s: u64,
        n_in: usize,
        n: usize,
        accumulate: bool,
    ) -> Result<()> {
        if !self.hopper() {
            return Err(CudaError(
                "mv_q41t: the tensor-core Q4_1 kernel needs sm_90 (bulk copies)".into(),
            ));
        }
        let rows = crate::q41t::Q41T_ROWS;
        let Some((mut args, tiles)) =
            q41_args("mv_q41t", segs, (q, d, s), n_in, n, accumulate, rows)?
        else {
            return Ok(());
        };
        args.push(Arg::I(1)); // the first stages before the PDL wait (weights only)
        self.launch_smem(
            self.f.mvt_q41,
            (tiles as u32, 1, 1),
            ((crate::q41t::Q41T_WARPS * 32) as u32, 1, 1),
            crate::q41t_smem_bytes() as u32,
            &args,
        )
    }

    /// Per-head RMSNorm ⊙ `w` (`[hd]`) and NEOX RoPE over all `hd` dims at positions `pos0 + t`:
    /// `heads` heads of `n` rows of `src` (`[n, src_stride]` f32, head h at columns `h·hd..`) into row
    /// `ring.(slot0 + t) mod cap` of `dst` (`[*, dst_stride]`, same columns). `par`: 0, or device
    /// [`DspPar`] read at run time instead of `pos0` and, with a ring (`cap > 0`), of `slot0` (a
    /// captured draft or stage replays at any position).
    #[allow(clippy::too_many_arguments)]
    pub fn dsp_norm_rope(
        &self,
        src: u64,
        src_stride: usize,
        heads: usize,
        n: usize,
        w: u64,
        eps: f32,
        hd: usize,
        pos0: usize,
        rope_base: f32,
        dst: u64,
        dst_stride: usize,
        ring: Ring,
        par: u64,
    ) -> Result<()> {
        let a = NormRopeSet {
            src,
            src_stride,
            heads,
            w,
            dst,
            dst_stride,
        };
        let none = NormRopeSet { heads: 0, ..a };
        self.dsp_norm_rope_sets(a, none, n, eps, hd, pos0, rope_base, ring, par)
    }

    /// [`Self::dsp_norm_rope`] of two head sets in one launch (the draft's q and k heads): the
    /// same rows, positions, ring and operations per head as two launches.
    #[allow(clippy::too_many_arguments)]
    pub fn dsp_norm_rope_sets(
        &self,
        a: NormRopeSet,
        b: NormRopeSet,
        n: usize,
        eps: f32,
        hd: usize,
        pos0: usize,
        rope_base: f32,
        ring: Ring,
        par: u64,
    ) -> Result<()> {
        if hd == 0 || hd % 32 != 0 || hd > 256 {
            return Err(CudaError(format!(
                "dsp_norm_rope: head dim {hd} is not a multiple of 32 up to 256"
            )));
        }
        if n == 0 || a.heads + b.heads == 0 {
            return Ok(());
        }
        // an empty first set: the second takes its place
        let (a, b) = if a.heads == 0 { (b, a) } else { (a, b) };
        self.launch(
            self.f.dsp_norm_rope,
            ((a.heads + b.heads) as u32, n as u32, 1),
            (hd as u32, 1, 1),
            &[
                Arg::P(a.src),
                Arg::I(a.src_stride as i32),
                Arg::P(a.w),
                Arg::F(eps),
                Arg::I(hd as i32),
                Arg::I(pos0 as i32),
                Arg::F(rope_base),
                Arg::P(a.dst),
                Arg::I(a.dst_stride as i32),
                Arg::I(ring.cap as i32),
                Arg::I(ring.slot0 as i32),
                Arg::P(par),
                Arg::I(a.heads as i32),
                Arg::P(b.src),
                Arg::I(b.src_stride as i32),
                Arg::P(b.w),
                Arg::P(b.dst),
                Arg::I(b.dst_stride as i32),
            ],
        )
    }

    /// Row `t` of `src` (`[n, src_stride]`, the first `width` columns) into row
    /// `(ring.slot0 + t) mod ring.cap` of `dst` (`[*, width]`). `par`: 0, or device [`DspPar`]
    /// whose `slot` replaces `ring.slot0` (a captured stage).
    #[allow(clippy::too_many_arguments)]
    pub fn dsp_copy_rows(
        &self,
        src: u64,
        src_stride: usize,
        width: usize,
        n: usize,
        dst: u64,
        ring: Ring,
        par: u64,
    ) -> Result<()> {
        if n == 0 || width == 0 {
            return Ok(());
        }
        self.launch(
            self.f.dsp_copy_rows,
            (cdiv(width, 256), n as u32, 1),
            (256, 1, 1),
            &[
                Arg::P(src),
                Arg::I(src_stride as i32),
                Arg::I(width as i32),
                Arg::P(dst),
                Arg::I(ring.cap as i32),
                Arg::I(ring.slot0 as i32),
                Arg::P(par),
            ],
        )
    }

    /// Non-causal attention of `n` block queries `qo [n, nh·hd]` over `len` context keys (logical
    /// key i is ring row `(off + i) mod cap` of `kc`/`vc [cap, nkv·hd]` f32) followed by the `n`
    /// block keys `kb`/`vb [n, nkv·hd]`; GQA (q head h uses kv head `h / (nh/nkv)`), scores scaled by
    /// `scale`. Output f32 `out [n, nh·hd]` and int8 `q`/`d`/`s`. `part`: scratch of
    /// [`dsp_attn_part_floats`]`(n, nh, hd, len + n)` f32. `par`: 0, or device [`DspPar`] whose
    /// `off` / `len` the kernels read at run time instead of the arguments (a captured draft): the
    /// grid then covers a full ring and `part` must hold
    /// [`dsp_attn_part_floats`]`(n, nh, hd, cap + n)`; the chunks past the keys write nothing and
    /// the merge reads only the chunks that hold keys, so the outputs equal the launch sized for
    /// them. `kernel`: which first phase (and chunking) ([`DspAttnKernel`]).
    #[allow(clippy::too_many_arguments)]
    pub fn dsp_attention(
        &self,
        qo: u64,
        kc: u64,
        vc: u64,
        cap: usize,
        off: usize,
        len: usize,
        kb: u64,
        vb: u64,
        n: usize,
        nh: usize,
        nkv: usize,
        hd: usize,
        scale: f32,
        part: u64,
        out: u64,
        q: u64,
        d: u64,
        s: u64,
        par: u64,
        kernel: DspAttnKernel,
    ) -> Result<()> {
        if let DspAttnKernel::PerHead { spread } = kernel {
            if !(1..=DSP_ATTN_SPREAD).contains(&spread) {
                return Err(CudaError(format!(
                    "dsp_attention: spread {spread} (1..={DSP_ATTN_SPREAD})"
                )));
            }
        }
        if !(1..=MAX_ROWS).contains(&n) || hd == 0 || hd % 32 != 0 || hd > 256 {
            return Err(CudaError(format!(
                "dsp_attention: {n} rows (1..=8), head dim {hd} (a multiple of 32 up to 256)"
            )));
        }
        if nkv == 0 || nh % nkv != 0 || (len > 0 && (cap < len || off >= cap)) {
            return Err(CudaError(format!(
                "dsp_attention: heads {nh}/{nkv}, ring cap {cap} off {off} len {len}"
            )));
        }
        if par != 0 && cap == 0 {
            return Err(CudaError(
                "dsp_attention: device parameters need a ring (cap > 0)".into(),
            ));
        }
        // the graph's grid covers any live length up to the ring; the eager one exactly these keys
        let nchunk = if par != 0 {
            dsp_attn_max_chunks(cap + n)
        } else {
            dsp_attn_chunks(len + n, kernel)
        };
        let common = |tail: &[Arg]| -> Vec<Arg> {
            let mut a = vec![
                Arg::P(qo),
                Arg::P(kc),
                Arg::P(vc),
                Arg::I(cap.max(1) as i32),
                Arg::I(off as i32),
                Arg::I(len as i32),
                Arg::P(kb),
                Arg::P(vb),
                Arg::I(n as i32),
                Arg::I(nh as i32),
                Arg::I(nkv as i32),
                Arg::I(hd as i32),
                Arg::F(scale),
                Arg::I(nchunk as i32),
            ];
            a.extend_from_slice(tail);
            a
        };
        match kernel {
            DspAttnKernel::PerHead { spread } => {
                // the entry whose lane arrays fit the head exactly (fewer registers), else the
                // generic one
                let part_fn = match hd {
                    32 => self.f.dsp_attn_part_e1,
                    64 => self.f.dsp_attn_part_e2,
                    128 => self.f.dsp_attn_part_e4,
                    _ => self.f.dsp_attn_part,
                };
                self.launch(
                    part_fn,
                    (nh as u32, nchunk as u32, 1),
                    (256, 1, 1),
                    &common(&[Arg::P(part), Arg::P(par), Arg::I(spread as i32)]),
                )?;
            }
            DspAttnKernel::PerKvHead => {
                let r = nh / nkv * n;
                let ngmin = dsp_attn_kv_min_groups(r, hd);
                let slots = dsp_attn_kv_slots(nchunk, nkv, r, ngmin, dsp_attn_kv_slots_target());
                self.launch(
                    self.f.dsp_attn_kv,
                    (nkv as u32, slots as u32, 1),
                    (256, 1, 1),
                    &common(&[Arg::I(ngmin as i32), Arg::P(part), Arg::P(par)]),
                )?;
            }
        }
        let (spread, chmax) = kernel.chunking();
        self.launch(
            self.f.dsp_attn_merge,
            (nh as u32, n as u32, 1),
            (hd as u32, 1, 1),
            &[
                Arg::P(part),
                Arg::I(nh as i32),
                Arg::I(hd as i32),
                Arg::I(nchunk as i32),
                Arg::P(out),
                Arg::P(q),
                Arg::P(d),
                Arg::P(s),
                Arg::P(par),
                Arg::I(spread as i32),
                Arg::I(chmax as i32),
            ],
        )
    }

    /// One Markov step: `scores[v] = logits[v] + Σ_r b[v, r]·a[*prev, r]` (`a`, `b`: planes
    /// `[nv, rank]`), `scores[mask] = −inf`; `prev`: device i32. `rev`: the blocks take the
    /// vocabulary from its end (the same scores; a step after one without `rev` starts with the
    /// rows of `b` that one read last).
    #[allow(clippy::too_many_arguments)]
    pub fn dsp_markov_scores(
        &self,
        logits: u64,
        a: u64,
        ka: PlaneKind,
        b: u64,
        kb: PlaneKind,
        rank: usize,
        nv: usize,
        mask: usize,
        prev: u64,
        scores: u64,
        rev: bool,
    ) -> Result<()> {
        if nv == 0 {
            return Ok(());
        }
        self.launch(
            self.f.dsp_markov_scores,
            (cdiv(nv, 8 * DSP_MARKOV_PER_WARP), 1, 1),
            (256, 1, 1),
            &[
                Arg::P(logits),
                Arg::P(a),
                Arg::I(ka as i32),
                Arg::P(b),
                Arg::I(kb as i32),
                Arg::I(rank as i32),
                Arg::I(nv as i32),
                Arg::I(mask as i32),
                Arg::P(prev),
                Arg::P(scores),
                Arg::I(rev as i32),
            ],
        )
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn rec_width_matches_the_layout() {
        // the real model: conv_dim 10240, k 2048, v 6144, g 48, β 48
        assert_eq!(
            super::gdn_rec_width(16, 48, 128, 128),
            10240 + 2048 + 6144 + 96
        );
    }

    #[test]
    fn replay_launch_shape_and_scalars() {
        // the kernels' scalar parameters after their pointers, in order: rec_w, hk, hv, dk, dv,
        // kconv, n (spec.cu's gdn_replay / gdn_replay_layers)
        let slots: Vec<u64> = super::replay_dims(18528, 16, 48, 128, 128, 4, 5)
            .iter()
            .map(|a| a.slot())
            .collect();
        assert_eq!(slots, [18528, 16, 48, 128, 128, 4, 5]);
        // the 27B shapes: 48 v-heads + 80 conv-window blocks of REPLAY_THREADS (128) channels,
        // 4 column blocks, the layers along z
        assert_eq!(super::replay_grid(16, 48, 128, 128, 48), (128, 4, 48));
        assert_eq!(super::replay_grid(2, 6, 64, 64, 1), (6 + 5, 2, 1));
        // a record row of the wrong width is refused before any launch
        assert!(super::replay_shape_ok("t", 18527, 16, 48, 128, 128, 4).is_err());
        assert!(super::replay_shape_ok("t", 18528, 16, 48, 128, 128, 9).is_err());
        assert!(super::replay_shape_ok("t", 18528, 16, 48, 128, 128, 4).is_ok());
    }

    #[test]
    fn gdn_side_record_offsets() {
        use crate::GdnSide;
        // the record row of the real model: mixed (10240) ‖ k (2048) ‖ v (6144) ‖ g (48) ‖ β (48)
        let rec = 1 << 20;
        let (k, v, beta, g, w) = GdnSide::Record(rec).ptrs(16, 48, 128, 128);
        assert_eq!(k, rec + 4 * 10240);
        assert_eq!(v, k + 4 * 2048);
        assert_eq!(g, v + 4 * 6144);
        assert_eq!(beta, g + 4 * 48);
        assert_eq!(w, super::gdn_rec_width(16, 48, 128, 128));
        // the last β of a row is the row's last float
        assert_eq!(beta + 4 * 47, rec + 4 * (w as u64 - 1));
        // own buffers: as given, stride 0 (each output's own layout)
        let b = GdnSide::Bufs {
            k: 1,
            v: 2,
            beta: 3,
            g: 4,
        };
        assert_eq!(b.ptrs(16, 48, 128, 128), (1, 2, 3, 4, 0));
    }

    #[test]
    fn dsp_part_floats_counts_chunks() {
        // the real drafter at a full window: 4092 context rows + 4 block rows = 32 chunks of 128
        // keys for the per-kv-head kernel (16 of 256 for the per-head one)
        assert_eq!(
            super::dsp_attn_part_floats(4, 40, 128, 4096),
            4 * 40 * 32 * 130
        );
        assert_eq!(
            super::dsp_attn_part_floats(4, 40, 128, 4097),
            4 * 40 * 33 * 130
        );
        // a short context still has room for the spread's chunks
        assert_eq!(
            super::dsp_attn_part_floats(4, 40, 128, 300),
            4 * 40 * 10 * 130
        );
    }

    #[test]
    fn dsp_chunks_cover_the_keys_within_the_stride() {
        use super::{
            dsp_attn_chunk_len, dsp_attn_chunks, dsp_attn_max_chunks, DspAttnKernel,
            DSP_ATTN_CHUNK, DSP_ATTN_SPREAD,
        };
        let kernels = (1..=DSP_ATTN_SPREAD)
            .map(|spread| DspAttnKernel::PerHead { spread })
            .chain([DspAttnKernel::PerKvHead]);
        for t_max in [1usize, 5, 31, 64, 100, 257, 1000, 2048, 2049, 4096, 4100] {
            let stride = dsp_attn_max_chunks(t_max);
            for t in 1..=t_max {
                for k in kernels.clone() {
                    let (c, n) = (dsp_attn_chunk_len(t, k), dsp_attn_chunks(t, k));
                    let chmax = k.chunking().1;
                    assert!(c % 32 == 0 && (32..=chmax).contains(&c), "t {t}: {c}");
                    assert!(n * c >= t && (n - 1) * c < t, "t {t}: {n} chunks of {c}");
                    assert!(n <= stride, "t {t} {k:?}: {n} > {stride} (t_max {t_max})");
                }
                // spread 1 is the fixed 256-key chunking
                let one = DspAttnKernel::PerHead { spread: 1 };
                assert_eq!(dsp_attn_chunks(t, one), t.div_ceil(DSP_ATTN_CHUNK));
            }
        }
        // (keys, kernel) -> (keys per chunk, chunks): the drafter's short contexts spread over 8
        // chunks of 32..64 keys instead of one; per kv head, chunks of 32 keys up to 1,024 keys,
        // then spread over 32, then 128-key ones
        let (eight, kv) = (
            DspAttnKernel::PerHead { spread: 8 },
            DspAttnKernel::PerKvHead,
        );
        for (t, k, want) in [
            (300, eight, (64, 5)),
            (64, eight, (32, 2)),
            (68, kv, (32, 3)),
            (2052, kv, (96, 22)),
            (4100, kv, (128, 33)),
        ] {
            assert_eq!(
                (dsp_attn_chunk_len(t, k), dsp_attn_chunks(t, k)),
                want,
                "{t} {k:?}"
            );
        }
    }

    #[test]
    fn dsp_kv_groups_fit_and_fill() {
        use super::{dsp_attn_kv_min_groups, dsp_attn_kv_slots, dsp_attn_kv_smem};
        // the 27B drafter: 10 q heads per kv head x 4 rows at hd 128: two groups of 20 rows (the
        // weighted V holds 2 x 12 rows), 37.4 KB each
        assert_eq!(dsp_attn_kv_min_groups(40, 128), 2);
        assert_eq!(
            dsp_attn_kv_smem(20, 128),
            4 * (20 * 128 + 32 * 132 + 20 * 128)
        );
        // 16 q heads x 8 rows at hd 256: groups of at most 5 rows (40 KB of tiles)
        assert_eq!(dsp_attn_kv_min_groups(128, 256), 26);
        assert!(dsp_attn_kv_smem(128usize.div_ceil(26), 256) <= 40 << 10);
        // hd 64: 4 row subsets of 12 rows, but 40 KB of tiles hold 42
        assert_eq!(dsp_attn_kv_min_groups(42, 64), 1);
        assert_eq!(dsp_attn_kv_min_groups(43, 64), 2);
        // a short context (3 chunks, 4 kv heads) splits the rows to reach ~128 blocks; a long
        // one (33 chunks) keeps them whole; never more groups than rows
        assert_eq!(dsp_attn_kv_slots(3, 4, 40, 1, 128), 3 * 11);
        assert_eq!(dsp_attn_kv_slots(33, 4, 40, 1, 128), 33);
        assert_eq!(dsp_attn_kv_slots(1, 1, 4, 1, 128), 4);
        assert_eq!(dsp_attn_kv_slots(33, 4, 128, 11, 128), 33 * 11);
        assert_eq!(dsp_attn_kv_slots(33, 4, 40, 1, 512), 33 * 4);
    }
}
