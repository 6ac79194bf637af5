//! AVX-512 (F / BW / VL + VNNI + BITALG) low-bit matmul rows. The same 256-bit lane layout as
//! `avx2` — i32 lane l of a chunk is activation block l — so the float operations are the same
//! ops in the same order and the results are bit-identical to the scalar definition (`ops` module
//! doc). What AVX-512 changes is the integer part:
//!
//! - `vpdpbusd` (VNNI) multiplies u8 codes by s8 activations and adds groups of 4 into i32 lanes in
//!   one instruction, where AVX2 needs `maddubs` + an i16 add + `madd`;
//! - Q1_0's 0/1 bytes come from `vpshufbitqmb` (BITALG: any 8 bits of each 64-bit lane into a mask,
//!   here straight from the weight bits in the permuted activation order) and a zero-masked move,
//!   two instructions per 32 weights where AVX2 needs a byte shuffle, two ANDs and a compare;
//! - 32 vector registers, so 8 activation rows share one unpacked chunk (4 with AVX2).

use crate::avx2::{dw_lanes, hsum_ps, prefetch_lines, q2_chunk_codes, tail_chunk};
use crate::ops::{mk_pair_bytes, mk_type, q1p_chunk, with_mask_kind, QuantActs, MK_Q1, MK_Q2G64};
use crate::q1m;
use crate::quant::QuantType;
use core::arch::x86_64::*;
use core::ops::Range;

/// Activation rows per pass over a weight row (each row keeps an i32 and an f32 accumulator).
const ROWS: usize = 8;

/// `out.len()` consecutive weight rows of `qt` (`rows`, whole rows) against activation row 0 of
/// `xq` — the one-row (decode) case: `out[r]` is row r's dot. One call per task, so the per-row
/// work inlines into one loop.
///
/// # Safety
/// The CPU must support AVX2, FMA, F16C, AVX-512 F/BW/VL, VNNI and BITALG. `rows.len()` must be
/// `out.len()` whole rows of `qt` for `xq.n_in` elements, and `xq.n >= 1`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512bitalg")]
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
            lowbit_rows::<1>(
                qt,
                [&rows[r * rb..(r + 1) * rb]],
                xq,
                0,
                [core::slice::from_mut(y)],
            )
        }
    }
}

/// [`lowbit_rows_one_act`] for rows in a mask layout (`crate::q1m` for Q1_0, `crate::q2m` for the
/// Q2 types): groups of 4 rows share each activation load, and their float chains (two dependent
/// `fma` per pair and row) overlap.
///
/// # Safety
/// The CPU must support AVX2, FMA, F16C, AVX-512 F/BW/VL, VNNI and BITALG. `rows.len()` must be
/// `out.len()` whole mask-layout rows of `qt` for `xq.n_in` elements, and `xq.n >= 1`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512bitalg")]
pub(crate) unsafe fn mask_rows_one_act(
    qt: QuantType,
    rows: &[u8],
    xq: &QuantActs,
    out: &mut [f32],
) {
    let rb = rows.len() / out.len().max(1);
    let mut r = 0;
    macro_rules! go {
        ($R:literal, $S:literal, $M:expr) => {
            while out.len() - r >= $R {
                let w: [&[u8]; $R] =
                    core::array::from_fn(|i| &rows[(r + i) * rb..(r + i + 1) * rb]);
                // SAFETY: the same CPU features as this function; the asserts inside check the
                // rows.
                unsafe { mask_rows_one::<$R, $S, { $M }>(w, xq, &mut out[r..r + $R]) }
                r += $R;
            }
        };
    }
    // 4 rows with one i32 chain each (the rest: one row, two chains). Zen 4, one thread,
    // Q1_0 5120 × 17408: 4 rows / 1 chain 0.99 ms, 2 / 2 1.01, 1 / 2 1.03, 8 / 1 1.07
    // (`tests/bench.rs`)
    with_mask_kind!(qt, M => {
        go!(4, 1, M);
        go!(1, 2, M);
    })
}

/// R mask-layout rows of kind M against activation row 0 (decode): `out[r]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512bitalg")]
unsafe fn mask_rows_one<const R: usize, const S: usize, const M: u8>(
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
    let mut acc = [[_mm256_setzero_ps(); ROWS]; R];
    // the next R rows follow these in memory (one task's rows): stream them towards the caches
    // while these run, at the pace these are read
    let next = wrows[R - 1].as_ptr().wrapping_add(wrows[R - 1].len());
    mask_pairs_s::<R, 1, S, M>(&wrows, xq, 0, c1 / 2, next, &mut acc);
    if M == MK_Q1 {
        q1_chunks::<R, 1>(&wrows, xq, 0, c1..nfull, &mut acc);
    } else {
        q2_chunks::<R, 1>(qt, &wrows, xq, 0, c1..nfull, &mut acc);
    }
    let partial = xq.n_in % 256 != 0;
    for r in 0..R {
        let a = if partial {
            tail_chunk(qt, wrows[r], xq, 0, acc[r][0])
        } else {
            acc[r][0]
        };
        out[r] = hsum_ps(a);
    }
}

macro_rules! by_rows {
    ($nt:expr, $R:ident, $f:ident, $($a:expr),*) => {
        match $nt {
            1 => $f::<$R, 1>($($a),*),
            2 => $f::<$R, 2>($($a),*),
            3 => $f::<$R, 3>($($a),*),
            4 => $f::<$R, 4>($($a),*),
            5 => $f::<$R, 5>($($a),*),
            6 => $f::<$R, 6>($($a),*),
            7 => $f::<$R, 7>($($a),*),
            _ => $f::<$R, 8>($($a),*),
        }
    };
}

/// `R` low-bit weight rows against activation rows `t_begin..t_begin + g` of `xq`: `outs[r][i]`
/// is weight row r's dot with activation row `t_begin + i` (every `outs[r]` has length g). With
/// R = 2 two weight rows share each activation load — every `vpdpbusd` takes its activations from
/// memory, so with several activation rows the loads are what one weight row at a time runs
/// out of.
///
/// # Safety
/// The CPU must support AVX2, FMA, F16C, AVX-512 F/BW/VL, VNNI and BITALG. Each `wrows[r]` must be
/// one whole row of `qt` for `xq.n_in` elements, and `t_begin + g <= xq.n`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512bitalg")]
pub(crate) unsafe fn lowbit_rows<const R: usize>(
    qt: QuantType,
    wrows: [&[u8]; R],
    xq: &QuantActs,
    t_begin: usize,
    outs: [&mut [f32]; R],
) {
    let g = outs[0].len();
    let n = t_begin + g;
    assert!(n <= xq.n);
    for r in 0..R {
        assert_eq!(outs[r].len(), g);
        assert_eq!(Some(wrows[r].len()), qt.row_bytes(xq.n_in));
    }
    let nfull = xq.n_in / 256;
    let mut t0 = t_begin;
    while t0 < n {
        let nt = (n - t0).min(ROWS);
        let mut acc = [[_mm256_setzero_ps(); ROWS]; R]; // acc[r][ti]: 8 lane accumulators
        if qt == QuantType::Q1_0 {
            by_rows!(nt, R, q1_chunks, &wrows, xq, t0, 0..nfull, &mut acc)
        } else {
            by_rows!(nt, R, q2_chunks, qt, &wrows, xq, t0, 0..nfull, &mut acc)
        }
        for r in 0..R {
            for ti in 0..nt {
                acc[r][ti] = tail_chunk(qt, wrows[r], xq, t0 + ti, acc[r][ti]);
            }
            for ti in 0..nt {
                outs[r][t0 - t_begin + ti] = hsum_ps(acc[r][ti]);
            }
        }
        t0 += nt;
    }
}

/// [`lowbit_rows`] for rows in a mask layout (`crate::q1m`, `crate::q2m`): the whole 512-element
/// pairs run [`mask_pairs`], a last unpaired chunk and a partial one the file-layout code.
///
/// # Safety
/// As [`lowbit_rows`], with each `wrows[r]` one whole mask-layout row of `qt`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512bitalg")]
pub(crate) unsafe fn mask_rows<const R: usize>(
    qt: QuantType,
    wrows: [&[u8]; R],
    xq: &QuantActs,
    t_begin: usize,
    outs: [&mut [f32]; R],
) {
    // one function per kind, so each holds only its own chunk code
    // SAFETY: the same CPU features and contract as this function.
    unsafe { with_mask_kind!(qt, M => mask_rows_m::<R, M>(wrows, xq, t_begin, outs)) }
}

/// [`mask_rows`] of kind M.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512bitalg")]
unsafe fn mask_rows_m<const R: usize, const M: u8>(
    wrows: [&[u8]; R],
    xq: &QuantActs,
    t_begin: usize,
    outs: [&mut [f32]; R],
) {
    let qt = mk_type(M);
    let g = outs[0].len();
    let n = t_begin + g;
    assert!(n <= xq.n);
    for r in 0..R {
        assert_eq!(outs[r].len(), g);
        assert_eq!(Some(wrows[r].len()), qt.row_bytes(xq.n_in));
    }
    let nfull = xq.n_in / 256;
    let c1 = 2 * (xq.n_in / q1m::PAIR_ELEMS); // chunks in whole pairs
    let mut t0 = t_begin;
    while t0 < n {
        let nt = (n - t0).min(ROWS);
        let mut acc = [[_mm256_setzero_ps(); ROWS]; R]; // acc[r][ti]: 8 lane accumulators
        macro_rules! pairs {
            ($NT:literal) => {
                mask_pairs::<R, $NT, M>(&wrows, xq, t0, c1 / 2, &mut acc)
            };
        }
        match nt {
            1 => pairs!(1),
            2 => pairs!(2),
            3 => pairs!(3),
            4 => pairs!(4),
            5 => pairs!(5),
            6 => pairs!(6),
            7 => pairs!(7),
            _ => pairs!(8),
        }
        if M == MK_Q1 {
            by_rows!(nt, R, q1_chunks, &wrows, xq, t0, c1..nfull, &mut acc);
        } else {
            by_rows!(nt, R, q2_chunks, qt, &wrows, xq, t0, c1..nfull, &mut acc);
        }
        for r in 0..R {
            for ti in 0..nt {
                acc[r][ti] = tail_chunk(qt, wrows[r], xq, t0 + ti, acc[r][ti]);
            }
            for ti in 0..nt {
                outs[r][t0 - t_begin + ti] = hsum_ps(acc[r][ti]);
            }
        }
        t0 += nt;
    }
}

/// `acc += float(isum) · (dw · da)` for one activation row and one chunk: the float step every
/// path shares (`ops` module doc), with `isum` the 8 blocks' exact integer dots.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn chunk_fma(isum: __m256i, dwv: __m256, da: &[f32], acc: __m256) -> __m256 {
    debug_assert_eq!(da.len(), 8);
    // SAFETY: da has 8 elements.
    let sc = _mm256_mul_ps(dwv, unsafe { _mm256_loadu_ps(da.as_ptr()) });
    _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), sc, acc)
}

/// `vpshufbitqmb` indices of the Q1-permuted order: `Q1_BIT_IDX[k]` byte `8q + j` selects bit
/// `32·(j/4) + 4k + j%4` of 64-bit lane q, so over a chunk's two blocks' bits (lane q = elements
/// `64q..64q+64`) mask bit `8q + j` = `4l + m` is element `32l + 4k + m`: the byte order of
/// vector k of the chunk's q1p activations.
const Q1_BIT_IDX: [[u8; 32]; 8] = {
    let mut idx = [[0u8; 32]; 8];
    let mut k = 0;
    while k < 8 {
        let mut p = 0;
        while p < 32 {
            let j = p % 8;
            idx[k][p] = (32 * (j / 4) + 4 * k + j % 4) as u8;
            p += 1;
        }
        k += 1;
    }
    idx
};

/// [`Q1_BIT_IDX`] as vectors.
#[inline]
#[target_feature(enable = "avx2")]
fn q1_bit_idx() -> [__m256i; 8] {
    // SAFETY: each row of Q1_BIT_IDX has 32 bytes.
    core::array::from_fn(|k| unsafe {
        _mm256_loadu_si256(Q1_BIT_IDX[k].as_ptr() as *const __m256i)
    })
}

/// Q1_0 over the full 256-element chunks for weight rows `wrows` and activation rows
/// `t0..t0+NT`, on the Q1-permuted activations (vector k of a chunk holds elements `32l + 4k + m`
/// at byte `4l + m`). A chunk's two weight blocks' 32 bit-bytes are one 256-bit vector whose
/// 64-bit lane q holds elements `64q..64q+64`, so `vpshufbitqmb` with index byte `8q + j` =
/// `32·(j/4) + 4k + j%4` gives vector k's mask directly. `Σ (2b−1)·q = 2·Σ b·q − Σ q` as in the
/// AVX2 kernel.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512bitalg")]
fn q1_chunks<const R: usize, const NT: usize>(
    wrows: &[&[u8]; R],
    xq: &QuantActs,
    t0: usize,
    chunks: Range<usize>,
    acc: &mut [[__m256; ROWS]; R],
) {
    // q1p keeps the chunks of whole 512-element pairs interleaved (vectors 64 bytes apart) and a
    // last unpaired chunk plain (32 apart): one loop each, with the stride a constant
    let cp = 2 * (xq.n_pad / 512);
    q1_chunks_vs::<R, NT, 64>(wrows, xq, t0, chunks.start..chunks.end.min(cp), acc);
    q1_chunks_vs::<R, NT, 32>(wrows, xq, t0, chunks.start.max(cp)..chunks.end, acc);
}

/// [`q1_chunks`] over chunks whose q1p vectors lie `VS` bytes apart.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512bitalg")]
fn q1_chunks_vs<const R: usize, const NT: usize, const VS: usize>(
    wrows: &[&[u8]; R],
    xq: &QuantActs,
    t0: usize,
    chunks: Range<usize>,
    acc: &mut [[__m256; ROWS]; R],
) {
    if chunks.is_empty() {
        return;
    }
    let nbp = xq.n_pad / 32;
    let ones8 = _mm256_set1_epi8(1);
    let zero = _mm256_setzero_si256();
    let dw_idx = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    let idx = q1_bit_idx();
    // two independent i32 chains per (weight row, activation row) when few pairs share the chunk
    // (vpdpbusd latency)
    let split = if R * NT < 4 { 2 } else { 1 };
    let mut accv = [[_mm256_setzero_ps(); NT]; R];
    for r in 0..R {
        accv[r].copy_from_slice(&acc[r][..NT]);
    }
    // every read below lies inside what these bounds allow
    assert!(t0 + NT <= xq.n && 256 * chunks.end <= xq.n_pad);
    assert!(xq.sums.len() >= (t0 + NT) * nbp && xq.d.len() >= (t0 + NT) * nbp);
    for w in wrows {
        assert!(w.len() >= 36 * chunks.end);
    }
    // acts: row t0's permuted activation bytes; rows t0..t0+NT follow at a stride of n_pad
    let acts = xq.q1p[t0 * xq.n_pad..].as_ptr();
    for c in chunks {
        // vector 0 of chunk c (`q1p_vec`): paired chunks interleave, a last one is plain
        let v0 = if VS == 64 {
            512 * (c / 2) + 32 * (c % 2)
        } else {
            256 * c
        };
        debug_assert_eq!(q1p_chunk(xq.n_pad, c), (v0, VS));
        let off0 = 2 * c * 18;
        let mut b01 = [[zero; 8]; R]; // b01[r][k]: 0/1 bytes in the permuted order of vector k
        let mut dwv = [_mm256_setzero_ps(); R];
        for r in 0..R {
            // SAFETY: chunk c's two blocks (36 bytes from off0) lie inside wrows[r] (asserted).
            let (bits, h0, h1) = unsafe {
                let p = wrows[r].as_ptr().add(off0);
                (
                    _mm256_set_m128i(
                        _mm_loadu_si128(p.add(20) as *const __m128i),
                        _mm_loadu_si128(p.add(2) as *const __m128i),
                    ),
                    core::ptr::read_unaligned(p as *const u16),
                    core::ptr::read_unaligned(p.add(18) as *const u16),
                )
            };
            for (bv, ix) in b01[r].iter_mut().zip(&idx) {
                *bv = _mm256_maskz_mov_epi8(_mm256_bitshuffle_epi64_mask(bits, *ix), ones8);
            }
            dwv[r] = dw_lanes([u16::from_le(h0), u16::from_le(h1), 0, 0], dw_idx);
        }
        let mut bq = [[[zero; 2]; NT]; R]; // bq[r][ti][h]: lane l = partial Σ b·q of block 8c + l
        for k in 0..8 {
            for ti in 0..NT {
                // SAFETY: row t0 + ti < xq.n and c < n_pad / 256 (asserted above), so the 32 bytes
                // of vector k (`q1p_vec`) lie inside q1p.
                let av = unsafe {
                    _mm256_loadu_si256(acts.add(ti * xq.n_pad + v0 + VS * k) as *const __m256i)
                };
                let h = k % split;
                for r in 0..R {
                    bq[r][ti][h] = _mm256_dpbusd_epi32(bq[r][ti][h], b01[r][k], av);
                }
            }
        }
        for r in 0..R {
            for ti in 0..NT {
                let t = t0 + ti;
                let s = &bq[r][ti];
                let bqs = if split == 2 {
                    _mm256_add_epi32(s[0], s[1])
                } else {
                    s[0]
                };
                // SAFETY: blocks 8c .. 8c + 8 of row t lie inside sums and d (asserted above).
                let (sv, dav) = unsafe {
                    (
                        _mm256_loadu_si256(xq.sums.as_ptr().add(t * nbp + 8 * c) as *const __m256i),
                        _mm256_loadu_ps(xq.d.as_ptr().add(t * nbp + 8 * c)),
                    )
                };
                let isum = _mm256_sub_epi32(_mm256_slli_epi32(bqs, 1), sv);
                let sc = _mm256_mul_ps(dwv[r], dav);
                accv[r][ti] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), sc, accv[r][ti]);
            }
        }
    }
    for r in 0..R {
        acc[r][..NT].copy_from_slice(&accv[r]);
    }
}

/// Q2 (g128, PQ2_0 and g64) over the full 256-element chunks for weight rows `wrows`, using the
/// Q2-permuted activations (`qp`): code vector `4·half + s` holds the codes of elements
/// `128·half + 4i + s` at byte i, so after `vpdpbusd` over s, i32 lane L of half h is the sum over
/// elements `128h + 16L .. +16` — half of block `4h + L/2`; one horizontal add and a lane
/// permutation give lane l = block l.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn q2_chunks<const R: usize, const NT: usize>(
    qt: QuantType,
    wrows: &[&[u8]; R],
    xq: &QuantActs,
    t0: usize,
    chunks: Range<usize>,
    acc: &mut [[__m256; ROWS]; R],
) {
    if chunks.is_empty() {
        return;
    }
    let mut accv = [[_mm256_setzero_ps(); NT]; R];
    for r in 0..R {
        accv[r].copy_from_slice(&acc[r][..NT]);
    }
    assert!(t0 + NT <= xq.n && 256 * chunks.end <= xq.n_pad);
    // acts: row t0's Q2-permuted activation bytes; rows t0..t0+NT follow at a stride of n_pad
    let acts = xq.qp()[t0 * xq.n_pad..].as_ptr();
    let nbp = xq.n_pad / 32;
    let zero = _mm256_setzero_si256();
    let perm = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
    for c in chunks {
        // codes[r][4*half + s]: byte i = code of chunk element 128*half + 4i + s
        let mut codes = [[zero; 8]; R];
        let mut dwv = [_mm256_setzero_ps(); R];
        for r in 0..R {
            (codes[r], dwv[r]) = q2_chunk_codes!(qt, wrows[r], c);
        }
        // yh[r][ti][half]: lanes (2b, 2b+1) = halves of block 4·half + b
        let mut yh = [[[zero; 2]; NT]; R];
        for s in 0..4 {
            for ti in 0..NT {
                for hf in 0..2 {
                    // SAFETY: row t0 + ti < xq.n and 256c + 256 <= n_pad (asserted above), so the
                    // 32 bytes at 256c + 128hf + 32s lie inside qp.
                    let av = unsafe {
                        _mm256_loadu_si256(
                            acts.add(ti * xq.n_pad + 256 * c + 128 * hf + 32 * s) as *const __m256i
                        )
                    };
                    for r in 0..R {
                        yh[r][ti][hf] =
                            _mm256_dpbusd_epi32(yh[r][ti][hf], codes[r][4 * hf + s], av);
                    }
                }
            }
        }
        for r in 0..R {
            for ti in 0..NT {
                let t = t0 + ti;
                let y = &yh[r][ti];
                let h = _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(y[0], y[1]), perm);
                let sums = &xq.sums[t * nbp + 8 * c..][..8];
                // SAFETY: sums has 8 i32 elements.
                let isum = _mm256_sub_epi32(h, unsafe {
                    _mm256_loadu_si256(sums.as_ptr() as *const __m256i)
                });
                accv[r][ti] = chunk_fma(isum, dwv[r], &xq.d[t * nbp + 8 * c..][..8], accv[r][ti]);
            }
        }
    }
    for r in 0..R {
        acc[r][..NT].copy_from_slice(&accv[r]);
    }
}

/// Rows in a mask layout of kind M over the first `npair` 512-element pairs of weight rows
/// `wrows` and activation rows `t0..t0+NT`: [`mask_pairs_s`] with two i32 chains per (weight row,
/// activation row) when few pairs share a vector (`vpdpbusd` latency).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn mask_pairs<const R: usize, const NT: usize, const M: u8>(
    wrows: &[&[u8]; R],
    xq: &QuantActs,
    t0: usize,
    npair: usize,
    acc: &mut [[__m256; ROWS]; R],
) {
    let none = core::ptr::null();
    if R * NT < 4 {
        mask_pairs_s::<R, NT, 2, M>(wrows, xq, t0, npair, none, acc)
    } else {
        mask_pairs_s::<R, NT, 1, M>(wrows, xq, t0, npair, none, acc)
    }
}

/// The mask-layout pairs with `S` independent i32 chains per (weight row, activation row). Per 64
/// weights one broadcast, one AND and one `vpdpbusd` with each activation row's 64-byte q1p vector
/// k of the pair, whose i32 lane `L = 8h + l` is block `8(2s + h) + l`:
/// - Q1_0 (`crate::q1m`): word k broadcast to every qword, ANDed with `1 << (p / 8)` in byte p,
///   leaves `2^(L/2) · Σ b·q` in lane L; `vpsravd` by L / 2, then `Σ (2b − 1)·q = 2·Σ b·q − Σ q`;
/// - Q2 (`crate::q2m`): vector k's 16 bytes broadcast to every 128-bit lane, ANDed with
///   `3 << 2(p / 16)`, leave `4^(L/4) · Σ c·q`; `vpsravd` by 2·(L / 4), then
///   `Σ (c − 1)·q = Σ c·q − Σ q`.
///
/// The float step is the chunk kernels' for chunk 2s (low half) and then chunk 2s + 1 (high
/// half): the same operations in the same order, the same bits. With `prefetch` non-null, the
/// lines of the R rows that follow are requested at the pace these are read.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn mask_pairs_s<const R: usize, const NT: usize, const S: usize, const M: u8>(
    wrows: &[&[u8]; R],
    xq: &QuantActs,
    t0: usize,
    npair: usize,
    prefetch: *const u8,
    acc: &mut [[__m256; ROWS]; R],
) {
    let nbp = xq.n_pad / 32;
    let pb = mk_pair_bytes(M);
    // the bytes of the 64-byte operand that carry their weight at one power of two per i32 lane:
    // Q1_0 byte p: 1 << (p / 8); Q2 byte p: 3 << 2(p / 16)
    let sel = if M == MK_Q1 {
        _mm512_setr_epi64(
            0x0101_0101_0101_0101,
            0x0202_0202_0202_0202,
            0x0404_0404_0404_0404,
            0x0808_0808_0808_0808,
            0x1010_1010_1010_1010,
            0x2020_2020_2020_2020,
            0x4040_4040_4040_4040,
            0x8080_8080_8080_8080u64 as i64,
        )
    } else {
        _mm512_setr_epi64(
            0x0303_0303_0303_0303,
            0x0303_0303_0303_0303,
            0x0C0C_0C0C_0C0C_0C0C,
            0x0C0C_0C0C_0C0C_0C0C,
            0x3030_3030_3030_3030,
            0x3030_3030_3030_3030,
            0xC0C0_C0C0_C0C0_C0C0u64 as i64,
            0xC0C0_C0C0_C0C0_C0C0u64 as i64,
        )
    };
    // lane L: the power of two its bytes carry
    let lane_shift = if M == MK_Q1 {
        _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7)
    } else {
        _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6)
    };
    let zero = _mm512_setzero_si512();
    // lane L ← d of the weight block holding block L: 4 scales of 128 (Q1_0, g128), 8 of 64
    let dw_idx = if M == MK_Q2G64 {
        _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7)
    } else {
        _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3)
    };
    // the pair's weight operands start after its scales
    let wo = if M == MK_Q2G64 { 16 } else { 8 };
    assert!(t0 + NT <= xq.n && q1m::PAIR_ELEMS * npair <= xq.n_pad);
    for w in wrows {
        assert!(w.len() >= pb * npair);
    }
    let mut accv = [[_mm256_setzero_ps(); NT]; R];
    for r in 0..R {
        accv[r].copy_from_slice(&acc[r][..NT]);
    }
    // acts: row t0's q1p bytes (pair s's vector k at 512s + 64k); rows follow at n_pad
    let acts = xq.q1p[t0 * xq.n_pad..].as_ptr();
    for s in 0..npair {
        if !prefetch.is_null() {
            prefetch_lines(prefetch.wrapping_add(pb * R * s), pb * R);
        }
        let mut dwv = [_mm512_setzero_ps(); R];
        let mut wp = [core::ptr::null::<u8>(); R];
        for r in 0..R {
            // SAFETY: pair s's pb bytes lie inside wrows[r] (asserted above).
            wp[r] = unsafe { wrows[r].as_ptr().add(pb * s) };
            let d = if M == MK_Q2G64 {
                // SAFETY: reads the pair's first 16 bytes (its 8 f16 scales).
                let h = unsafe { _mm_loadu_si128(wp[r] as *const __m128i) };
                _mm512_castps256_ps512(_mm256_cvtph_ps(h))
            } else {
                // SAFETY: reads the pair's first 8 bytes (its 4 f16 scales).
                let h = unsafe { _mm_loadl_epi64(wp[r] as *const __m128i) };
                _mm512_castps128_ps512(_mm_cvtph_ps(h))
            };
            dwv[r] = _mm512_permutexvar_ps(dw_idx, d);
        }
        let mut bq = [[[zero; S]; NT]; R]; // bq[r][ti][h]: lane L = partial (power)·Σ code·q
        for k in 0..8 {
            let h = k % S;
            let mut wb = [zero; R];
            for r in 0..R {
                let wv = if M == MK_Q1 {
                    // SAFETY: word k is bytes 8 + 8k .. 16 + 8k of the pair (inside, above).
                    _mm512_set1_epi64(unsafe {
                        core::ptr::read_unaligned(wp[r].add(8 + 8 * k) as *const i64)
                    })
                } else {
                    // SAFETY: vector k is bytes wo + 16k .. wo + 16k + 16 of the pair (inside).
                    _mm512_broadcast_i32x4(unsafe {
                        _mm_loadu_si128(wp[r].add(wo + 16 * k) as *const __m128i)
                    })
                };
                wb[r] = _mm512_and_si512(wv, sel);
            }
            for ti in 0..NT {
                // SAFETY: row t0 + ti < xq.n and 512s + 64k + 64 <= n_pad (asserted above).
                let av = unsafe {
                    _mm512_loadu_si512(acts.add(ti * xq.n_pad + 512 * s + 64 * k) as *const __m512i)
                };
                for r in 0..R {
                    bq[r][ti][h] = _mm512_dpbusd_epi32(bq[r][ti][h], wb[r], av);
                }
            }
        }
        for r in 0..R {
            for ti in 0..NT {
                let t = t0 + ti;
                let q = &bq[r][ti];
                let mut bqs = q[0];
                for qh in &q[1..] {
                    bqs = _mm512_add_epi32(bqs, *qh);
                }
                let bqs = _mm512_srav_epi32(bqs, lane_shift);
                let sums = &xq.sums[t * nbp + 16 * s..][..16];
                let da = &xq.d[t * nbp + 16 * s..][..16];
                // SAFETY: sums and da have 16 elements each.
                let (sv, dav) = unsafe {
                    (
                        _mm512_loadu_si512(sums.as_ptr() as *const __m512i),
                        _mm512_loadu_ps(da.as_ptr()),
                    )
                };
                let cq = if M == MK_Q1 {
                    _mm512_slli_epi32(bqs, 1)
                } else {
                    bqs
                };
                let isf = _mm512_cvtepi32_ps(_mm512_sub_epi32(cq, sv));
                let sc = _mm512_mul_ps(dwv[r], dav);
                let a0 = _mm256_fmadd_ps(
                    _mm512_castps512_ps256(isf),
                    _mm512_castps512_ps256(sc),
                    accv[r][ti],
                );
                accv[r][ti] = _mm256_fmadd_ps(hi256_ps(isf), hi256_ps(sc), a0);
            }
        }
    }
    for r in 0..R {
        acc[r][..NT].copy_from_slice(&accv[r]);
    }
}

/// Lanes 8..16 of `v` (AVX-512 F: `vextractf64x4`).
#[inline]
#[target_feature(enable = "avx512f")]
fn hi256_ps(v: __m512) -> __m256 {
    _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))
}

/// One Q1_0 row (`src`, file layout, `n_in` elements) into the mask layout (`dst`, the same
/// length): `crate::q1m::pack_row`, with each chunk's 8 half-words from `vpshufbitqmb` (the chunk
/// kernel's unpacking index: mask bit p = activation byte p of vector k) and one 8×8 bit transpose
/// per word into the layout's bit order.
///
/// # Safety
/// The CPU must support AVX2 and AVX-512 F/BW/VL and BITALG.
#[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl,avx512bitalg")]
pub(crate) unsafe fn q1m_pack_row(src: &[u8], n_in: usize, dst: &mut [u8]) {
    assert_eq!(n_in % 128, 0);
    assert!(src.len() == n_in / 128 * 18 && dst.len() == src.len());
    dst.copy_from_slice(src);
    let idx = q1_bit_idx();
    for s in 0..n_in / q1m::PAIR_ELEMS {
        let sp = &src[q1m::PAIR_BYTES * s..q1m::PAIR_BYTES * (s + 1)];
        let dp = &mut dst[q1m::PAIR_BYTES * s..q1m::PAIR_BYTES * (s + 1)];
        let mut words = [0u64; 8];
        for h in 0..2 {
            let (o0, o1) = (36 * h, 36 * h + 18);
            // SAFETY: each 16-byte load reads one block's bits, inside sp (checked by slicing).
            let bits = unsafe {
                _mm256_set_m128i(
                    _mm_loadu_si128(sp[o1 + 2..o1 + 18].as_ptr() as *const __m128i),
                    _mm_loadu_si128(sp[o0 + 2..o0 + 18].as_ptr() as *const __m128i),
                )
            };
            for (w, ix) in words.iter_mut().zip(&idx) {
                *w |= (_mm256_bitshuffle_epi64_mask(bits, *ix) as u64) << (32 * h);
            }
        }
        // bit p of the shuffle mask → bit 8·(p % 8) + p / 8: the 8×8 bit transpose
        for w in words.iter_mut() {
            *w = q1m::transpose8x8(*w);
        }
        for b in 0..4 {
            dp[2 * b..2 * b + 2].copy_from_slice(&sp[18 * b..18 * b + 2]);
        }
        for (k, w) in words.iter().enumerate() {
            dp[8 + 8 * k..16 + 8 * k].copy_from_slice(&w.to_le_bytes());
        }
    }
}

/// `avx2::dot_q32_rows` on 512-bit vectors: a 32-element step of the weight row is dequantized
/// into 2 vectors of 16 (elements 0..16 and 16..32, each element by `quant::dequantize_row`'s
/// operations), and activation row t keeps `dot`'s 4 accumulators of 8 lanes as 2 of 16
/// (accumulators 0 ‖ 1 and 2 ‖ 3): the same fused multiply-add per element and lane, then the same
/// `(acc0 + acc1) + (acc2 + acc3)` and 8-lane sum, so the same bits with half the instructions.
/// `None` for a type or row length it does not take.
///
/// # Safety
/// The CPU must support AVX2, FMA, F16C and AVX-512 F / BW / VL. `wrow` must be exactly
/// `qt.row_bytes(xs[t].len())` bytes for every t (asserted here, before any read).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
pub(crate) unsafe fn dot_q32_rows_512<const N: usize>(
    qt: QuantType,
    wrow: &[u8],
    xs: [&[f32]; N],
) -> Option<[f32; N]> {
    use crate::avx2::{f16_f32, rows_step_bytes};
    let sb = rows_step_bytes(qt, wrow, &xs)?;
    let mut acc = [[_mm512_setzero_ps(); 2]; N];
    for (s, b) in wrow.chunks_exact(sb).enumerate() {
        // e[h]: elements 16h .. 16h + 16 of the step
        let e: [__m512; 2] = match qt {
            QuantType::F16 | QuantType::BF16 => core::array::from_fn(|h| {
                // SAFETY: a step has 64 bytes; the load reads b[32h .. 32h + 32].
                let v = unsafe { _mm256_loadu_si256(b.as_ptr().add(32 * h) as *const __m256i) };
                if qt == QuantType::F16 {
                    _mm512_cvtph_ps(v)
                } else {
                    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16))
                }
            }),
            _ => {
                let d = _mm512_set1_ps(f16_f32(b, 0));
                let q: [__m512i; 2] = if qt == QuantType::Q8_0 {
                    // SAFETY: a Q8_0 block has 34 bytes; the loads read b[2 + 16h .. 18 + 16h].
                    core::array::from_fn(|h| unsafe {
                        _mm512_cvtepi8_epi32(_mm_loadu_si128(
                            b.as_ptr().add(2 + 16 * h) as *const __m128i
                        ))
                    })
                } else {
                    let off = if qt == QuantType::Q4_1 { 4 } else { 2 };
                    // SAFETY: a Q4_0 / Q4_1 block has off + 16 bytes; the load reads its nibbles.
                    let qs = unsafe { _mm_loadu_si128(b.as_ptr().add(off) as *const __m128i) };
                    let lo = _mm_and_si128(qs, _mm_set1_epi8(0x0F)); // elements 0..16
                    let hi = _mm_and_si128(_mm_srli_epi16(qs, 4), _mm_set1_epi8(0x0F)); // 16..32
                    let mut q = [_mm512_cvtepu8_epi32(lo), _mm512_cvtepu8_epi32(hi)];
                    if qt == QuantType::Q4_0 {
                        for v in &mut q {
                            *v = _mm512_sub_epi32(*v, _mm512_set1_epi32(8));
                        }
                    }
                    q
                };
                let y = q.map(|v| _mm512_mul_ps(_mm512_cvtepi32_ps(v), d));
                if qt == QuantType::Q4_1 {
                    let m = _mm512_set1_ps(f16_f32(b, 2));
                    y.map(|v| _mm512_add_ps(v, m))
                } else {
                    y
                }
            }
        };
        for (a, x) in acc.iter_mut().zip(&xs) {
            for h in 0..2 {
                // SAFETY: 32s + 32 <= n_in = x.len(); the load reads x[32s + 16h .. 32s + 16h + 16].
                let xv = unsafe { _mm512_loadu_ps(x.as_ptr().add(32 * s + 16 * h)) };
                a[h] = _mm512_fmadd_ps(e[h], xv, a[h]);
            }
        }
    }
    Some(acc.map(|[a01, a23]| {
        let (a0, a1) = (_mm512_castps512_ps256(a01), hi256_ps(a01));
        let (a2, a3) = (_mm512_castps512_ps256(a23), hi256_ps(a23));
        hsum_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)))
    }))
}
