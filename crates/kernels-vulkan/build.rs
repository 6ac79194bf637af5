//! Compiles the GLSL compute shaders of `shaders/` (the modules listed in `shaders/variants.txt`) to
//! SPIR-V with `glslc` when it is installed, and otherwise embeds the committed `spv/` modules —
//! provided they were built from these exact sources (`spv/manifest.txt` holds the fnv64 of the
//! sources they came from; `scripts/build_spirv.py` rewrites both). So the crate and the wheel build
//! with no Vulkan SDK, and a developer who edits a shader with glslc at hand never runs stale SPIR-V.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

/// FNV-1a 64 over every file of `shaders/` in name order: name, NUL, contents, NUL.
/// `scripts/build_spirv.py` computes the same.
fn source_hash(dir: &Path) -> String {
    let mut names: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("shaders/ exists")
        .map(|e| e.expect("readable shaders/ entry").path())
        .filter(|p| p.is_file())
        .collect();
    names.sort();
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    };
    for p in names {
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        eat(name.as_bytes());
        eat(&[0]);
        eat(&std::fs::read(&p).expect("readable shader source"));
        eat(&[0]);
    }
    format!("{h:016x}")
}

fn main() {
    // read when the script runs, not baked in with `env!`: cargo reuses a compiled build script
    // across worktrees that share a target directory
    let root = PathBuf::from(
        std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"),
    );
    let src = root.join("shaders");
    let spv = root.join("spv");
    println!("cargo:rerun-if-changed={}", src.display());
    for e in std::fs::read_dir(&src).expect("shaders/ exists").flatten() {
        println!("cargo:rerun-if-changed={}", e.path().display());
    }
    println!(
        "cargo:rerun-if-changed={}",
        spv.join("manifest.txt").display()
    );
    println!("cargo:rerun-if-env-changed=BONSAI_VK_PREBUILT");
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap());
    let hash = source_hash(&src);
    let variants = std::fs::read_to_string(src.join("variants.txt")).expect("variants.txt");
    let glslc = std::env::var("BONSAI_VK_PREBUILT").as_deref() != Ok("1")
        && Command::new("glslc")
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success());
    let committed = std::fs::read_to_string(spv.join("manifest.txt")).unwrap_or_default();
    let committed_ok = committed
        .lines()
        .any(|l| l.trim() == format!("source_fnv64 {hash}"));
    if !glslc && !committed_ok {
        panic!(
            "the shaders in {} changed since spv/ was built and glslc is not installed: install glslc \
             (Debian: apt-get install glslc) or run scripts/build_spirv.py where it is",
            src.display()
        );
    }
    let mut code = String::new();
    writeln!(code, "/// fnv64 of the shader sources this build embeds.").unwrap();
    writeln!(code, "pub const SOURCE_FNV64: &str = \"{hash}\";").unwrap();
    writeln!(
        code,
        "/// Whether glslc compiled them in this build (else: the committed spv/)."
    )
    .unwrap();
    writeln!(code, "pub const FROM_GLSLC: bool = {glslc};").unwrap();
    writeln!(code, "/// (module name, SPIR-V bytes).").unwrap();
    writeln!(code, "pub static MODULES: &[(&str, &[u8])] = &[").unwrap();
    for line in variants.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let mut it = line.split_whitespace();
        let (name, file) = (
            it.next().unwrap(),
            it.next().expect("variants.txt: name file [defines]"),
        );
        let defines: Vec<&str> = it.collect();
        let path = if glslc {
            let dst = out.join(format!("{name}.spv"));
            let o = Command::new("glslc")
                .args(["-O", "--target-env=vulkan1.2"])
                .args(&defines)
                .arg(src.join(file))
                .arg("-o")
                .arg(&dst)
                .output()
                .expect("glslc runs");
            if !o.status.success() {
                panic!(
                    "glslc {file} {defines:?}:\n{}",
                    String::from_utf8_lossy(&o.stderr)
                );
            }
            dst
        } else {
            spv.join(format!("{name}.spv"))
        };
        writeln!(
            code,
            "    (\"{name}\", include_bytes!({:?})),",
            path.display().to_string()
        )
        .unwrap();
    }
    writeln!(code, "];").unwrap();
    std::fs::write(out.join("spirv.rs"), code).unwrap();
}
