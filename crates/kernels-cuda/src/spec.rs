//! Launchers of `kernels/spec.cu`: the DSpark round's GDN verify record and replay rollback
//! (MODEL.md §4.9 option C).

use crate::{cdiv, Arg, CudaError, Gpu, Result};

/// f32 elements of one GDN verify-record row: `mixed` (conv_dim) ‖ `k` (hk·dk) ‖ `v` (hv·dv) ‖ `g`
/// (hv) ‖ `β` (hv), with `conv_dim = 2·hk·dk + hv·dv`.
pub fn gdn_rec_width(hk: usize, hv: usize, dk: usize, dv: usize) -> usize {
    let conv_dim = 2 * hk * dk + hv * dv;
    conv_dim + hk * dk + hv * dv + 2 * hv
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
    /// `gdn_step` leave after the same rows, bit for bit. Same limits as [`Gpu::gdn_step`].
    #[allow(clippy::too_many_arguments)]
    pub fn gdn_replay(
        &self,
        s: u64,
        conv_state: u64,
        rec: u64,
        rec_w: usize,
        hk: usize,
        hv: usize,
        dk: usize,
        dv: usize,
        kconv: usize,
        n: usize,
    ) -> Result<()> {
        if dk > 128 || dk % 8 != 0 || dv % 32 != 0 || kconv == 0 {
            return Err(CudaError(format!(
                "gdn_replay: needs dk <= 128 and a multiple of 8, dv a multiple of 32, kconv >= 1 \
                 (dk {dk}, dv {dv}, kconv {kconv})"
            )));
        }
        if rec_w != gdn_rec_width(hk, hv, dk, dv) {
            return Err(CudaError(format!(
                "gdn_replay: record width {rec_w}, expected {}",
                gdn_rec_width(hk, hv, dk, dv)
            )));
        }
        if n == 0 {
            return Ok(());
        }
        let conv_dim = 2 * hk * dk + hv * dv;
        self.launch(
            self.f.gdn_replay,
            ((hv as u32) + cdiv(conv_dim, 256), (dv / 32) as u32, 1),
            (256, 1, 1),
            &[
                Arg::P(s),
                Arg::P(conv_state),
                Arg::P(rec),
                Arg::I(rec_w as i32),
                Arg::I(hk as i32),
                Arg::I(hv as i32),
                Arg::I(dk as i32),
                Arg::I(dv as i32),
                Arg::I(kconv as i32),
                Arg::I(n as i32),
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
}
