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
    // Both tree sources' rounds are timed, both lossless.
    assert!(out.contains("DDTree tree source on several ranks"), "{out}");
    assert!(out.contains("| replicated |") && out.contains("| rank0 |"), "{out}");
    assert!(!out.contains("| NO |"), "{out}");
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

/// `ddtree serve` as a child process; its address once it listens.
struct Server(std::process::Child, String);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn serve(args: &[&str]) -> Server {
    use std::io::{BufRead, BufReader};
    let mut child = Command::new(env!("CARGO_BIN_EXE_ddtree"))
        .args([&["serve", "--port", "0"], args].concat())
        .env("DDTREE_HOST_MEMORY", "24G")
        .env("RUST_LOG", "warn")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("ddtree serve starts");
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let addr = loop {
        let line = lines.next().expect("a listening line").unwrap();
        if let Some(rest) = line.split("listening on http://").nth(1) {
            break rest.split(' ').next().unwrap().to_string();
        }
    };
    // Keep draining stderr so the server never blocks on it.
    std::thread::spawn(move || for _ in lines {});
    Server(child, addr)
}

/// One HTTP/1.1 request; the status and the body.
fn http(addr: &str, method: &str, path: &str, body: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let status = out.split(' ').nth(1).unwrap().parse().unwrap();
    let body = out.split("\r\n\r\n").nth(1).unwrap_or("").to_string();
    (status, body)
}

#[test]
fn serve_on_two_cpu_ranks_answers_like_generate_on_one() {
    let start = Instant::now();
    let (ok, out, err, _) = ddtree(&[
        "generate",
        "--device",
        "cpu",
        "--prompt-ids",
        "5,17",
        "--max-tokens",
        "8",
        "--budget",
        "8",
        "--json",
    ]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    let expected = v["tokens"].clone();
    for source in ["replicated", "rank0"] {
        let server = serve(&[
            "--device",
            "cpu",
            "--ranks",
            "2",
            "--budget",
            "8",
            "--tree-source",
            source,
        ]);
        let (status, body) = http(&server.1, "GET", "/health", "");
        assert_eq!((status, body.as_str()), (200, "ok"));
        let (status, body) = http(
            &server.1,
            "POST",
            "/v1/completions",
            r#"{"prompt": [5, 17], "max_tokens": 8}"#,
        );
        assert_eq!(status, 200, "{body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["ddtree"]["completion_token_ids"], expected, "{source}: {body}");
    }
    assert!(start.elapsed() < Duration::from_secs(30), "took {:?}", start.elapsed());
}

#[test]
fn serve_refuses_contradictory_rank_flags_by_name() {
    for (args, says) in [
        (&["--ranks", "2", "--gpus", "2"][..], "--ranks"),
        (&["--device", "cpu", "--ranks", "3"][..], "--gpus/--ranks"),
        (&["--device", "cpu", "--ranks", "2", "--tp", "4"][..], "--tp"),
        (
            &["--device", "cpu", "--gpus", "2", "--virtual-rank", "0"][..],
            "--virtual-rank",
        ),
        (
            &["--device", "cpu", "--ranks", "2", "--tree-source", "all"][..],
            "--tree-source",
        ),
    ] {
        let (ok, _, err, took) = ddtree(&[&["serve", "--port", "0"][..], args].concat());
        assert!(!ok && err.contains(says), "{args:?}: {err}");
        assert!(took < Duration::from_secs(10), "{args:?} took {took:?}");
    }
}
