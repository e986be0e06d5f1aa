//! The HTTP API on a loopback server: every bad input (status, `param`, message), completions
//! and chat equal to the engine's greedy output, streaming, stop strings, the queue limit, the
//! API key and `/metrics`.

mod common;

use std::time::{Duration, Instant};

use common::{metric, post, reference, sse_data, start, stub_info, CONTEXT};
use ddtree_server::ServerConfig;
use serde_json::{json, Value};

/// Posts `body` and checks the error's status, `param` and a piece of its message.
async fn bad(client: &reqwest::Client, url: &str, body: Value, status: u16, param: Option<&str>, says: &str) {
    let (got, v) = post(client, url, body.to_string()).await;
    let e = &v["error"];
    assert_eq!(got, status, "{body} -> {v}");
    assert_eq!(e["param"].as_str(), param, "{body} -> {v}");
    assert!(e["message"].as_str().unwrap().contains(says), "{body} -> {v}");
    assert!(e["type"].is_string(), "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_inputs_are_openai_errors() {
    let base = start(ServerConfig {
        max_body_bytes: 4096,
        ..Default::default()
    });
    let c = reqwest::Client::new();
    let cmpl = format!("{base}/v1/completions");
    let chat = format!("{base}/v1/chat/completions");
    // Malformed JSON, not an object, wrong types.
    let (s, v) = post(&c, &cmpl, "{\"prompt\": ").await;
    assert_eq!(s, 400);
    assert!(
        v["error"]["message"].as_str().unwrap().contains("not valid JSON"),
        "{v}"
    );
    bad(&c, &cmpl, json!([1, 2]), 400, None, "expected a JSON object").await;
    bad(
        &c,
        &cmpl,
        json!({"prompt": "a", "max_tokens": "9"}),
        400,
        Some("max_tokens"),
        "must be an integer",
    )
    .await;
    bad(
        &c,
        &cmpl,
        json!({"prompt": "a", "temperature": "hot"}),
        400,
        Some("temperature"),
        "must be a number",
    )
    .await;
    bad(
        &c,
        &cmpl,
        json!({"prompt": "a", "stream": 1}),
        400,
        Some("stream"),
        "must be a boolean",
    )
    .await;
    bad(
        &c,
        &cmpl,
        json!({"prompt": {"x": 1}}),
        400,
        Some("prompt"),
        "must be a string or an array",
    )
    .await;
    bad(
        &c,
        &cmpl,
        json!({"prompt": "a", "top_p": 0}),
        400,
        Some("top_p"),
        "(0, 1]",
    )
    .await;
    bad(
        &c,
        &cmpl,
        json!({"prompt": "a", "max_tokens": 0}),
        400,
        Some("max_tokens"),
        "at least 1",
    )
    .await;
    // Unknown model.
    bad(
        &c,
        &cmpl,
        json!({"model": "gpt-9", "prompt": "a"}),
        404,
        Some("model"),
        "gpt-9",
    )
    .await;
    bad(
        &c,
        &chat,
        json!({"model": "gpt-9", "messages": [{"role": "user", "content": "a"}]}),
        404,
        Some("model"),
        "does not exist",
    )
    .await;
    // Context: the prompt, and max_tokens past it.
    let long = "x = 1\n".repeat(200);
    bad(
        &c,
        &cmpl,
        json!({"prompt": long}),
        400,
        Some("prompt"),
        &format!("the context is {CONTEXT} tokens"),
    )
    .await;
    bad(
        &c,
        &cmpl,
        json!({"prompt": vec![5; CONTEXT]}),
        400,
        Some("prompt"),
        "tokens",
    )
    .await;
    bad(
        &c,
        &cmpl,
        json!({"prompt": "a", "max_tokens": CONTEXT}),
        400,
        Some("max_tokens"),
        "leave",
    )
    .await;
    bad(
        &c,
        &chat,
        json!({"messages": [{"role": "user", "content": long}]}),
        400,
        Some("messages"),
        "context",
    )
    .await;
    // Empty prompts, token ids out of range.
    bad(&c, &cmpl, json!({"prompt": ""}), 400, Some("prompt"), "empty").await;
    bad(&c, &cmpl, json!({"prompt": []}), 400, Some("prompt"), "empty").await;
    bad(
        &c,
        &cmpl,
        json!({"prompt": [1, 4096]}),
        400,
        Some("prompt[1]"),
        "out of range",
    )
    .await;
    bad(
        &c,
        &cmpl,
        json!({"prompt": [1, -1]}),
        400,
        Some("prompt[1]"),
        "not a token id",
    )
    .await;
    bad(
        &c,
        &cmpl,
        json!({"prompt": "a", "stop": [9999]}),
        400,
        Some("stop"),
        "out of range",
    )
    .await;
    bad(
        &c,
        &chat,
        json!({"messages": []}),
        400,
        Some("messages"),
        "must not be empty",
    )
    .await;
    bad(
        &c,
        &chat,
        json!({"messages": [{"role": "user"}]}),
        400,
        Some("messages"),
        "empty",
    )
    .await;
    bad(
        &c,
        &chat,
        json!({"messages": [{"content": "a"}]}),
        400,
        Some("messages[0].role"),
        "required",
    )
    .await;
    // Unsupported parameters name the field.
    bad(&c, &cmpl, json!({"prompt": "a", "n": 2}), 400, Some("n"), "must be 1").await;
    bad(
        &c,
        &cmpl,
        json!({"prompt": "a", "logprobs": 2}),
        400,
        Some("logprobs"),
        "not supported",
    )
    .await;
    bad(
        &c,
        &chat,
        json!({"messages": [{"role": "user", "content": "a"}], "logprobs": true}),
        400,
        Some("logprobs"),
        "not supported",
    )
    .await;
    bad(
        &c,
        &cmpl,
        json!({"prompt": "a", "presence_penalty": 1.5}),
        400,
        Some("presence_penalty"),
        "not supported",
    )
    .await;
    bad(
        &c,
        &cmpl,
        json!({"prompt": "a", "frobnicate": 1}),
        400,
        Some("frobnicate"),
        "unknown",
    )
    .await;
    bad(
        &c,
        &cmpl,
        json!({"prompt": ["a", "b"]}),
        400,
        Some("prompt"),
        "one per request",
    )
    .await;
    // Body over the limit.
    let (s, v) = post(&c, &cmpl, json!({"prompt": "y".repeat(8000)}).to_string()).await;
    assert_eq!(s, 413, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("4096 bytes"), "{v}");
    // Unknown route.
    let r = c.get(format!("{base}/v2/nothing")).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 404);
    // Every one of them is counted, and nothing reached the engine.
    let m = c
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_eq!(
        metric(&m, "ddtree_requests_total{endpoint=\"/v1/completions\",status=\"400\"}"),
        21.0
    );
    assert_eq!(
        metric(&m, "ddtree_requests_total{endpoint=\"/v1/completions\",status=\"413\"}"),
        1.0
    );
    assert_eq!(
        metric(
            &m,
            "ddtree_requests_total{endpoint=\"/v1/chat/completions\",status=\"404\"}"
        ),
        1.0
    );
    assert_eq!(metric(&m, "ddtree_prompt_tokens_total"), 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_chat_and_streams_match_the_engine() {
    let base = start(ServerConfig::default());
    let c = reqwest::Client::new();
    assert_eq!(
        c.get(format!("{base}/health"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap(),
        "ok"
    );
    let models: Value = c
        .get(format!("{base}/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["data"][0]["id"], "tiny-code");

    let prompt = "fn main() {";
    let expected = reference(prompt, 20);
    let (s, v) = post(
        &c,
        &format!("{base}/v1/completions"),
        json!({"model": "tiny-code", "prompt": prompt, "max_tokens": 20}).to_string(),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["object"], "text_completion");
    let ids: Vec<u32> = serde_json::from_value(v["ddtree"]["completion_token_ids"].clone()).unwrap();
    assert_eq!(ids, expected);
    let text = v["choices"][0]["text"].as_str().unwrap().to_string();
    let tokenizer = ddtree_engine::tiny::tokenizer().unwrap();
    assert_eq!(text, tokenizer.decode(&expected).unwrap().replace("<|eos|>", ""));
    assert_eq!(v["usage"]["completion_tokens"], expected.len());
    assert_eq!(v["usage"]["prompt_tokens"], tokenizer.encode(prompt).unwrap().len());
    let rounds = v["ddtree"]["rounds"].as_u64().unwrap();
    assert!(
        rounds >= 1 && v["ddtree"]["mean_accepted_length"].as_f64().unwrap() >= 1.0,
        "{v}"
    );
    assert!(v["ddtree"]["tokens_per_target_forward"].as_f64().unwrap() > 0.0);

    // The same as token ids, streamed: the chunks' groups add up to the same tokens and text.
    let prompt_ids = tokenizer.encode(prompt).unwrap();
    let body = c
        .post(format!("{base}/v1/completions"))
        .json(
            &json!({"prompt": prompt_ids, "max_tokens": 20, "stream": true, "stream_options": {"include_usage": true}}),
        )
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let data = sse_data(&body);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let streamed: String = chunks
        .iter()
        .filter_map(|c| c["choices"].get(0).and_then(|c| c["text"].as_str()))
        .collect();
    assert_eq!(streamed, text);
    let groups: Vec<u32> = chunks
        .iter()
        .filter_map(|c| c["ddtree"]["token_ids"].as_array())
        .flatten()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect();
    assert_eq!(groups, expected);
    // Fewer chunks than tokens: rounds commit groups.
    let token_chunks = chunks.iter().filter(|c| c["ddtree"]["token_ids"].is_array()).count();
    assert_eq!(token_chunks as u64, rounds + 1);
    let last = &chunks[chunks.len() - 1];
    assert_eq!(last["usage"]["completion_tokens"], expected.len());
    assert_eq!(
        chunks[chunks.len() - 2]["choices"][0]["finish_reason"],
        v["choices"][0]["finish_reason"]
    );

    // Chat: the built-in template concatenates the contents.
    let (s, v) = post(
        &c,
        &format!("{base}/v1/chat/completions"),
        json!({"messages": [{"role": "system", "content": "def add(a, b"}, {"role": "user", "content": "):"}], "max_tokens": 12})
            .to_string(),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    let ids: Vec<u32> = serde_json::from_value(v["ddtree"]["completion_token_ids"].clone()).unwrap();
    assert_eq!(ids, reference("def add(a, b):", 12));

    // A stop string: cut before it, finish_reason stop.
    let cut = text.chars().skip(3).take(2).collect::<String>();
    let (s, v) = post(
        &c,
        &format!("{base}/v1/completions"),
        json!({"prompt": prompt, "max_tokens": 20, "stop": cut}).to_string(),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(
        v["choices"][0]["text"].as_str().unwrap(),
        &text[..text.find(&cut).unwrap()]
    );

    let m = c
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_eq!(
        metric(&m, "ddtree_requests_total{endpoint=\"/v1/completions\",status=\"200\"}"),
        3.0
    );
    assert_eq!(metric(&m, "ddtree_time_to_first_token_seconds_count"), 4.0);
    assert!(metric(&m, "ddtree_rounds_total") >= rounds as f64 * 2.0);
    assert!(metric(&m, "ddtree_mean_accepted_length") >= 1.0);
    assert_eq!(metric(&m, "ddtree_queue_depth"), 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_key_and_full_queue() {
    let base = start(ServerConfig {
        api_key: Some("sesame".into()),
        max_queue: 1,
        ..Default::default()
    });
    let c = reqwest::Client::new();
    let url = format!("{base}/v1/completions");
    let r = c.post(&url).json(&json!({"prompt": "a"})).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 401);
    let v: Value = r.json().await.unwrap();
    assert!(
        v["error"]["message"].as_str().unwrap().contains("missing API key"),
        "{v}"
    );
    let r = c
        .post(&url)
        .bearer_auth("open")
        .json(&json!({"prompt": "a"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 401);
    // /health and /metrics stay open.
    assert_eq!(
        c.get(format!("{base}/health")).send().await.unwrap().status().as_u16(),
        200
    );

    let metrics = || async {
        c.get(format!("{base}/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    };
    // A long stream occupies the engine...
    let mut long = c
        .post(&url)
        .bearer_auth("sesame")
        .json(&json!({"prompt": "fn main() {", "max_tokens": 100, "ignore_eos": true, "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(long.status().as_u16(), 200);
    long.chunk().await.unwrap().expect("a first chunk");
    // ...one request waits...
    let waiting = tokio::spawn({
        let (c, url) = (c.clone(), url.clone());
        async move {
            let r = c
                .post(&url)
                .bearer_auth("sesame")
                .json(&json!({"prompt": "a", "max_tokens": 2}))
                .send()
                .await
                .unwrap();
            r.status().as_u16()
        }
    });
    let t = Instant::now();
    while metric(&metrics().await, "ddtree_queue_depth") < 1.0 {
        assert!(t.elapsed() < Duration::from_secs(10), "the second request never queued");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // ...and the next one is refused with Retry-After.
    let r = c
        .post(&url)
        .bearer_auth("sesame")
        .json(&json!({"prompt": "a"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 429);
    assert_eq!(r.headers()["retry-after"], "1");
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["type"], "rate_limit_error");
    // The long stream's client leaves: its request stops and the waiting one runs.
    drop(long);
    assert_eq!(waiting.await.unwrap(), 200);
    let m = metrics().await;
    assert_eq!(metric(&m, "ddtree_cancelled_requests_total"), 1.0);
    assert!(metric(&m, "ddtree_generated_tokens_total") < 100.0 + 2.0);
    // (Live KV caches are process-wide: tests/load.rs checks them on a server of its own.)
    assert_eq!(metric(&m, "ddtree_running_requests"), 0.0);
    assert_eq!(
        metric(&m, "ddtree_requests_total{endpoint=\"/v1/completions\",status=\"429\"}"),
        1.0
    );
    assert_eq!(
        metric(&m, "ddtree_requests_total{endpoint=\"/v1/completions\",status=\"401\"}"),
        2.0
    );
}

/// An engine that fails: an error, then a panic.
struct Failing(usize);

impl ddtree_server::Engine for Failing {
    fn info(&self) -> ddtree_server::ModelInfo {
        stub_info("failing")
    }

    fn generate(
        &mut self,
        _: &[u32],
        _: &ddtree_engine::GenerateOptions,
        _: &mut ddtree_engine::TokenSink<'_>,
    ) -> Result<ddtree_server::Finished, ddtree_engine::EngineError> {
        self.0 += 1;
        if self.0 == 1 {
            return Err(ddtree_engine::EngineError::Forward("scripted failure".into()));
        }
        panic!("scripted panic");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_failures_are_500s_and_the_server_lives_on() {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let config = ServerConfig {
            port: 0,
            ..Default::default()
        };
        ddtree_server::run(&mut Failing(0), Default::default(), config, |a| tx.send(a).unwrap()).unwrap();
    });
    let base = format!("http://{}", rx.recv().unwrap());
    let c = reqwest::Client::new();
    let url = format!("{base}/v1/completions");
    let (s, v) = post(&c, &url, json!({"prompt": [1, 2]}).to_string()).await;
    assert_eq!(s, 500, "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("scripted failure"),
        "{v}"
    );
    let (s, v) = post(&c, &url, json!({"prompt": [1, 2]}).to_string()).await;
    assert_eq!(s, 500, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("panicked"), "{v}");
    // No tokenizer: text prompts and chat are refused by name; the server still answers.
    bad(&c, &url, json!({"prompt": "text"}), 400, Some("prompt"), "no tokenizer").await;
    bad(
        &c,
        &format!("{base}/v1/chat/completions"),
        json!({"messages": [{"role": "user", "content": "a"}]}),
        400,
        Some("messages"),
        "no chat template",
    )
    .await;
    assert_eq!(
        c.get(format!("{base}/health")).send().await.unwrap().status().as_u16(),
        200
    );
}
