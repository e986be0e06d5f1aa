//! The official `openai` Python client against `ddtree serve --port 0` (the built-in pair on the
//! CPU): `scripts/openai_client_check.py` checks models, completions, chat, streaming and errors,
//! and that greedy outputs equal `ddtree generate` token for token. Then SIGTERM: the server
//! shuts down and exits 0.
//!
//! Needs the package: `.ci/run` installs `scripts/requirements-serve.txt` into `.openai` and
//! exports `DDTREE_OPENAI_PYTHONPATH`; without it the test says it skipped.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

#[test]
fn openai_python_client() {
    let Some(pythonpath) = std::env::var_os("DDTREE_OPENAI_PYTHONPATH") else {
        eprintln!(
            "SKIP: DDTREE_OPENAI_PYTHONPATH is not set (pip install --target .openai -r scripts/requirements-serve.txt)"
        );
        return;
    };
    let bin = env!("CARGO_BIN_EXE_ddtree");
    let mut server = Command::new(bin)
        .args(["serve", "--port", "0", "--device", "cpu", "--shutdown-timeout", "5"])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(server.stderr.take().unwrap()).lines();
    let url = loop {
        let line = lines.next().expect("the server prints its address").unwrap();
        eprintln!("{line}");
        if let Some(rest) = line.split("listening on ").nth(1) {
            assert!(
                line.contains("model tiny-code") && line.contains("device cpu"),
                "{line}"
            );
            break rest.split_whitespace().next().unwrap().to_string();
        }
    };
    // Keep draining the server's log so it never blocks on a full pipe.
    let log = std::thread::spawn(move || lines.map_while(Result::ok).collect::<Vec<_>>());
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/openai_client_check.py");
    let out = Command::new("python3")
        .arg(script)
        .args(["--base-url", &url, "--ddtree", bin])
        .env("PYTHONPATH", &pythonpath)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    // SIGTERM: a graceful shutdown that exits 0.
    let term = Command::new("kill")
        .args(["-TERM", &server.id().to_string()])
        .status()
        .unwrap();
    assert!(term.success());
    let mut status = None;
    for _ in 0..200 {
        if let Some(s) = server.try_wait().unwrap() {
            status = Some(s);
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let Some(status) = status else {
        server.kill().unwrap();
        panic!("the server did not exit within 10 s of SIGTERM");
    };
    let log = log.join().unwrap().join("\n");
    assert!(
        out.status.success(),
        "client check failed\n{stdout}\n{stderr}\nserver log:\n{log}"
    );
    assert!(stdout.contains("openai client check: ok"), "{stdout}");
    assert!(status.success(), "server exit: {status}\n{log}");
}
