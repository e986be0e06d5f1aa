//! The `ddtree` binary's multi-rank front: the memory refusal before any allocation (the
//! default bench preset on a host without a GPU), `ddtree plan`, and generation on CPU ranks.

use std::process::Command;
use std::time::{Duration, Instant};

fn ddtree(args: &[&str]) -> (bool, String, String, Duration) {
    let start = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_ddtree"))
        .args(args)
        .env("DDTREE_HOST_MEMORY", "24G")
        .env("RUST_LOG", "warn")
        .output()
        .expect("ddtree runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
        start.elapsed(),
    )
}

#[test]
fn bench_on_the_cpu_refuses_the_kimi_preset_by_the_estimate() {
    let (ok, _, err, took) = ddtree(&["bench", "--device", "cpu"]);
    assert!(!ok, "{err}");
    assert!(err.contains("not enough memory on the CPU host"), "{err}");
    assert!(err.contains("24.0 GiB available") && err.contains("weights"), "{err}");
    assert!(took < Duration::from_secs(10), "took {took:?}");
    // The whole model split over 8 ranks still does not fit one host.
    let (ok, _, err, _) = ddtree(&["bench", "--device", "cpu", "--preset", "kimi-k2.6", "--gpus", "8"]);
    assert!(!ok && err.contains("8 ranks share it"), "{err}");
    // A bad layout names the argument.
    let (ok, _, err, _) = ddtree(&["bench", "--device", "cpu", "--preset", "tiny", "--ranks", "3"]);
    assert!(!ok && err.contains("--gpus/--ranks"), "{err}");
}

#[test]
fn plan_prints_every_rank_count() {
    let (ok, out, err, _) = ddtree(&["plan"]);
    assert!(ok, "{err}");
    assert!(
        out.contains("8 ranks: attention/dense TP 8, routed experts EP 8"),
        "{out}"
    );
    assert!(out.contains("336..384"), "{out}");
    let (ok, out, err, _) = ddtree(&["plan", "--preset", "tiny", "--gpus", "2", "--cpu"]);
    assert!(ok, "{err}");
    assert!(out.contains("2 ranks") && out.contains("host:"), "{out}");
}

#[test]
fn generate_on_cpu_ranks_matches_one_rank() {
    let kimi = concat!(env!("CARGO_MANIFEST_DIR"), "/../ddtree-engine/tests/fixtures/tiny-kimi");
    let base = [
        "generate",
        "--device",
        "cpu",
        "--model",
        kimi,
        "--prompt-ids",
        "5,17",
        "--max-tokens",
        "8",
        "--json",
    ];
    let tokens = |extra: &[&str]| {
        let (ok, out, err, _) = ddtree(&[&base[..], extra].concat());
        assert!(ok, "{err}");
        let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
        v["tokens"].clone()
    };
    let one = tokens(&[]);
    assert_eq!(tokens(&["--ranks", "2"]), one);
    assert_eq!(tokens(&["--ranks", "4", "--drafter", "oracle", "--budget", "4"]), one);
}

#[test]
fn bench_on_cpu_ranks_and_one_virtual_rank() {
    let tiny = [
        "bench",
        "--device",
        "cpu",
        "--preset",
        "tiny",
        "--contexts",
        "16",
        "--budgets",
        "4",
    ];
    let (ok, out, err, _) = ddtree(&[&tiny[..], &["--ranks", "2"]].concat());
    assert!(ok, "{err}");
    assert!(out.contains("2 CPU ranks (TP 2, EP 2)"), "{out}");
    let (ok, out, err, _) = ddtree(&[&tiny[..], &["--gpus", "2", "--virtual-rank", "1"]].concat());
    assert!(ok, "{err}");
    assert!(out.contains("virtual rank 1 of 2"), "{out}");
    let (ok, _, err, _) = ddtree(&[&tiny[..], &["--gpus", "2", "--virtual-rank", "2"]].concat());
    assert!(
        !ok && err.contains("--virtual-rank") && err.contains("rank 2 of a 2-rank plan"),
        "{err}"
    );
    // One rank of TP8 + EP8 Kimi is still far more than 24 GiB of f32 on the CPU.
    let (ok, _, err, took) = ddtree(&[
        "bench",
        "--device",
        "cpu",
        "--preset",
        "kimi-k2.6",
        "--gpus",
        "8",
        "--virtual-rank",
        "0",
    ]);
    assert!(!ok && err.contains("not enough memory on the CPU host"), "{err}");
    assert!(took < Duration::from_secs(10), "took {took:?}");
}
