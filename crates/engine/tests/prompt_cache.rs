//! The engine's prompt cache on the CPU backend: a request whose prompt starts with the previous
//! prompt resumes from the GDN state saved at that prompt's last prefill-chunk boundary, and gives
//! exactly what a fresh prefill gives — tokens and logprob bits, greedy and seeded sampling — for
//! every weight type, the q8_0 KV cache, and with DSpark / n-gram drafting (tokens). The sequence
//! of requests and the expected resumed lengths are `common::prompt_cache_equals_fresh`; the CUDA
//! and Vulkan backends run the same check in `cuda_spec` and `vulkan_forward` (on a GPU).

mod common;

use std::path::{Path, PathBuf};

use bonsai_engine::backend::KvType;
use bonsai_engine::engine::{
    DraftSource, Engine, EngineOptions, PREFILL_CHUNK, PROMPT_CACHE_ENTRIES,
};
use bonsai_engine::spec::Rollback;
use bonsai_engine::QuantType;

fn write(dir: &Path, b: &common::Builder, name: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, b.build()).unwrap();
    p
}

fn engine(
    path: &Path,
    cache: Option<usize>,
    chunk: usize,
    kv: KvType,
    draft: Option<DraftSource>,
) -> Engine {
    common::chunked_engine(path, "cpu", draft, Rollback::Replay, kv, chunk, cache)
}

const ENTRIES: Option<usize> = Some(PROMPT_CACHE_ENTRIES);
/// The CPU backend's prefill granule (its delta-rule chunk): the prompt cache's boundaries on 512-
/// and 64-row prefill chunks alike.
const CPU_GRANULE: usize = 64;

#[test]
fn cpu_prompt_cache_equals_fresh_prefill() {
    let dir = std::env::temp_dir().join(format!("bonsai-prompt-cache-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let check = |m: &Path, chunk: usize, kv: KvType, label: &str| {
        let fresh = engine(m, None, chunk, kv, None);
        let cached = engine(m, ENTRIES, chunk, kv, None);
        let n = common::prompt_cache_equals_fresh(
            &cached,
            &fresh,
            true,
            chunk,
            CPU_GRANULE,
            PROMPT_CACHE_ENTRIES,
            label,
        );
        println!("{label}, chunk {chunk}: cached == fresh (tokens and logprob bits), {n} resumed");
    };
    // the engine's default chunk on Q1_0; every weight type and the q8_0 KV cache on 64-row chunks
    // (the same code at an eighth of the prompt lengths)
    let q1 = write(&dir, &common::tiny_target(QuantType::Q1_0), "q1.gguf");
    check(&q1, PREFILL_CHUNK, KvType::F16, "Q1_0");
    for wt in common::WEIGHT_TYPES {
        let m = write(
            &dir,
            &common::tiny_target(wt),
            &format!("{}.gguf", wt.name()),
        );
        check(&m, 64, KvType::F16, wt.name());
    }
    check(&q1, 64, KvType::Q8_0, "Q1_0 q8_0 KV");
    // only the live lineage (no stash)
    let fresh = engine(&q1, None, 64, KvType::F16, None);
    let live_only = engine(&q1, Some(0), 64, KvType::F16, None);
    let n =
        common::prompt_cache_equals_fresh(&live_only, &fresh, true, 64, 64, 0, "Q1_0 live only");
    println!("Q1_0 live lineage only, chunk 64: cached == fresh, {n} resumed");
    // drafting: the drafter's context is truncated with the target's; the tokens stay the plain ones
    let d = write(&dir, &common::tiny_drafter(QuantType::Q1_0), "drafter.gguf");
    for chunk in [64, PREFILL_CHUNK] {
        let fresh = engine(&q1, None, chunk, KvType::F16, None);
        for (kind, src) in [
            ("dspark", DraftSource::Dspark(d.clone())),
            ("ngram", DraftSource::Ngram),
        ] {
            let cached = engine(&q1, ENTRIES, chunk, KvType::F16, Some(src));
            let label = format!("Q1_0 {kind}");
            common::prompt_cache_equals_fresh(
                &cached,
                &fresh,
                false,
                chunk,
                CPU_GRANULE,
                PROMPT_CACHE_ENTRIES,
                &label,
            );
            let st = cached.spec_report().expect("drafter").totals;
            assert!(st.rounds > 0, "{label}: no speculative round ran");
            println!(
                "{label}, chunk {chunk}: cached + drafting == fresh plain (tokens), {} rounds",
                st.rounds
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A prefill chunk of 0 rows is refused with an error naming it.
#[test]
fn prefill_chunk_zero_is_an_error() {
    let dir = std::env::temp_dir().join(format!("bonsai-prompt-cache-z-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let m = write(&dir, &common::tiny_target(QuantType::Q1_0), "q1.gguf");
    let opts = EngineOptions {
        device: "cpu".into(),
        prefill_chunk: 0,
        ..Default::default()
    };
    let err = Engine::load(&m, &opts)
        .err()
        .expect("prefill_chunk 0 loaded");
    assert!(err.to_string().contains("prefill_chunk"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}
