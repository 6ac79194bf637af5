//! Embeds the cubins of `cubins/` (made by `scripts/build_cubins.py` before a wheel build) when
//! they exist; otherwise embeds none and the kernels are compiled by NVRTC at first use.

use std::fmt::Write as _;
use std::path::Path;

fn main() {
    // the manifest directory of this build, read when the script runs: `env!` would bake in the
    // path of whichever checkout first compiled the script, and cargo reuses a compiled build
    // script across worktrees that share a target directory
    let manifest = std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    let dir = Path::new(&manifest).join("cubins");
    println!("cargo:rerun-if-changed={}", dir.display());
    println!(
        "cargo:rerun-if-changed={}",
        dir.join("manifest.txt").display()
    );
    let mut code = String::new();
    let mut hash = String::new();
    let mut entries = Vec::new();
    if let Ok(m) = std::fs::read_to_string(dir.join("manifest.txt")) {
        for line in m.lines() {
            let mut it = line.split_whitespace();
            match (it.next(), it.next()) {
                (Some("source_fnv64"), Some(h)) => hash = h.to_string(),
                (Some("archs"), _) => {
                    for a in line.split_whitespace().skip(1) {
                        if let Ok(v) = a.parse::<i32>() {
                            let f = dir.join(format!("sm{v}.cubin"));
                            if f.is_file() {
                                println!("cargo:rerun-if-changed={}", f.display());
                                entries.push((v / 10, v % 10, f));
                            }
                        }
                    }
                }
                _ => {}
            }
        }
    }
    writeln!(
        code,
        "/// fnv64 of the kernel source the embedded cubins were built from (hex)."
    )
    .unwrap();
    writeln!(code, "pub const EMBEDDED_SOURCE_HASH: &str = {hash:?};").unwrap();
    writeln!(code, "/// (major, minor, cubin) per embedded architecture.").unwrap();
    writeln!(
        code,
        "pub static EMBEDDED_CUBINS: &[(i32, i32, &[u8])] = &["
    )
    .unwrap();
    for (ma, mi, f) in &entries {
        writeln!(
            code,
            "    ({ma}, {mi}, include_bytes!({:?})),",
            f.display().to_string()
        )
        .unwrap();
    }
    writeln!(code, "];").unwrap();
    let out = Path::new(&std::env::var("OUT_DIR").unwrap()).join("embedded_cubins.rs");
    std::fs::write(out, code).unwrap();
}
