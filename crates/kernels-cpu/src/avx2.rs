//! AVX2 + FMA + F16C kernels. Each function computes bit-for-bit the same result as its scalar
//! definition in `ops` (see the `ops` module doc); only the integer parts are reorganized.

use crate::ops::{
    lowbit_isum, mk_pair_bytes, mk_type, q1p_chunk, with_mask_kind, wscale, QuantActs, MK_Q1,
    MK_Q2G64,
};
use crate::q1m;
use crate::quant::QuantType;
use core::arch::x86_64::*;
use core::ops::Range;

/// The fixed 8-lane reduction `((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7))` of `ops::hsum8`.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) fn hsum_ps(a: __m256) -> f32 {
    let lo = _mm256_castps256_ps128(a);
    let hi = _mm256_extractf128_ps(a, 1);
    let s = _mm_add_ps(lo, hi); // [t0, t1, t2, t3]
    let s2 = _mm_add_ps(s, _mm_movehl_ps(s, s)); // [t0+t2, t1+t3, ..]
    let s3 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
    _mm_cvtss_f32(s3)
}

/// f16 bits `h[0..4]` → f32 lanes `[h[idx[0]], ..., h[idx[7]]]`.
#[inline]
#[target_feature(enable = "avx2,f16c")]
pub(crate) fn dw_lanes(h: [u16; 4], idx: __m256i) -> __m256 {
    let v = _mm_set_epi16(
        0,
        0,
        0,
        0,
        h[3] as i16,
        h[2] as i16,
        h[1] as i16,
        h[0] as i16,
    );
    let f = _mm_cvtph_ps(v); // [dw0, dw1, dw2, dw3]
    _mm256_permutevar8x32_ps(_mm256_castps128_ps256(f), idx)
}

/// Ask the caches for the lines of bytes `[from, from + len)`: the next rows of a mask-layout
/// matrix, requested at the pace the current ones are read. Never dereferenced, so an address past
/// the matrix is harmless (a prefetch does not fault).
#[inline]
#[target_feature(enable = "sse")]
pub(crate) fn prefetch_lines(from: *const u8, len: usize) {
    let mut p = from.wrapping_sub(from as usize & 63); // its line
    let end = from.wrapping_add(len) as usize;
    while (p as usize) < end {
        _mm_prefetch::<_MM_HINT_T0>(p as *const i8);
        p = p.wrapping_add(64);
    }
}

#[inline]
pub(crate) fn f16_bits(b: &[u8], off: usize) -> u16 {
    u16::from_le_bytes([b[off], b[off + 1]])
}

/// `out.len()` consecutive weight rows of `qt` (`rows`, whole rows) against activation row 0 of
/// `xq` — the one-row (decode) case: `out[r]` is row r's dot. One call per task, so the per-row
/// work inlines into one loop.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C. `rows.len()` must be `out.len()` whole rows of `qt`
/// for `xq.n_in` elements, and `xq.n >= 1`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn lowbit_rows_one_act(
    qt: QuantType,
    rows: &[u8],
    xq: &QuantActs,
    out: &mut [f32],
) {
    let rb = rows.len() / out.len().max(1);
    for (r, y) in out.iter_mut().enumerate() {
        // SAFETY: the same CPU features as this function; the asserts inside check the row.
        unsafe {
            lowbit_row(
                qt,
                &rows[r * rb..(r + 1) * rb],
                xq,
                0,
                core::slice::from_mut(y),
            )
        }
    }
}

/// [`lowbit_rows_one_act`] for rows in a mask layout (`crate::q1m` for Q1_0, `crate::q2m` for the
/// Q2 types): groups of 4 rows share each activation load while the next 4 are prefetched.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C. `rows.len()` must be `out.len()` whole mask-layout
/// rows of `qt` for `xq.n_in` elements, and `xq.n >= 1`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn mask_rows_one_act(
    qt: QuantType,
    rows: &[u8],
    xq: &QuantActs,
    out: &mut [f32],
) {
    let rb = rows.len() / out.len().max(1);
    let mut r = 0;
    macro_rules! go {
        ($R:literal, $M:expr) => {
            while out.len() - r >= $R {
                let w: [&[u8]; $R] =
                    core::array::from_fn(|i| &rows[(r + i) * rb..(r + i + 1) * rb]);
                // SAFETY: the same CPU features as this function; the asserts inside check the
                // rows.
                unsafe { mask_rows_one::<$R, { $M }>(w, xq, &mut out[r..r + $R]) }
                r += $R;
            }
        };
    }
    with_mask_kind!(qt, M => {
        go!(4, M);
        go!(1, M);
    })
}

/// R mask-layout rows of kind M against activation row 0 (decode): `out[r]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn mask_rows_one<const R: usize, const M: u8>(
    wrows: [&[u8]; R],
    xq: &QuantActs,
    out: &mut [f32],
) {
    let qt = mk_type(M);
    assert_eq!(out.len(), R);
    for w in &wrows {
        assert_eq!(Some(w.len()), qt.row_bytes(xq.n_in));
    }
    let nfull = xq.n_in / 256;
    let c1 = 2 * (xq.n_in / q1m::PAIR_ELEMS);
    let mut acc = [[_mm256_setzero_ps(); 4]; R];
    // the next R rows follow these in memory (one task's rows): stream them towards the caches
    let next = wrows[R - 1].as_ptr().wrapping_add(wrows[R - 1].len());
    mask_pairs::<R, 1, M>(&wrows, xq, 0, c1 / 2, next, &mut acc);
    for r in 0..R {
        if M == MK_Q1 {
            q1_chunks::<1>(wrows[r], xq, 0, c1..nfull, &mut acc[r]);
        } else {
            q2_chunks::<1>(qt, wrows[r], xq, 0, c1..nfull, &mut acc[r]);
        }
        out[r] = hsum_ps(tail_chunk(qt, wrows[r], xq, 0, acc[r][0]));
    }
}

/// [`lowbit_row`] for one row in a mask layout (`crate::q1m`, `crate::q2m`).
///
/// # Safety
/// As [`lowbit_row`], with `wrow` one whole mask-layout row of `qt`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn mask_row(
    qt: QuantType,
    wrow: &[u8],
    xq: &QuantActs,
    t_begin: usize,
    out: &mut [f32],
) {
    // SAFETY: the same CPU features and contract as this function.
    unsafe { with_mask_kind!(qt, M => mask_row_m::<M>(wrow, xq, t_begin, out)) }
}

/// [`mask_row`] of kind M.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn mask_row_m<const M: u8>(wrow: &[u8], xq: &QuantActs, t_begin: usize, out: &mut [f32]) {
    let qt = mk_type(M);
    let n = t_begin + out.len();
    assert!(n <= xq.n);
    assert_eq!(Some(wrow.len()), qt.row_bytes(xq.n_in));
    let nfull = xq.n_in / 256;
    let c1 = 2 * (xq.n_in / q1m::PAIR_ELEMS);
    let none = core::ptr::null();
    let mut t0 = t_begin;
    while t0 < n {
        let nt = (n - t0).min(4);
        let mut acc = [[_mm256_setzero_ps(); 4]; 1];
        match nt {
            1 => mask_pairs::<1, 1, M>(&[wrow], xq, t0, c1 / 2, none, &mut acc),
            2 => mask_pairs::<1, 2, M>(&[wrow], xq, t0, c1 / 2, none, &mut acc),
            3 => mask_pairs::<1, 3, M>(&[wrow], xq, t0, c1 / 2, none, &mut acc),
            _ => mask_pairs::<1, 4, M>(&[wrow], xq, t0, c1 / 2, none, &mut acc),
        }
        let acc = &mut acc[0];
        let rest = c1..nfull;
        match (M == MK_Q1, nt) {
            (true, 1) => q1_chunks::<1>(wrow, xq, t0, rest, acc),
            (true, 2) => q1_chunks::<2>(wrow, xq, t0, rest, acc),
            (true, 3) => q1_chunks::<3>(wrow, xq, t0, rest, acc),
            (true, _) => q1_chunks::<4>(wrow, xq, t0, rest, acc),
            (false, 1) => q2_chunks::<1>(qt, wrow, xq, t0, rest, acc),
            (false, 2) => q2_chunks::<2>(qt, wrow, xq, t0, rest, acc),
            (false, 3) => q2_chunks::<3>(qt, wrow, xq, t0, rest, acc),
            (false, _) => q2_chunks::<4>(qt, wrow, xq, t0, rest, acc),
        }
        for ti in 0..nt {
            acc[ti] = tail_chunk(qt, wrow, xq, t0 + ti, acc[ti]);
            out[t0 - t_begin + ti] = hsum_ps(acc[ti]);
        }
        t0 += nt;
    }
}

/// Rows in a mask layout of kind M over the first `npair` 512-element pairs of weight rows `wrows`
/// and activation rows `t0..t0+NT` (`acc[r][ti]`). Each vector's weight operand is broadcast and
/// ANDed per 32-byte half h of the pair's 64-byte q1p vector k:
/// - Q1_0 (`crate::q1m`): word k to the 4 qwords, `1 << (p / 8)` (chunk 2s) or `1 << (4 + p / 8)`
///   (chunk 2s + 1) in byte p, so i32 lane l of half h holds `2^j · Σ b·q`, j = 4h + l / 2;
/// - Q2 (`crate::q2m`): vector k's 16 bytes to both 128-bit lanes, `3 << 2ℓ` in 128-bit lane
///   ℓ = 2h + (p % 32) / 16, so lane l of half h holds `4^ℓ · Σ c·q`, ℓ = 2h + l / 4.
///
/// `maddubs` (at most 2·128·127 a byte pair: Q2 codes are 0..2, `crate::q2m::pack_into`; no
/// saturation) and `madd` give the i32 lanes, which `vpsravd` makes exact: the chunk kernels'
/// block integers and float steps, the same bits. With `prefetch` non-null, the lines of the R
/// rows that follow are requested at the pace these are read.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn mask_pairs<const R: usize, const NT: usize, const M: u8>(
    wrows: &[&[u8]; R],
    xq: &QuantActs,
    t0: usize,
    npair: usize,
    prefetch: *const u8,
    acc: &mut [[__m256; 4]; R],
) {
    let nbp = xq.n_pad / 32;
    let pb = mk_pair_bytes(M);
    let (sel_lo, sel_hi, sh_lo, sh_hi) = if M == MK_Q1 {
        let sel = |j0: i64| -> __m256i {
            let b = |j: i64| 0x0101_0101_0101_0101i64.wrapping_mul(1 << j);
            _mm256_setr_epi64x(b(j0), b(j0 + 1), b(j0 + 2), b(j0 + 3))
        };
        (
            sel(0),
            sel(4),
            _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3),
            _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7),
        )
    } else {
        let sel = |l0: i32| -> __m256i {
            let (a, b) = ((3i32 << (2 * l0)) as i8, (3i32 << (2 * l0 + 2)) as i8);
            _mm256_setr_m128i(_mm_set1_epi8(a), _mm_set1_epi8(b))
        };
        (
            sel(0),
            sel(2),
            _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2),
            _mm256_setr_epi32(4, 4, 4, 4, 6, 6, 6, 6),
        )
    };
    let ones16 = _mm256_set1_epi16(1);
    let zero = _mm256_setzero_si256();
    // half h's lanes ← d of the weight block holding each 32-element block
    let (dw_lo, dw_hi) = if M == MK_Q2G64 {
        (
            _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3),
            _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7),
        )
    } else {
        (
            _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1),
            _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3),
        )
    };
    // the pair's weight operands start after its scales
    let wo = if M == MK_Q2G64 { 16 } else { 8 };
    assert!(t0 + NT <= xq.n && q1m::PAIR_ELEMS * npair <= xq.n_pad);
    assert!(xq.sums.len() >= (t0 + NT) * nbp && xq.d.len() >= (t0 + NT) * nbp);
    for w in wrows {
        assert!(w.len() >= pb * npair);
    }
    // acts: row t0's q1p bytes (pair s's vector k at 512s + 64k); rows follow at n_pad
    let acts = xq.q1p[t0 * xq.n_pad..].as_ptr();
    for s in 0..npair {
        if !prefetch.is_null() {
            prefetch_lines(prefetch.wrapping_add(pb * R * s), pb * R);
        }
        let mut wp = [core::ptr::null::<u8>(); R];
        let mut dwv = [[_mm256_setzero_ps(); 2]; R];
        for r in 0..R {
            // SAFETY: pair s's pb bytes lie inside wrows[r] (asserted above).
            wp[r] = unsafe { wrows[r].as_ptr().add(pb * s) };
            let d = if M == MK_Q2G64 {
                // SAFETY: reads the pair's first 16 bytes (its 8 f16 scales).
                _mm256_cvtph_ps(unsafe { _mm_loadu_si128(wp[r] as *const __m128i) })
            } else {
                // SAFETY: reads the pair's first 8 bytes (its 4 f16 scales).
                let h = unsafe { _mm_loadl_epi64(wp[r] as *const __m128i) };
                _mm256_castps128_ps256(_mm_cvtph_ps(h)) // [d0, d1, d2, d3, ..]
            };
            dwv[r] = [
                _mm256_permutevar8x32_ps(d, dw_lo),
                _mm256_permutevar8x32_ps(d, dw_hi),
            ];
        }
        let mut bq = [[[zero; 2]; NT]; R]; // bq[r][ti][half]: lane l = (power) · partial Σ code·q
        for k in 0..8 {
            let mut wb = [[zero; 2]; R];
            for r in 0..R {
                let wv = if M == MK_Q1 {
                    // SAFETY: word k is bytes 8 + 8k .. 16 + 8k of the pair (inside, above).
                    _mm256_set1_epi64x(unsafe {
                        core::ptr::read_unaligned(wp[r].add(8 + 8 * k) as *const i64)
                    })
                } else {
                    // SAFETY: vector k is bytes wo + 16k .. wo + 16k + 16 of the pair (inside).
                    _mm256_broadcastsi128_si256(unsafe {
                        _mm_loadu_si128(wp[r].add(wo + 16 * k) as *const __m128i)
                    })
                };
                wb[r] = [_mm256_and_si256(wv, sel_lo), _mm256_and_si256(wv, sel_hi)];
            }
            for ti in 0..NT {
                for hf in 0..2 {
                    // SAFETY: row t0 + ti < xq.n and 512s + 64k + 64 <= n_pad (asserted above).
                    let av = unsafe {
                        _mm256_loadu_si256(
                            acts.add(ti * xq.n_pad + 512 * s + 64 * k + 32 * hf) as *const __m256i
                        )
                    };
                    for r in 0..R {
                        let p = _mm256_madd_epi16(_mm256_maddubs_epi16(wb[r][hf], av), ones16);
                        bq[r][ti][hf] = _mm256_add_epi32(bq[r][ti][hf], p);
                    }
                }
            }
        }
        for r in 0..R {
            for ti in 0..NT {
                let t = t0 + ti;
                for hf in 0..2 {
                    let sh = if hf == 0 { sh_lo } else { sh_hi };
                    let bqs = _mm256_srav_epi32(bq[r][ti][hf], sh);
                    let b = t * nbp + 16 * s + 8 * hf;
                    // SAFETY: blocks b .. b + 8 of row t lie inside sums and d (asserted above).
                    let (sv, dav) = unsafe {
                        (
                            _mm256_loadu_si256(xq.sums.as_ptr().add(b) as *const __m256i),
                            _mm256_loadu_ps(xq.d.as_ptr().add(b)),
                        )
                    };
                    let cq = if M == MK_Q1 {
                        _mm256_slli_epi32(bqs, 1)
                    } else {
                        bqs
                    };
                    let isum = _mm256_sub_epi32(cq, sv);
                    let sc = _mm256_mul_ps(dwv[r][hf], dav);
                    acc[r][ti] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), sc, acc[r][ti]);
                }
            }
        }
    }
}

/// One low-bit weight row against activation rows `t_begin..t_begin + out.len()` of `xq`:
/// `out[i]` is row `t_begin + i`.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C. `wrow` must be one whole row of `qt` for `xq.n_in`
/// elements and `t_begin + out.len() <= xq.n`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn lowbit_row(
    qt: QuantType,
    wrow: &[u8],
    xq: &QuantActs,
    t_begin: usize,
    out: &mut [f32],
) {
    let n = t_begin + out.len();
    assert!(n <= xq.n);
    assert_eq!(Some(wrow.len()), qt.row_bytes(xq.n_in));
    let nfull = xq.n_in / 256;
    let mut t0 = t_begin;
    while t0 < n {
        let nt = (n - t0).min(4);
        let mut acc = [_mm256_setzero_ps(); 4];
        match (qt, nt) {
            (QuantType::Q1_0, 1) => q1_chunks::<1>(wrow, xq, t0, 0..nfull, &mut acc),
            (QuantType::Q1_0, 2) => q1_chunks::<2>(wrow, xq, t0, 0..nfull, &mut acc),
            (QuantType::Q1_0, 3) => q1_chunks::<3>(wrow, xq, t0, 0..nfull, &mut acc),
            (QuantType::Q1_0, _) => q1_chunks::<4>(wrow, xq, t0, 0..nfull, &mut acc),
            (_, 1) => q2_chunks::<1>(qt, wrow, xq, t0, 0..nfull, &mut acc),
            (_, 2) => q2_chunks::<2>(qt, wrow, xq, t0, 0..nfull, &mut acc),
            (_, 3) => q2_chunks::<3>(qt, wrow, xq, t0, 0..nfull, &mut acc),
            (_, _) => q2_chunks::<4>(qt, wrow, xq, t0, 0..nfull, &mut acc),
        }
        for ti in 0..nt {
            acc[ti] = tail_chunk(qt, wrow, xq, t0 + ti, acc[ti]);
        }
        for ti in 0..nt {
            out[t0 - t_begin + ti] = hsum_ps(acc[ti]);
        }
        t0 += nt;
    }
}

/// The last, partial 256-element chunk of a row whose length is not a multiple of 256, for
/// activation row `t`: the exact block integers from the scalar helper and the same float step as
/// every chunk (`acc[l] = fma(isum, dw·da, acc[l])`, absent blocks 0). `acc` unchanged when the
/// row has no partial chunk.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) fn tail_chunk(
    qt: QuantType,
    wrow: &[u8],
    xq: &QuantActs,
    t: usize,
    acc: __m256,
) -> __m256 {
    let nb = xq.n_in / 32;
    let nbp = xq.n_pad / 32;
    let c = nb / 8;
    if c * 8 == nb {
        return acc;
    }
    let mut is = [0f32; 8];
    let mut sc = [0f32; 8];
    for l in 0..8 {
        let b = 8 * c + l;
        if b < nb {
            is[l] = lowbit_isum(qt, wrow, xq, t, b) as f32;
            sc[l] = wscale(qt, wrow, b) * xq.d[t * nbp + b];
        }
    }
    // SAFETY: `is` and `sc` are 8-element arrays.
    let (iv, sv) = unsafe { (_mm256_loadu_ps(is.as_ptr()), _mm256_loadu_ps(sc.as_ptr())) };
    _mm256_fmadd_ps(iv, sv, acc)
}

/// Q1_0 over the full 256-element chunks for activation rows `t0..t0+NT`, using the Q1-permuted
/// activations: vector k of a chunk holds elements `32l + 4k + m` at byte `4l + m`, so after
/// `maddubs`/`madd` the i32 lane l is a partial sum of block l alone. Computes `Σ b·q` with b ∈ {0,1}
/// and uses `Σ (2b−1)·q = 2·Σ b·q − Σ q`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q1_chunks<const NT: usize>(
    wrow: &[u8],
    xq: &QuantActs,
    t0: usize,
    chunks: Range<usize>,
    acc: &mut [__m256; 4],
) {
    // q1p keeps the chunks of whole 512-element pairs interleaved (vectors 64 bytes apart) and a
    // last unpaired chunk plain (32 apart): one loop each, with the stride a constant
    let cp = 2 * (xq.n_pad / 512);
    q1_chunks_vs::<NT, 64>(wrow, xq, t0, chunks.start..chunks.end.min(cp), acc);
    q1_chunks_vs::<NT, 32>(wrow, xq, t0, chunks.start.max(cp)..chunks.end, acc);
}

/// [`q1_chunks`] over chunks whose q1p vectors lie `VS` bytes apart.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q1_chunks_vs<const NT: usize, const VS: usize>(
    wrow: &[u8],
    xq: &QuantActs,
    t0: usize,
    chunks: Range<usize>,
    acc: &mut [__m256; 4],
) {
    if chunks.is_empty() {
        return;
    }
    let nbp = xq.n_pad / 32;
    let ones8 = _mm256_set1_epi8(1);
    let ones16 = _mm256_set1_epi16(1);
    let zero = _mm256_setzero_si256();
    let dw_idx = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    // shuffle k: byte 4l+m (in each 128-bit lane) ← weight byte 4l + k/2 of that lane's block
    let mut shuf = [zero; 4];
    for (h, sv) in shuf.iter_mut().enumerate() {
        let h = h as i8;
        #[rustfmt::skip]
        let v = _mm256_setr_epi8(
            h, h, h, h, 4 + h, 4 + h, 4 + h, 4 + h, 8 + h, 8 + h, 8 + h, 8 + h, 12 + h, 12 + h, 12 + h, 12 + h,
            h, h, h, h, 4 + h, 4 + h, 4 + h, 4 + h, 8 + h, 8 + h, 8 + h, 8 + h, 12 + h, 12 + h, 12 + h, 12 + h,
        );
        *sv = v;
    }
    // bit select for even k: bits 0..3 by m; odd k: bits 4..7
    let bsel_lo = _mm256_set1_epi32(0x0804_0201);
    let bsel_hi = _mm256_set1_epi32(0x8040_2010u32 as i32);
    let mut accv = [_mm256_setzero_ps(); NT];
    accv.copy_from_slice(&acc[..NT]);
    assert!(256 * chunks.end <= xq.n_pad);
    for c in chunks {
        let off0 = 2 * c * 18;
        let off1 = off0 + 18;
        // SAFETY: each 16-byte load reads one block's bits qs[0..16], inside wrow (checked by slicing).
        let bits = unsafe {
            _mm256_set_m128i(
                _mm_loadu_si128(wrow[off1 + 2..off1 + 18].as_ptr() as *const __m128i),
                _mm_loadu_si128(wrow[off0 + 2..off0 + 18].as_ptr() as *const __m128i),
            )
        };
        let mut b01 = [zero; 8]; // b01[k]: 0/1 bytes in the permuted order of vector k
        for (k, bv) in b01.iter_mut().enumerate() {
            let sel = if k % 2 == 0 { bsel_lo } else { bsel_hi };
            let v = _mm256_and_si256(_mm256_shuffle_epi8(bits, shuf[k / 2]), sel);
            *bv = _mm256_and_si256(_mm256_cmpeq_epi8(v, sel), ones8);
        }
        let dwv = dw_lanes([f16_bits(wrow, off0), f16_bits(wrow, off1), 0, 0], dw_idx);
        for ti in 0..NT {
            let t = t0 + ti;
            let a = xq.q1p[t * xq.n_pad..(t + 1) * xq.n_pad].as_ptr();
            // vector 0 of chunk c (`q1p_vec`): paired chunks interleave, a last one is plain
            let v0 = if VS == 64 {
                512 * (c / 2) + 32 * (c % 2)
            } else {
                256 * c
            };
            debug_assert_eq!(q1p_chunk(xq.n_pad, c), (v0, VS));
            let mut s16 = zero;
            for k in 0..8 {
                // SAFETY: c < n_pad / 256 (asserted above), so the 32 bytes of vector k
                // (`q1p_vec`) lie inside row t of q1p (n_pad bytes from `a`).
                let av = unsafe { _mm256_loadu_si256(a.add(v0 + VS * k) as *const __m256i) };
                s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(b01[k], av));
            }
            let bq = _mm256_madd_epi16(s16, ones16); // lane l: Σ b·q over block 8c+l
            let sums = &xq.sums[t * nbp + 8 * c..t * nbp + 8 * c + 8];
            // SAFETY: sums has 8 i32 elements.
            let isum = _mm256_sub_epi32(_mm256_slli_epi32(bq, 1), unsafe {
                _mm256_loadu_si256(sums.as_ptr() as *const __m256i)
            });
            let da = &xq.d[t * nbp + 8 * c..t * nbp + 8 * c + 8];
            // SAFETY: da has 8 elements.
            let sc = _mm256_mul_ps(dwv, unsafe { _mm256_loadu_ps(da.as_ptr()) });
            accv[ti] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), sc, accv[ti]);
        }
    }
    acc[..NT].copy_from_slice(&accv);
}

/// Q2 (g128, PQ2_0 and g64) over the full 256-element chunks, using the permuted activations.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q2_chunks<const NT: usize>(
    qt: QuantType,
    wrow: &[u8],
    xq: &QuantActs,
    t0: usize,
    chunks: Range<usize>,
    acc: &mut [__m256; 4],
) {
    let mut accv = [_mm256_setzero_ps(); NT];
    accv.copy_from_slice(&acc[..NT]);
    let nbp = xq.n_pad / 32;
    let ones16 = _mm256_set1_epi16(1);
    let zero = _mm256_setzero_si256();
    let perm = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
    let qp = xq.qp();
    for c in chunks {
        let (codes, dwv) = q2_chunk_codes!(qt, wrow, c);
        for ti in 0..NT {
            let t = t0 + ti;
            let p = &qp[t * xq.n_pad + 256 * c..t * xq.n_pad + 256 * c + 256];
            let mut yh = [zero; 2];
            for hf in 0..2 {
                let mut s16 = zero;
                for s in 0..4 {
                    // SAFETY: p has 256 elements; reads p[128hf+32s .. +32].
                    let av = unsafe {
                        _mm256_loadu_si256(p.as_ptr().add(128 * hf + 32 * s) as *const __m256i)
                    };
                    s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(codes[4 * hf + s], av));
                }
                yh[hf] = _mm256_madd_epi16(s16, ones16); // lanes (2b, 2b+1): halves of block 4hf+b
            }
            let h = _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(yh[0], yh[1]), perm);
            let sums = &xq.sums[t * nbp + 8 * c..t * nbp + 8 * c + 8];
            // SAFETY: sums has 8 i32 elements.
            let isum = _mm256_sub_epi32(h, unsafe {
                _mm256_loadu_si256(sums.as_ptr() as *const __m256i)
            });
            let da = &xq.d[t * nbp + 8 * c..t * nbp + 8 * c + 8];
            // SAFETY: da has 8 elements.
            let sc = _mm256_mul_ps(dwv, unsafe { _mm256_loadu_ps(da.as_ptr()) });
            accv[ti] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), sc, accv[ti]);
        }
    }
    acc[..NT].copy_from_slice(&accv);
}

/// Chunk `c` of a Q2 (g128, PQ2_0 or g64) weight row unpacked, as `(codes, dwv)`:
/// `codes[4·half + s]` byte i is the 2-bit code of chunk element `128·half + 4i + s` (0..3), and
/// `dwv` lane l the weight scale of 32-element block 8c + l as f32. A macro, not a function, so it
/// expands inside each kernel's own target features (a `#[target_feature]` helper returning the
/// arrays was not inlined and made the Q2 kernels 1.5× slower).
macro_rules! q2_chunk_codes {
    ($qt:expr, $wrow:expr, $c:expr) => {{
        let m3 = _mm256_set1_epi8(3);
        let mut codes = [_mm256_setzero_si256(); 8];
        let dh: [u16; 4];
        if $qt == $crate::quant::QuantType::Q2_0G64 {
            let o = 4 * $c * 18;
            for hf in 0..2 {
                let a = o + 2 * hf * 18 + 2;
                let b = a + 18;
                // SAFETY: each 16-byte load reads one block's qs[0..16], inside the row (checked by slicing).
                let qs = unsafe {
                    _mm256_set_m128i(
                        _mm_loadu_si128($wrow[b..b + 16].as_ptr() as *const __m128i),
                        _mm_loadu_si128($wrow[a..a + 16].as_ptr() as *const __m128i),
                    )
                };
                for s in 0..4 {
                    codes[4 * hf + s] = _mm256_and_si256($crate::avx2::srli16(qs, s), m3);
                }
            }
            dh = [
                $crate::avx2::f16_bits($wrow, o),
                $crate::avx2::f16_bits($wrow, o + 18),
                $crate::avx2::f16_bits($wrow, o + 36),
                $crate::avx2::f16_bits($wrow, o + 54),
            ];
        } else {
            let o = 2 * $c * 34;
            for hf in 0..2 {
                let a = o + hf * 34 + 2;
                // SAFETY: reads one block's qs[0..32], inside the row (checked by slicing).
                let qs = unsafe { _mm256_loadu_si256($wrow[a..a + 32].as_ptr() as *const __m256i) };
                for s in 0..4 {
                    codes[4 * hf + s] = _mm256_and_si256($crate::avx2::srli16(qs, s), m3);
                }
            }
            dh = [$crate::avx2::f16_bits($wrow, o), $crate::avx2::f16_bits($wrow, o + 34), 0, 0];
        }
        let dw_idx = if $qt == $crate::quant::QuantType::Q2_0G64 {
            _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3)
        } else {
            _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1)
        };
        (codes, $crate::avx2::dw_lanes(dh, dw_idx))
    }};
}
pub(crate) use q2_chunk_codes;

#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn srli16(v: __m256i, s: usize) -> __m256i {
    match s {
        0 => v,
        1 => _mm256_srli_epi16(v, 2),
        2 => _mm256_srli_epi16(v, 4),
        _ => _mm256_srli_epi16(v, 6),
    }
}

/// See `ops::dot_f32`.
///
/// # Safety
/// The CPU must support AVX2 and FMA; `a.len() == b.len()`.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let pa = a.as_ptr();
    let pb = b.as_ptr();
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    // SAFETY (all loads below): every load reads 8 elements at i + 8k with i + 8k + 8 <= n.
    while i + 32 <= n {
        for (k, ak) in acc.iter_mut().enumerate() {
            *ak = unsafe {
                _mm256_fmadd_ps(
                    _mm256_loadu_ps(pa.add(i + 8 * k)),
                    _mm256_loadu_ps(pb.add(i + 8 * k)),
                    *ak,
                )
            };
        }
        i += 32;
    }
    while i + 8 <= n {
        acc[0] = unsafe {
            _mm256_fmadd_ps(
                _mm256_loadu_ps(pa.add(i)),
                _mm256_loadu_ps(pb.add(i)),
                acc[0],
            )
        };
        i += 8;
    }
    let v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    let mut r = hsum_ps(v);
    while i < n {
        r = a[i].mul_add(b[i], r);
        i += 1;
    }
    r
}

/// `y = fma(alpha, x, y)`.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    let n = x.len().min(y.len());
    let av = _mm256_set1_ps(alpha);
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: i + 8 <= n for both slices.
        unsafe {
            let yv = _mm256_loadu_ps(y.as_ptr().add(i));
            let r = _mm256_fmadd_ps(av, _mm256_loadu_ps(x.as_ptr().add(i)), yv);
            _mm256_storeu_ps(y.as_mut_ptr().add(i), r);
        }
        i += 8;
    }
    while i < n {
        y[i] = alpha.mul_add(x[i], y[i]);
        i += 1;
    }
}

/// `y = fma(alpha, x, y·s)`.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn scale_axpy(s: f32, alpha: f32, x: &[f32], y: &mut [f32]) {
    let n = x.len().min(y.len());
    let av = _mm256_set1_ps(alpha);
    let sv = _mm256_set1_ps(s);
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: i + 8 <= n for both slices.
        unsafe {
            let yv = _mm256_mul_ps(_mm256_loadu_ps(y.as_ptr().add(i)), sv);
            let r = _mm256_fmadd_ps(av, _mm256_loadu_ps(x.as_ptr().add(i)), yv);
            _mm256_storeu_ps(y.as_mut_ptr().add(i), r);
        }
        i += 8;
    }
    while i < n {
        y[i] = alpha.mul_add(x[i], y[i] * s);
        i += 1;
    }
}

/// f16 → f32 for a whole slice, 8 lanes at a time (`vcvtph2ps`); exact, like the scalar path.
///
/// # Safety
/// The CPU must support AVX2 and F16C; `src.len() == dst.len()`.
#[target_feature(enable = "avx2,f16c")]
pub(crate) unsafe fn f16_to_f32(src: &[u16], dst: &mut [f32]) {
    let n = src.len();
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: i + 8 <= n = src.len() = dst.len(): both 16-byte load and 32-byte store are in
        // bounds; unaligned forms are used.
        unsafe {
            let h = _mm_loadu_si128(src.as_ptr().add(i) as *const __m128i);
            _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
        }
        i += 8;
    }
    while i < n {
        dst[i] = half::f16::from_bits(src[i]).to_f32();
        i += 1;
    }
}

/// `ops::exp_nonpos` on 8 lanes: the same IEEE operations in the same order (no FMA contraction),
/// so each lane equals the scalar result bit for bit.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn exp_nonpos8(x: __m256) -> __m256 {
    let log2e = _mm256_set1_ps(std::f32::consts::LOG2_E);
    let ln2_hi = _mm256_set1_ps(0.693_145_75);
    let ln2_lo = _mm256_set1_ps(1.428_606_8e-6);
    let round = _mm256_set1_ps(12_582_912.0);
    let lim = _mm256_set1_ps(-87.0);
    // xc = x.max(-87): x is never NaN here (NaN − max is NaN only for NaN logits, which the
    // scalar path also passes through `max`; _mm256_max_ps(x, lim) returns lim for NaN x, and
    // f32::max(NaN, -87) is -87 too)
    let xc = _mm256_max_ps(x, lim);
    let n = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(xc, log2e), round), round);
    let r = _mm256_sub_ps(
        _mm256_sub_ps(xc, _mm256_mul_ps(n, ln2_hi)),
        _mm256_mul_ps(n, ln2_lo),
    );
    let c = |v: f32| _mm256_set1_ps(v);
    // 1 + r·(1 + r·(1/2 + r·(1/6 + r·(1/24 + r·(1/120 + r·(1/720)))))), innermost first
    let mut p = c(1.0 / 720.0);
    p = _mm256_add_ps(c(1.0 / 120.0), _mm256_mul_ps(r, p));
    p = _mm256_add_ps(c(1.0 / 24.0), _mm256_mul_ps(r, p));
    p = _mm256_add_ps(c(1.0 / 6.0), _mm256_mul_ps(r, p));
    p = _mm256_add_ps(c(0.5), _mm256_mul_ps(r, p));
    p = _mm256_add_ps(c(1.0), _mm256_mul_ps(r, p));
    p = _mm256_add_ps(c(1.0), _mm256_mul_ps(r, p));
    let ni = _mm256_cvttps_epi32(n);
    let scale = _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_add_epi32(ni, _mm256_set1_epi32(127)),
        23,
    ));
    let y = _mm256_mul_ps(p, scale);
    // x < -87 → 0 (false for NaN, like the scalar `if x < -87.0`)
    let under = _mm256_cmp_ps(x, lim, _CMP_LT_OQ);
    _mm256_andnot_ps(under, y)
}

/// `ops::sigmoid_fast` on 8 lanes, the same IEEE operations in the same order: `t = e^{−|x|}`,
/// `1 / (1 + t)` where `x ≥ 0` (ordered: false for NaN, like the scalar `if`), else `t / (1 + t)`.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn sigmoid8(x: __m256) -> __m256 {
    let sign = _mm256_set1_ps(-0.0);
    let t = exp_nonpos8(_mm256_or_ps(x, sign)); // −|x|: the sign bit set
    let d = _mm256_add_ps(_mm256_set1_ps(1.0), t);
    let pos = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ);
    _mm256_blendv_ps(
        _mm256_div_ps(t, d),
        _mm256_div_ps(_mm256_set1_ps(1.0), d),
        pos,
    )
}

/// `ops::silu_op_isa` over the whole 8-element steps of `a`; returns how many elements it did
/// (the caller does the tail with the scalar form, which gives the same bits).
///
/// # Safety
/// The CPU must support AVX2 and FMA; `b.len() >= a.len()` unless `op` is `InPlace`.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn silu_op(op: crate::ops::SiluOp, a: &mut [f32], b: &[f32]) -> usize {
    use crate::ops::SiluOp;
    let n = a.len() / 8 * 8;
    debug_assert!(op == SiluOp::InPlace || b.len() >= n);
    let (pa, pb) = (a.as_mut_ptr(), b.as_ptr());
    let mut i = 0;
    while i < n {
        // SAFETY: i + 8 <= n <= a.len(), and <= b.len() for the ops that read b (caller's
        // contract).
        unsafe {
            let x = _mm256_loadu_ps(pa.add(i));
            let y = match op {
                SiluOp::InPlace => _mm256_mul_ps(x, sigmoid8(x)),
                SiluOp::GateMulUp => {
                    _mm256_mul_ps(_mm256_mul_ps(x, sigmoid8(x)), _mm256_loadu_ps(pb.add(i)))
                }
                SiluOp::MulByGate => {
                    let z = _mm256_loadu_ps(pb.add(i));
                    _mm256_mul_ps(x, _mm256_mul_ps(z, sigmoid8(z)))
                }
            };
            _mm256_storeu_ps(pa.add(i), y);
        }
        i += 8;
    }
    n
}

/// `ops::quantize_row_isa` with AVX2: per 32-element block the same f32 `amax`, `d = amax / 127`
/// and `1 / d`, the same products and the same rounding (`trunc`, then ±1 where the exact fraction
/// reaches ±0.5, clamped to ±127; NaN products give 0 like `ops::round_to_i8`); a chunk's 8 blocks
/// then go to their `q1p` vectors by one 8 × 8 dword transpose.
///
/// # Safety
/// The CPU must support AVX2 and FMA; the lengths must be as `ops::quantize_row_isa` asserts.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn quantize_row(
    xr: &[f32],
    p1row: &mut [i8],
    drow: &mut [f32],
    srow: &mut [i32],
) {
    // the caller asserts the lengths; below, every load stays inside the blocks of xr, every store
    // of codes is asserted, and the scales and sums are indexed with bounds checks
    let n_pad = p1row.len();
    let nb = xr.len() / 32;
    let sign = _mm256_set1_ps(-0.0);
    let (lo, hi) = (_mm256_set1_ps(-128.0), _mm256_set1_ps(128.0));
    let (qlo, qhi) = (_mm256_set1_ps(-127.0), _mm256_set1_ps(127.0));
    let (half, nhalf, one) = (
        _mm256_set1_ps(0.5),
        _mm256_set1_ps(-0.5),
        _mm256_set1_ps(1.0),
    );
    // packs_epi32 / packs_epi16 interleave 128-bit lanes: dwords (0, 4, 1, 5, 2, 6, 3, 7) restore
    // element order
    let unlace = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    let px = xr.as_ptr();
    for c in 0..n_pad / 256 {
        let mut blk = [_mm256_setzero_si256(); 8]; // blk[l]: block 8c + l's 32 codes in order
        for (l, bv) in blk.iter_mut().enumerate() {
            let b = 8 * c + l;
            if b >= nb {
                break;
            }
            // SAFETY: block b's 32 floats lie inside xr (b < n_in / 32).
            let xv: [__m256; 4] =
                core::array::from_fn(|j| unsafe { _mm256_loadu_ps(px.add(32 * b + 8 * j)) });
            // amax: max_ps(|x|, m) returns m for a NaN |x|, as f32::max ignores NaN
            let mut m = _mm256_setzero_ps();
            for v in xv {
                m = _mm256_max_ps(_mm256_andnot_ps(sign, v), m);
            }
            let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            let m1 = _mm_max_ss(m2, _mm_shuffle_ps(m2, m2, 1));
            let amax = _mm_cvtss_f32(m1);
            let db = amax / 127.0;
            let id = if db != 0.0 { 1.0 / db } else { 0.0 };
            let idv = _mm256_set1_ps(id);
            let mut qi = [_mm256_setzero_si256(); 4];
            let mut sv = _mm256_setzero_si256();
            for j in 0..4 {
                let v = _mm256_mul_ps(xv[j], idv);
                let ord = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_ORD_Q));
                let vc = _mm256_min_ps(_mm256_max_ps(v, lo), hi);
                let t = _mm256_round_ps(vc, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
                let f = _mm256_sub_ps(vc, t);
                let up = _mm256_and_ps(_mm256_cmp_ps(f, half, _CMP_GE_OQ), one);
                let dn = _mm256_and_ps(_mm256_cmp_ps(f, nhalf, _CMP_LE_OQ), one);
                let r = _mm256_sub_ps(_mm256_add_ps(t, up), dn);
                let r = _mm256_min_ps(_mm256_max_ps(r, qlo), qhi);
                qi[j] = _mm256_and_si256(_mm256_cvtps_epi32(r), ord);
                sv = _mm256_add_epi32(sv, qi[j]);
            }
            let s4 = _mm_add_epi32(_mm256_castsi256_si128(sv), _mm256_extracti128_si256(sv, 1));
            let s2 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
            let s1 = _mm_add_epi32(s2, _mm_shuffle_epi32(s2, 1));
            drow[b] = db;
            srow[b] = _mm_cvtsi128_si32(s1);
            let w01 = _mm256_packs_epi32(qi[0], qi[1]);
            let w23 = _mm256_packs_epi32(qi[2], qi[3]);
            *bv = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w01, w23), unlace);
        }
        // transpose: q1p vector k's dword l = block l's dword k
        let t: [__m256i; 8] = core::array::from_fn(|i| {
            let (a, b) = (blk[2 * (i / 2)], blk[2 * (i / 2) + 1]);
            if i % 2 == 0 {
                _mm256_unpacklo_epi32(a, b)
            } else {
                _mm256_unpackhi_epi32(a, b)
            }
        });
        // t[0] = lo(B0, B1), t[1] = hi(B0, B1), t[2] = lo(B2, B3), ...; u[4h + i]: dword k = i (low
        // lane) or 4 + i (high lane) of blocks 4h..4h + 4
        let mut u = [_mm256_setzero_si256(); 8];
        for h in 0..2 {
            let (a0, a1, b0, b1) = (t[4 * h], t[4 * h + 1], t[4 * h + 2], t[4 * h + 3]);
            u[4 * h] = _mm256_unpacklo_epi64(a0, b0);
            u[4 * h + 1] = _mm256_unpackhi_epi64(a0, b0);
            u[4 * h + 2] = _mm256_unpacklo_epi64(a1, b1);
            u[4 * h + 3] = _mm256_unpackhi_epi64(a1, b1);
        }
        for k in 0..8 {
            let i = k % 4;
            let v = if k < 4 {
                _mm256_permute2x128_si256(u[i], u[4 + i], 0x20)
            } else {
                _mm256_permute2x128_si256(u[i], u[4 + i], 0x31)
            };
            let off = crate::ops::q1p_vec(n_pad, c, k);
            assert!(off + 32 <= n_pad);
            // SAFETY: 32 bytes at off lie inside p1row (asserted).
            unsafe { _mm256_storeu_si256(p1row.as_mut_ptr().add(off) as *mut __m256i, v) };
        }
    }
}

/// See `ops::log_sum_exp`: the same maximum, the same 8 lane accumulators in the same order, the
/// same final f64 combination, so the result is the same bits.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn log_sum_exp(x: &[f32]) -> f64 {
    let n = x.len();
    let p = x.as_ptr();
    // maximum ignoring NaN: _mm256_max_ps(v, m) returns m when v is NaN, like f32::max
    let mut mv = _mm256_set1_ps(f32::NEG_INFINITY);
    let mut i = 0;
    // SAFETY (all loads below): every load reads 8 elements at i with i + 8 <= n.
    while i + 8 <= n {
        mv = _mm256_max_ps(unsafe { _mm256_loadu_ps(p.add(i)) }, mv);
        i += 8;
    }
    let mut lanes = [0f32; 8];
    // SAFETY: lanes holds 8 f32.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), mv) };
    let mut max = f32::NEG_INFINITY;
    for &l in &lanes {
        max = max.max(l);
    }
    for &v in &x[i..] {
        max = max.max(v);
    }
    if max == f32::NEG_INFINITY {
        return f64::NEG_INFINITY;
    }
    if max.is_nan() || max == f32::INFINITY {
        return max as f64;
    }
    let mb = _mm256_set1_ps(max);
    let mut acc = _mm256_setzero_ps();
    let mut i = 0;
    while i + 8 <= n {
        let v = unsafe { _mm256_loadu_ps(p.add(i)) };
        acc = _mm256_add_ps(acc, exp_nonpos8(_mm256_sub_ps(v, mb)));
        i += 8;
    }
    let mut a = [0f32; 8];
    // SAFETY: a holds 8 f32.
    unsafe { _mm256_storeu_ps(a.as_mut_ptr(), acc) };
    let mut tail = 0f64;
    for &v in &x[i..] {
        tail += crate::ops::exp_nonpos(v - max) as f64;
    }
    let sum = ((a[0] as f64 + a[4] as f64) + (a[2] as f64 + a[6] as f64))
        + ((a[1] as f64 + a[5] as f64) + (a[3] as f64 + a[7] as f64))
        + tail;
    max as f64 + sum.ln()
}

/// f16 bits at `b[i..i + 2]` → f32, by `vcvtph2ps` (exact, like `half`'s conversion).
#[inline]
#[target_feature(enable = "avx2,f16c")]
pub(crate) fn f16_f32(b: &[u8], i: usize) -> f32 {
    let h = u16::from_le_bytes([b[i], b[i + 1]]);
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)))
}

/// One 32-element block of Q4_0 / Q4_1 / Q8_0 (`blk`: its bytes) dequantized into 4 vectors of 8
/// (elements 8v..8v+8): `q·d`, or `q·d + m` for Q4_1, each a separate rounding as in
/// `quant::dequantize_block`.
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn dequant_block_q32(qt: QuantType, blk: &[u8]) -> [__m256; 4] {
    let d = _mm256_set1_ps(f16_f32(blk, 0));
    let q: [__m256i; 4] = if qt == QuantType::Q8_0 {
        assert!(blk.len() >= 34);
        let p = blk.as_ptr();
        // SAFETY: blk has at least 34 bytes; each 8-byte load reads blk[2 + 8v .. 10 + 8v].
        unsafe {
            [
                _mm256_cvtepi8_epi32(_mm_loadl_epi64(p.add(2) as *const __m128i)),
                _mm256_cvtepi8_epi32(_mm_loadl_epi64(p.add(10) as *const __m128i)),
                _mm256_cvtepi8_epi32(_mm_loadl_epi64(p.add(18) as *const __m128i)),
                _mm256_cvtepi8_epi32(_mm_loadl_epi64(p.add(26) as *const __m128i)),
            ]
        }
    } else {
        let off = if qt == QuantType::Q4_1 { 4 } else { 2 };
        assert!(blk.len() >= off + 16);
        // SAFETY: blk has at least off + 16 bytes; the load reads the 16 nibble bytes.
        let qs = unsafe { _mm_loadu_si128(blk.as_ptr().add(off) as *const __m128i) };
        let lo = _mm_and_si128(qs, _mm_set1_epi8(0x0F)); // elements 0..16
        let hi = _mm_and_si128(_mm_srli_epi16(qs, 4), _mm_set1_epi8(0x0F)); // 16..32
        let mut q = [
            _mm256_cvtepu8_epi32(lo),
            _mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)),
            _mm256_cvtepu8_epi32(hi),
            _mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)),
        ];
        if qt == QuantType::Q4_0 {
            for v in &mut q {
                *v = _mm256_sub_epi32(*v, _mm256_set1_epi32(8));
            }
        }
        q
    };
    let m = if qt == QuantType::Q4_1 {
        Some(_mm256_set1_ps(f16_f32(blk, 2)))
    } else {
        None
    };
    q.map(|qv| {
        let y = _mm256_mul_ps(_mm256_cvtepi32_ps(qv), d);
        match m {
            Some(m) => _mm256_add_ps(y, m),
            None => y,
        }
    })
}

/// Bytes of one 32-element step of `qt` for [`dequant_step32`]: a block of Q4_0 / Q4_1 / Q8_0, 64
/// bytes of F16 / BF16; `None` for any other type.
#[inline]
pub(crate) fn step32_bytes(qt: QuantType) -> Option<usize> {
    match qt {
        QuantType::Q4_0 | QuantType::Q4_1 | QuantType::Q8_0 => Some(qt.block_bytes()),
        QuantType::F16 | QuantType::BF16 => Some(64),
        _ => None,
    }
}

/// 32 consecutive elements of a row of `qt` (`b`: their [`step32_bytes`] bytes) as 4 vectors of 8
/// (elements 8v..8v+8), with `quant::dequantize_row`'s f32 values: [`dequant_block_q32`] for the
/// block types; F16 by `vcvtph2ps` and BF16 by a 16-bit shift, both exact.
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn dequant_step32(qt: QuantType, b: &[u8]) -> [__m256; 4] {
    match qt {
        QuantType::F16 | QuantType::BF16 => {
            assert!(b.len() >= 64);
            core::array::from_fn(|v| {
                // SAFETY: b has at least 64 bytes; the load reads b[16v .. 16v + 16].
                let h = unsafe { _mm_loadu_si128(b.as_ptr().add(16 * v) as *const __m128i) };
                if qt == QuantType::F16 {
                    _mm256_cvtph_ps(h)
                } else {
                    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
                }
            })
        }
        _ => dequant_block_q32(qt, b),
    }
}

/// `quant::dequantize_row` for Q4_0, Q4_1 and Q8_0 (32-element blocks) and for F16 / BF16 rows of
/// whole 32-element steps, 8 lanes at a time: the same f32 values, so the same bits. Returns
/// false, writing nothing, for any other type or row length.
///
/// # Safety
/// The CPU must support AVX2 and F16C. (`src` being exactly `qt.row_bytes(out.len())` bytes is
/// asserted here, before any read.)
#[target_feature(enable = "avx2,f16c")]
pub(crate) unsafe fn dequantize_row_q32(qt: QuantType, src: &[u8], out: &mut [f32]) -> bool {
    let Some(sb) = step32_bytes(qt) else {
        return false;
    };
    if out.len() % 32 != 0 {
        return false;
    }
    assert_eq!(Some(src.len()), qt.row_bytes(out.len()));
    for (blk, o) in src.chunks_exact(sb).zip(out.chunks_exact_mut(32)) {
        for (v, y) in dequant_step32(qt, blk).iter().enumerate() {
            // SAFETY: o has 32 elements; the store writes o[8v..8v+8].
            unsafe { _mm256_storeu_ps(o.as_mut_ptr().add(8 * v), *y) };
        }
    }
    true
}

/// The step bytes ([`step32_bytes`]) with which [`dot_q32_rows`] and
/// `avx512::dot_q32_rows_512` walk `wrow` against the rows `xs`: `None` for a type they do not take
/// or rows that are not whole 32-element steps. Asserts that every row has the same length and
/// `wrow` is one weight row of it.
pub(crate) fn rows_step_bytes(qt: QuantType, wrow: &[u8], xs: &[&[f32]]) -> Option<usize> {
    let sb = step32_bytes(qt)?;
    let n_in = xs[0].len();
    if n_in % 32 != 0 {
        return None;
    }
    for x in xs {
        assert_eq!(x.len(), n_in);
    }
    assert_eq!(Some(wrow.len()), qt.row_bytes(n_in));
    Some(sb)
}

/// `dot(dequantize_row(wrow), xs[t])` for N activation rows at once without the f32 row in
/// memory, for Q4_0, Q4_1, Q8_0 and, for rows of whole 32-element steps, F16 / BF16: each step of
/// the weight row is dequantized once (into registers) and goes into the 4 accumulators of [`dot`]
/// of every activation row (a step is one of `dot`'s 32-element steps), so each result has
/// `dot(dequantize_row(wrow), xs[t])`'s bits. `None` for other types or lengths.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C. `wrow` must be exactly `qt.row_bytes(xs[t].len())`
/// bytes for every t (asserted here, before any read).
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_q32_rows<const N: usize>(
    qt: QuantType,
    wrow: &[u8],
    xs: [&[f32]; N],
) -> Option<[f32; N]> {
    let sb = rows_step_bytes(qt, wrow, &xs)?;
    let mut acc = [[_mm256_setzero_ps(); 4]; N];
    for (s, blk) in wrow.chunks_exact(sb).enumerate() {
        let w = dequant_step32(qt, blk);
        for (a, x) in acc.iter_mut().zip(&xs) {
            for k in 0..4 {
                // SAFETY: 32s + 32 <= n_in = x.len(); the load reads x[32s + 8k .. 32s + 8k + 8].
                let xv = unsafe { _mm256_loadu_ps(x.as_ptr().add(32 * s + 8 * k)) };
                a[k] = _mm256_fmadd_ps(w[k], xv, a[k]);
            }
        }
    }
    Some(acc.map(|a| {
        hsum_ps(_mm256_add_ps(
            _mm256_add_ps(a[0], a[1]),
            _mm256_add_ps(a[2], a[3]),
        ))
    }))
}

/// One Q2 row (`src`, file layout, `n_in` elements of `qt`: g128, PQ2_0 or g64) into the mask
/// layout (`dst`, the same length): `crate::q2m::pack_row_fast` on 8 words at a time. For field ℓ
/// and a, the 8 file bytes holding pair elements `128ℓ + 32a .. + 32` zero-extend to the u32 lanes
/// k = 0..8, ℓ shifted into byte ℓ; each lane's 4×4 2-bit transpose is bytes `4a .. 4a + 4` of
/// vector k, and a 4×8 u32 transpose puts the 4 a of each k side by side. Returns whether any code
/// of the row's whole pairs is 3 (the layout's kernels need 0..2).
///
/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn q2m_pack_row(qt: QuantType, src: &[u8], n_in: usize, dst: &mut [u8]) -> bool {
    assert!(crate::q2m::supports(qt));
    assert!(Some(src.len()) == qt.row_bytes(n_in) && dst.len() == src.len());
    dst.copy_from_slice(src);
    let (pb, sb) = (crate::q2m::pair_bytes(qt), crate::q2m::scale_bytes(qt));
    let (g, bb) = (qt.block_elems(), qt.block_bytes());
    let (m1, m2) = (
        _mm256_set1_epi32(0x00CC_00CC),
        _mm256_set1_epi32(0x0000_F0F0),
    );
    let m55 = _mm256_set1_epi32(0x5555_5555);
    let mut bad = _mm256_setzero_si256();
    for s in 0..n_in / crate::q2m::PAIR_ELEMS {
        let sp = &src[s * pb..(s + 1) * pb];
        let dp = &mut dst[s * pb..(s + 1) * pb];
        for b in 0..sb / 2 {
            dp[2 * b..2 * b + 2].copy_from_slice(&sp[b * bb..b * bb + 2]);
        }
        let mut y = [_mm256_setzero_si256(); 4];
        for (a, ya) in y.iter_mut().enumerate() {
            let mut x = _mm256_setzero_si256();
            for l in 0..4 {
                let e = 128 * l + 32 * a;
                let off = (e / g) * bb + 2 + (e % g) / 4;
                let b8 = &sp[off..off + 8];
                // SAFETY: reads the 8 bytes of b8 (checked by slicing).
                let v =
                    _mm256_cvtepu8_epi32(unsafe { _mm_loadl_epi64(b8.as_ptr() as *const __m128i) });
                let v = match l {
                    0 => v,
                    1 => _mm256_slli_epi32(v, 8),
                    2 => _mm256_slli_epi32(v, 16),
                    _ => _mm256_slli_epi32(v, 24),
                };
                x = _mm256_or_si256(x, v);
            }
            // a code 3: both bits of a field
            bad = _mm256_or_si256(
                bad,
                _mm256_and_si256(_mm256_and_si256(x, _mm256_srli_epi32(x, 1)), m55),
            );
            // the 4×4 transpose of 2-bit fields (`crate::q2m`'s transpose4x4_2bit) in each lane
            let t = _mm256_and_si256(_mm256_xor_si256(x, _mm256_srli_epi32(x, 6)), m1);
            let x = _mm256_xor_si256(x, _mm256_xor_si256(t, _mm256_slli_epi32(t, 6)));
            let t = _mm256_and_si256(_mm256_xor_si256(x, _mm256_srli_epi32(x, 12)), m2);
            *ya = _mm256_xor_si256(x, _mm256_xor_si256(t, _mm256_slli_epi32(t, 12)));
        }
        // y[a] lane k → vector k word a: z_i holds vectors i (low 128 bits) and i + 4 (high)
        let t0 = _mm256_unpacklo_epi32(y[0], y[1]);
        let t1 = _mm256_unpackhi_epi32(y[0], y[1]);
        let t2 = _mm256_unpacklo_epi32(y[2], y[3]);
        let t3 = _mm256_unpackhi_epi32(y[2], y[3]);
        let z0 = _mm256_unpacklo_epi64(t0, t2);
        let z1 = _mm256_unpackhi_epi64(t0, t2);
        let z2 = _mm256_unpacklo_epi64(t1, t3);
        let z3 = _mm256_unpackhi_epi64(t1, t3);
        let out = &mut dp[sb..sb + 128];
        // SAFETY: four 32-byte stores into `out`'s 128 bytes (checked by slicing).
        unsafe {
            let o = out.as_mut_ptr() as *mut __m256i;
            _mm256_storeu_si256(o, _mm256_permute2x128_si256(z0, z1, 0x20));
            _mm256_storeu_si256(o.add(1), _mm256_permute2x128_si256(z2, z3, 0x20));
            _mm256_storeu_si256(o.add(2), _mm256_permute2x128_si256(z0, z1, 0x31));
            _mm256_storeu_si256(o.add(3), _mm256_permute2x128_si256(z2, z3, 0x31));
        }
    }
    _mm256_testz_si256(bad, bad) == 0
}
