//! An in-process server on an ephemeral loopback port: the built-in tiny-code pair on the CPU.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::Path;

use ddtree_engine::{generate_plain, tiny, CpuBackend, GenerateOptions, LoadOptions, SpecOptions};
use ddtree_server::{run, ChatTemplate, ModelEngine, ModelText, ServerConfig};

/// Context of the test servers (small, so context errors are cheap to provoke).
pub const CONTEXT: usize = 128;

/// Starts a server with `config` (its port replaced by 0) on its own thread; returns its base URL.
pub fn start(config: ServerConfig) -> String {
    start_thread(config).0
}

/// [`start`], and the server's thread (it ends when `run` returns after a shutdown).
pub fn start_thread(config: ServerConfig) -> (String, std::thread::JoinHandle<()>) {
    let (tx, rx) = std::sync::mpsc::channel::<SocketAddr>();
    let thread = std::thread::spawn(move || {
        let model = tiny::load(CpuBackend::default(), LoadOptions::default()).unwrap();
        let drafter = tiny::load_drafter(&model, None).unwrap();
        let mut engine = ModelEngine {
            model,
            drafter: Some(Box::new(drafter)),
            spec: SpecOptions::fixed(16),
            id: "tiny-code".into(),
            max_model_len: CONTEXT,
        };
        let template = ChatTemplate::from_tokenizer_config(tiny::TOKENIZER_CONFIG, Path::new("tiny")).unwrap();
        let text = ModelText {
            tokenizer: Some(tiny::tokenizer().unwrap()),
            chat_template: template,
        };
        let config = ServerConfig { port: 0, ..config };
        run(&mut engine, text, config, |addr| tx.send(addr).unwrap()).unwrap();
    });
    let addr = rx.recv().expect("the server starts");
    (format!("http://{addr}"), thread)
}

/// Plain greedy decoding of `prompt` by the engine itself (EOS stops it), the reference.
pub fn reference(prompt: &str, max_tokens: usize) -> Vec<u32> {
    let model = tiny::load(CpuBackend::default(), LoadOptions::default()).unwrap();
    let ids = tiny::tokenizer().unwrap().encode(prompt).unwrap();
    let options = GenerateOptions {
        max_new_tokens: max_tokens,
        stop_tokens: model.config().eos_token_ids.clone(),
        ..Default::default()
    };
    generate_plain(&model, &ids, &options).unwrap().tokens
}

/// The value of a metric line `name value` (labels included in `name`).
pub fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')))
        .unwrap_or_else(|| panic!("no metric {name} in\n{text}"))
        .trim()
        .parse()
        .unwrap()
}

/// The `data:` payloads of an SSE body.
pub fn sse_data(body: &str) -> Vec<String> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(str::to_string)
        .collect()
}

/// POSTs a JSON `body` (a `serde_json::Value`, or raw text to send malformed JSON) to `url`;
/// returns the status and the JSON answer.
pub async fn post(client: &reqwest::Client, url: &str, body: impl ToString) -> (u16, serde_json::Value) {
    let r = client
        .post(url)
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap())
}

/// KV caches alive in the server's engine (its `/metrics` gauge).
pub async fn live_caches(client: &reqwest::Client, base: &str) -> f64 {
    let m = client
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    metric(&m, "ddtree_live_kv_caches")
}

/// The info of a stub engine named `id` (10-token vocabulary, context 16, no device, no drafter).
pub fn stub_info(id: &str) -> ddtree_server::ModelInfo {
    ddtree_server::ModelInfo {
        id: id.into(),
        vocab_size: 10,
        context: 16,
        eos_ids: vec![],
        device: "none".into(),
        drafter: "none".into(),
    }
}
