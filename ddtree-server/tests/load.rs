//! Load: 64 concurrent streaming requests of mixed prompts and lengths, every fifth one dropped
//! by its client after its first chunk. Every other request gets exactly the engine's greedy
//! tokens, the dropped ones stop early and give their KV caches back, and `/metrics` counts
//! every request and token.

mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::{metric, reference, start};
use ddtree_server::ServerConfig;
use futures_util::StreamExt;
use serde_json::{json, Value};

const PROMPTS: [&str; 4] = ["fn main() {", "def add(a, b):", "use std::", "import os\n"];
const REQUESTS: usize = 64;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_streams_with_cancellations() {
    let base = start(ServerConfig {
        max_queue: REQUESTS,
        ..Default::default()
    });
    let c = reqwest::Client::new();
    let metrics = || async {
        c.get(format!("{base}/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    };
    let expected: HashMap<&str, Vec<u32>> = PROMPTS.iter().map(|&p| (p, reference(p, 12))).collect();
    // One request first: the drafter keeps a cache of its own between requests.
    let warm = c
        .post(format!("{base}/v1/completions"))
        .json(&json!({"prompt": "x", "max_tokens": 2}));
    assert_eq!(warm.send().await.unwrap().status().as_u16(), 200);
    let baseline = metric(&metrics().await, "ddtree_live_kv_caches");
    let started = Instant::now();
    let tasks: Vec<_> = (0..REQUESTS)
        .map(|i| {
            let (c, url) = (c.clone(), format!("{base}/v1/completions"));
            let prompt = PROMPTS[i % PROMPTS.len()];
            let max_tokens = 2 + (i * 7) % 11;
            let cancel = i % 5 == 4;
            tokio::spawn(async move {
                let r = c
                    .post(url)
                    .json(&json!({"prompt": prompt, "max_tokens": max_tokens, "stream": true}))
                    .send()
                    .await
                    .unwrap();
                assert_eq!(r.status().as_u16(), 200);
                let mut body = r.bytes_stream();
                let mut text = String::new();
                while let Some(piece) = body.next().await {
                    text.push_str(std::str::from_utf8(&piece.unwrap()).unwrap());
                    if cancel && text.contains("\n\n") {
                        return (i, prompt, max_tokens, None);
                    }
                }
                let mut tokens = Vec::new();
                let mut done = false;
                for data in text.lines().filter_map(|l| l.strip_prefix("data: ")) {
                    if data == "[DONE]" {
                        done = true;
                        continue;
                    }
                    let v: Value = serde_json::from_str(data).unwrap();
                    if let Some(ids) = v["ddtree"]["token_ids"].as_array() {
                        tokens.extend(ids.iter().map(|t| t.as_u64().unwrap() as u32));
                    }
                }
                assert!(done, "request {i} ended without [DONE]");
                (i, prompt, max_tokens, Some(tokens))
            })
        })
        .collect();
    let mut finished = 0;
    let mut tokens_seen = 0;
    for task in tasks {
        let (i, prompt, max_tokens, tokens) = task.await.unwrap();
        if let Some(tokens) = tokens {
            let full = &expected[prompt];
            assert_eq!(tokens, full[..max_tokens.min(full.len())], "request {i}");
            finished += 1;
            tokens_seen += tokens.len();
        }
    }
    let cancelled = REQUESTS - finished;
    eprintln!(
        "{REQUESTS} requests ({cancelled} dropped) in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    // The dropped requests stop at their next round; wait for the engine to drain.
    let t = Instant::now();
    let m = loop {
        let m = metrics().await;
        if metric(&m, "ddtree_running_requests") == 0.0 && metric(&m, "ddtree_queue_depth") == 0.0 {
            break m;
        }
        assert!(t.elapsed() < Duration::from_secs(20), "the engine never drained:\n{m}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(
        metric(&m, "ddtree_live_kv_caches"),
        baseline,
        "a cache outlived its request"
    );
    assert_eq!(
        metric(&m, "ddtree_requests_total{endpoint=\"/v1/completions\",status=\"200\"}"),
        REQUESTS as f64 + 1.0
    );
    // A dropped request may have finished before the engine noticed (or never started).
    let dropped = metric(&m, "ddtree_cancelled_requests_total");
    assert!(dropped <= cancelled as f64, "{dropped} > {cancelled}");
    assert!(metric(&m, "ddtree_generated_tokens_total") >= tokens_seen as f64);
    assert!(metric(&m, "ddtree_time_to_first_token_seconds_count") >= finished as f64);
    assert!(metric(&m, "ddtree_rounds_total") > 0.0);
}
