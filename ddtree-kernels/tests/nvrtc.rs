//! Compiles every variant of every kernel with NVRTC for `sm_90a` and runs `ptxas` on the PTX
//! (which must not report serialized `wgmma`s).
//!
//! Needs `libnvrtc.so.13` on the loader path and `ptxas` on PATH (or `DDTREE_PTXAS`). Where they
//! are absent the test says so and skips, except under CI (`CI` set), where it fails.
//!
//! For kernel work without a GPU: `DDTREE_NVRTC_FILTER=text` compiles only the variants whose
//! symbol contains `text`, and `DDTREE_SASS_DIR=dir` keeps each one's PTX and cubin there
//! (`scripts/sass-stats.sh` counts the SASS instructions of their loops).

use std::path::PathBuf;
use std::process::Command;

use ddtree_codegen::dsl::*;
use ddtree_codegen::Kernel;
use ddtree_macros::kernel;
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
        std::env::split_paths(&paths)
            .map(|d| d.join("ptxas"))
            .find(|p| p.is_file())
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

/// Uses every intrinsic and built-in of the DSL once, so NVRTC and ptxas check every prelude
/// helper (the catalogue's kernels use only some of them), and the two-argument
/// `__launch_bounds__` of `min_blocks`.
#[kernel(block = 128, min_blocks = 2)]
fn intrinsic_coverage(xs: &mut [f32], us: &mut [u32], is: &mut [i32], ws: &mut [u64], hs: &mut [f16], g: &[bf16]) {
    let t = thread_idx_x()
        + block_idx_y()
        + block_idx_z()
        + thread_idx_y()
        + thread_idx_z()
        + block_dim_y()
        + block_dim_z()
        + grid_dim_y()
        + grid_dim_z();
    let tile = shared::<bf16>(1024);
    let tile2 = shared_2d::<u32>(4, 32);
    cp_async_16(&mut tile[t * 8], &g[t * 8]);
    cp_async_16_zfill(&mut tile[512 + t * 8], &g[t * 8], t < 64);
    cp_async_8(&mut tile[t * 4], &g[t * 4]);
    cp_async_8_zfill(&mut tile[t * 4], &g[t * 4], t < 64);
    cp_async_4(&mut tile[t * 2], &g[t * 2]);
    cp_async_4_zfill(&mut tile[t * 2], &g[t * 2], t < 64);
    cp_async_commit();
    cp_async_wait(0);
    sync_threads();
    let bar = shared::<u64>(1);
    if t == 0 {
        mbar_init(&mut bar[0], 1u32);
    }
    sync_threads();
    if t == 0 {
        mbar_arrive_tx(&mut bar[0], 256u32);
        cp_async_bulk(&mut tile[256], &g[256], 256u32, &mut bar[0]);
    }
    mbar_wait(&bar[0], 0u32);
    let mut a = [[0u32; 4]; 2];
    let mut b = [[0u32; 2]; 2];
    let mut one = [0u32; 1];
    let mut acc = [[0.0f32; 4]; 2];
    ldmatrix_x4(&mut a[0], &tile[lane_id() * 8]);
    ldmatrix_x4_trans(&mut a[1], &tile[lane_id() * 8]);
    ldmatrix_x2(&mut b[0], &tile[lane_id() * 8]);
    ldmatrix_x2_trans(&mut b[1], &tile[lane_id() * 8]);
    ldmatrix_x1(&mut one, &tile[lane_id() * 8]);
    mma_m16n8k16_bf16(&mut acc[0], &a[0], &b[0]);
    mma_m16n8k16_f16(&mut acc[1], &a[1], &b[1]);
    let v = acc[0][0] + exp2_approx(acc[1][3]);
    let s = shfl_xor(v, 1u32) + shfl_down(v, 2u32) + shfl_up(v, 1u32) + shfl_idx(v, 0u32);
    sync_warp();
    let m = ballot(s > 0.0);
    if vote_any(m > 3) && vote_all(t < 1024) {
        xs[0] = s;
    }
    let p = prmt(m, one[0], 0x5410u32) ^ lop3(m, one[0], a[0][1], 0xE8);
    tile2[warp_id()][lane_id()] = p;
    sync_threads();
    us.atomic_add(0, tile2[0][lane_id()]);
    us.atomic_max(1, p);
    us.atomic_min(2, p);
    us.atomic_or(3, p);
    us.atomic_and(4, p);
    let old = atomic_cas(&mut us[5], 0u32, p) + us.atomic_exch(6, p);
    is.atomic_add(0, -1);
    ws.atomic_add(0, 1u64);
    xs.atomic_add(1, f32::from_bits(old) + bf16_lo(p) + bf16_hi(p) + f16_lo(p) + f16_hi(p));
    let packed = pack_bf16x2(v, s) + pack_f16x2(v, s);
    hs[t] = ((packed as f32).exp() + v.tanh() + v.sqrt() + v.rsqrt()) as f16;
    let vec = us.vload(8);
    us.vstore(12, vec);
}

#[test]
fn every_variant_compiles_for_sm90a() {
    if !nvrtc_available() {
        assert!(
            !on_ci(),
            "CI must provide NVRTC: put the nvidia-cuda-nvrtc wheel's lib folder on LD_LIBRARY_PATH"
        );
        eprintln!("skipped: libnvrtc.so.13 not found (set LD_LIBRARY_PATH); no variant was compiled");
        return;
    }
    let ptxas = ptxas();
    assert!(
        ptxas.is_some() || !on_ci(),
        "CI must provide ptxas (nvidia-cuda-nvcc wheel) on PATH or DDTREE_PTXAS"
    );
    let mut variants = ddtree_kernels::catalogue().expect("every candidate builds its IR");
    variants.push(ddtree_kernels::Variant {
        kernel: IntrinsicCoverage::NAME,
        symbol: IntrinsicCoverage::symbol(&()),
        source: IntrinsicCoverage::source(&()).expect("the coverage kernel builds"),
    });
    let filter = std::env::var("DDTREE_NVRTC_FILTER").ok().filter(|f| !f.is_empty());
    if let Some(f) = &filter {
        assert!(
            !on_ci(),
            "DDTREE_NVRTC_FILTER is for local work; CI compiles every variant"
        );
        variants.retain(|v| v.symbol.contains(f.as_str()));
        eprintln!("DDTREE_NVRTC_FILTER={f}: {} variant(s)", variants.len());
    }
    let kept = std::env::var_os("DDTREE_SASS_DIR").map(PathBuf::from);
    let dir = kept
        .clone()
        .unwrap_or_else(|| std::env::temp_dir().join(format!("ddtree-nvrtc-{}", std::process::id())));
    std::fs::create_dir_all(&dir).unwrap();

    let results: Vec<Result<(String, u32, u32), String>> = std::thread::scope(|s| {
        let chunks: Vec<_> = variants.chunks(variants.len().div_ceil(4).max(1)).collect();
        let handles: Vec<_> = chunks
            .into_iter()
            .map(|chunk| {
                let (dir, ptxas, kept) = (&dir, &ptxas, &kept);
                s.spawn(move || {
                    chunk
                        .iter()
                        .map(|v| {
                            let ptx = compile_ptx(&v.source, &v.symbol, ARCH).map_err(|e| e.to_string())?;
                            let Some(ptxas) = ptxas else {
                                return Ok((v.symbol.clone(), 0, 0));
                            };
                            let file = dir.join(format!("{}.ptx", v.symbol));
                            std::fs::write(&file, ptx.to_src()).map_err(|e| e.to_string())?;
                            let cubin = if kept.is_some() {
                                file.with_extension("cubin")
                            } else {
                                PathBuf::from("/dev/null")
                            };
                            let out = Command::new(ptxas)
                                .args(["-arch", ARCH, "-v", "-o"])
                                .arg(&cubin)
                                .arg(&file)
                                .output()
                                .map_err(|e| format!("running {}: {e}", ptxas.display()))?;
                            let log = String::from_utf8_lossy(&out.stderr).into_owned();
                            if !out.status.success() {
                                return Err(format!("ptxas failed on {}:\n{log}", v.symbol));
                            }
                            // A serialized `wgmma` waits for each one before issuing the next
                            // (C7515, C7520, ...): a regression that compiles and passes checks.
                            if log.contains("wgmma.mma_async instructions are serialized") {
                                return Err(format!("ptxas serialized the wgmmas of {}:\n{log}", v.symbol));
                            }
                            let (regs, spills) = parse_ptxas(&log);
                            Ok((v.symbol.clone(), regs, spills))
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("compile thread"))
            .collect()
    });
    if kept.is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }

    let failures: Vec<&String> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    assert!(
        failures.is_empty(),
        "{} variant(s) failed:\n{}",
        failures.len(),
        failures.iter().map(|s| s.as_str()).collect::<Vec<_>>().join("\n\n")
    );
    let ok: Vec<&(String, u32, u32)> = results.iter().filter_map(|r| r.as_ref().ok()).collect();
    let (max_sym, max_regs) = ok
        .iter()
        .map(|(s, r, _)| (s.as_str(), *r))
        .max_by_key(|x| x.1)
        .unwrap_or(("-", 0));
    let spilling: Vec<String> = ok
        .iter()
        .filter(|x| x.2 > 0)
        .map(|(s, _, b)| format!("{s} ({b} B)"))
        .collect();
    let (maj, min) = nvrtc_version().unwrap();
    let ptxas_note = if ptxas.is_some() {
        format!(
            "ptxas: max {max_regs} registers ({max_sym}), spills: {}",
            if spilling.is_empty() {
                "none".to_string()
            } else {
                spilling.join(", ")
            }
        )
    } else {
        "ptxas: not found, skipped".to_string()
    };
    let summary = format!(
        "nvrtc {maj}.{min}: {} variants compiled for {ARCH}; {ptxas_note}\n",
        ok.len()
    );
    eprint!("{summary}");
    let mut lines: Vec<String> = ok
        .iter()
        .map(|(s, r, b)| format!("{s} {r} regs {b} B spilled"))
        .collect();
    lines.sort();
    if filter.is_some() {
        // A filtered run leaves the whole run's files alone.
        eprintln!("{}", lines.join("\n"));
        return;
    }
    // CI prints this file after the test run (libtest hides a passing test's output).
    let _ = std::fs::write(
        std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("nvrtc-summary.txt"),
        summary,
    );
    // Every variant's registers and spill bytes, sorted by symbol, for reviews.
    if ptxas.is_some() {
        let _ = std::fs::write(
            std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("nvrtc-registers.txt"),
            lines.join("\n") + "\n",
        );
    }
}
