//! Graceful shutdown on SIGTERM (sent to this test process, which is why this test has a binary
//! of its own): the server stops accepting, the request in flight runs until the deadline, is
//! then cancelled and its stream still ends with `[DONE]`, and `run` returns.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::{sse_data, start_thread};
use ddtree_server::ServerConfig;
use serde_json::{json, Value};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_cancels_at_the_deadline_and_returns() {
    let (base, server) = start_thread(ServerConfig {
        shutdown_timeout: Duration::from_millis(500),
        ..Default::default()
    });
    let c = reqwest::Client::new();
    let mut stream = c
        .post(format!("{base}/v1/completions"))
        .json(&json!({"prompt": "fn main() {", "max_tokens": 100, "ignore_eos": true, "stream": true}))
        .send()
        .await
        .unwrap();
    let mut body = String::from_utf8(stream.chunk().await.unwrap().unwrap().to_vec()).unwrap();
    let signalled = Instant::now();
    let kill = Command::new("kill")
        .args(["-TERM", &std::process::id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    while let Some(piece) = stream.chunk().await.unwrap() {
        body.push_str(std::str::from_utf8(&piece).unwrap());
    }
    let data = sse_data(&body);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{body}");
    let last: Value = serde_json::from_str(&data[data.len() - 2]).unwrap();
    let tokens = last["ddtree"]["completion_token_ids"]
        .as_array()
        .expect("a final chunk")
        .len();
    assert!(
        tokens < 100,
        "the request was not cancelled at the deadline ({tokens} tokens)"
    );
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    // `run` returns; nothing listens any more.
    tokio::task::spawn_blocking(move || server.join().unwrap())
        .await
        .unwrap();
    assert!(
        signalled.elapsed() < Duration::from_secs(8),
        "{:?}",
        signalled.elapsed()
    );
    assert!(c.get(format!("{base}/health")).send().await.is_err());
}
