//! Compiles every variant of every kernel with NVRTC for `sm_90a` and runs `ptxas` on the PTX.
//!
//! Needs `libnvrtc.so.13` on the loader path and `ptxas` on PATH (or `DDTREE_PTXAS`). Where they
//! are absent the test says so and skips, except under CI (`CI` set), where it fails.

use std::path::PathBuf;
use std::process::Command;

use ddtree_runtime::nvrtc::{compile_ptx, nvrtc_available, nvrtc_version};

const ARCH: &str = "sm_90a";

fn on_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "0" && v != "false")
}

fn ptxas() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("DDTREE_PTXAS") {
        return Some(PathBuf::from(p));
    }
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths).map(|d| d.join("ptxas")).find(|p| p.is_file())
    })
}

/// Registers and spill bytes from `ptxas -v` output.
fn parse_ptxas(log: &str) -> (u32, u32) {
    let mut regs = 0;
    let mut spills = 0;
    for line in log.lines() {
        if let Some(i) = line.find("Used ") {
            let rest = &line[i + 5..];
            if let Some(n) = rest.split_whitespace().next().and_then(|w| w.parse().ok()) {
                regs = n;
            }
        }
        if line.contains("spill stores") {
            for part in line.split(',') {
                let words: Vec<&str> = part.split_whitespace().collect();
                if words.len() >= 3 && words[2] == "spill" {
                    spills += words[0].parse::<u32>().unwrap_or(0);
                }
            }
        }
    }
    (regs, spills)
}

#[test]
fn every_variant_compiles_for_sm90a() {
    if !nvrtc_available() {
        assert!(!on_ci(), "CI must provide NVRTC: put the nvidia-cuda-nvrtc wheel's lib folder on LD_LIBRARY_PATH");
        eprintln!("skipped: libnvrtc.so.13 not found (set LD_LIBRARY_PATH); no variant was compiled");
        return;
    }
    let ptxas = ptxas();
    assert!(ptxas.is_some() || !on_ci(), "CI must provide ptxas (nvidia-cuda-nvcc wheel) on PATH or DDTREE_PTXAS");
    let variants = ddtree_kernels::catalogue().expect("every candidate builds its IR");
    let dir = std::env::temp_dir().join(format!("ddtree-nvrtc-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();

    let results: Vec<Result<(String, u32, u32), String>> = std::thread::scope(|s| {
        let chunks: Vec<_> = variants.chunks(variants.len().div_ceil(4).max(1)).collect();
        let handles: Vec<_> = chunks
            .into_iter()
            .map(|chunk| {
                let (dir, ptxas) = (&dir, &ptxas);
                s.spawn(move || {
                    chunk
                        .iter()
                        .map(|v| {
                            let ptx = compile_ptx(&v.source, &v.symbol, ARCH).map_err(|e| e.to_string())?;
                            let Some(ptxas) = ptxas else { return Ok((v.symbol.clone(), 0, 0)) };
                            let file = dir.join(format!("{}.ptx", v.symbol));
                            std::fs::write(&file, ptx.to_src()).map_err(|e| e.to_string())?;
                            let out = Command::new(ptxas)
                                .args(["-arch", ARCH, "-v", "-o", "/dev/null"])
                                .arg(&file)
                                .output()
                                .map_err(|e| format!("running {}: {e}", ptxas.display()))?;
                            let log = String::from_utf8_lossy(&out.stderr).into_owned();
                            if !out.status.success() {
                                return Err(format!("ptxas failed on {}:\n{log}", v.symbol));
                            }
                            let (regs, spills) = parse_ptxas(&log);
                            Ok((v.symbol.clone(), regs, spills))
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles.into_iter().flat_map(|h| h.join().expect("compile thread")).collect()
    });
    let _ = std::fs::remove_dir_all(&dir);

    let failures: Vec<&String> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    assert!(failures.is_empty(), "{} variant(s) failed:\n{}", failures.len(), failures.iter().map(|s| s.as_str()).collect::<Vec<_>>().join("\n\n"));
    let ok: Vec<&(String, u32, u32)> = results.iter().filter_map(|r| r.as_ref().ok()).collect();
    let (max_sym, max_regs) = ok.iter().map(|(s, r, _)| (s.as_str(), *r)).max_by_key(|x| x.1).unwrap_or(("-", 0));
    let spilling: Vec<String> = ok.iter().filter(|x| x.2 > 0).map(|(s, _, b)| format!("{s} ({b} B)")).collect();
    let (maj, min) = nvrtc_version().unwrap();
    let ptxas_note = if ptxas.is_some() {
        format!("ptxas: max {max_regs} registers ({max_sym}), spills: {}", if spilling.is_empty() { "none".to_string() } else { spilling.join(", ") })
    } else {
        "ptxas: not found, skipped".to_string()
    };
    let summary = format!("nvrtc {maj}.{min}: {} variants compiled for {ARCH}; {ptxas_note}\n", ok.len());
    eprint!("{summary}");
    // CI prints this file after the test run (libtest hides a passing test's output).
    let _ = std::fs::write(std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("nvrtc-summary.txt"), summary);
}
