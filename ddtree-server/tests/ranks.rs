//! The server on a model split over two CPU ranks (`ddtree serve --ranks 2`): completions and
//! streams equal one rank's greedy tokens; a client that leaves stops the generation on every
//! rank and frees every rank's cache; a panic on one rank is a 500 and the next request works;
//! an engine that cannot serve is reported by `/health` and refused with 503.
//! One test function for the ranks (live caches are counted process-wide).

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{live_caches, metric, post, reference, sse_data, stub_info};
use ddtree_engine::parallel::group::RankGroup;
use ddtree_engine::parallel::{ParallelPlan, ParallelSpec};
use ddtree_engine::spec::{DraftRequest, Oracle, TreeSource};
use ddtree_engine::{tiny, CpuBackend, Drafter, LoadOptions, Model, SpecOptions};
use ddtree_server::{run, ModelText, RankEngine, ServerConfig};
use serde_json::{json, Value};

/// A first prompt token that makes rank 1's drafter panic.
const PANIC_TOKEN: u32 = 3;

/// The oracle, except that rank 1 panics on prompts starting with [`PANIC_TOKEN`].
struct Fragile {
    inner: Oracle<CpuBackend>,
    rank: usize,
}

impl Drafter<CpuBackend> for Fragile {
    fn name(&self) -> String {
        "fragile-oracle".into()
    }
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }
    fn target_layers(&self) -> &[usize] {
        &[]
    }
    fn begin(&mut self, target: &Model<CpuBackend>, capacity: usize) -> ddtree_engine::Result<()> {
        self.inner.begin(target, capacity)
    }
    fn draft(
        &mut self,
        target: &Model<CpuBackend>,
        request: DraftRequest<'_, ddtree_engine::backend::Matrix>,
    ) -> ddtree_engine::Result<ddtree_engine::backend::Matrix> {
        if self.rank == 1 && request.tokens[0] == PANIC_TOKEN && request.tokens.len() > 6 {
            panic!("rank 1's drafter panicked");
        }
        self.inner.draft(target, request)
    }
}

fn start_ranks(world: usize, tree_source: TreeSource) -> String {
    let (tx, rx) = std::sync::mpsc::channel::<SocketAddr>();
    std::thread::spawn(move || {
        let config = tiny::config().unwrap();
        let plan = Arc::new(ParallelPlan::new(&config, ParallelSpec::new(world, None, None).unwrap()).unwrap());
        let group = RankGroup::cpu(plan, move |rank| {
            Model::load_rank(
                CpuBackend::default(),
                tiny::config()?,
                &tiny::checkpoint()?,
                LoadOptions::default(),
                rank,
                &mut |_, _| {},
            )
        })
        .unwrap();
        let spec = SpecOptions {
            tree_source,
            ..SpecOptions::fixed(8)
        };
        let factory: ddtree_server::DrafterFactory<CpuBackend> = Arc::new(|model| {
            let rank = model.rank().map_or(0, |c| c.rank);
            Ok(Box::new(Fragile {
                inner: Oracle::new(4)?,
                rank,
            }))
        });
        let mut engine = RankEngine::new(group, "tiny-code".into(), common::CONTEXT, spec, Some(factory)).unwrap();
        let text = ModelText {
            tokenizer: Some(tiny::tokenizer().unwrap()),
            chat_template: None,
        };
        let config = ServerConfig {
            port: 0,
            ..Default::default()
        };
        run(&mut engine, text, config, |addr| tx.send(addr).unwrap()).unwrap();
    });
    format!("http://{}", rx.recv().expect("the server starts"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_cpu_ranks_serve_like_one_and_cancel_on_every_rank() {
    let started = Instant::now();
    let c = reqwest::Client::new();
    let prompt = "fn main() {";
    let expected = reference(prompt, 20);
    for source in [TreeSource::Replicated, TreeSource::Rank0] {
        let base = start_ranks(2, source);
        let url = format!("{base}/v1/completions");
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
        // A completion equals one rank's greedy tokens.
        let (s, v) = post(&c, &url, json!({"prompt": prompt, "max_tokens": 20})).await;
        assert_eq!(s, 200, "{v}");
        let ids: Vec<u32> = serde_json::from_value(v["ddtree"]["completion_token_ids"].clone()).unwrap();
        assert_eq!(ids, expected, "{source:?}");
        assert!(v["ddtree"]["rounds"].as_u64().unwrap() >= 1, "{v}");
        // Between requests each rank's oracle drafter keeps a cache of its own.
        let baseline = live_caches(&c, &base).await;

        // So does a stream, chunk group by chunk group.
        let body = c
            .post(&url)
            .json(&json!({"prompt": prompt, "max_tokens": 20, "stream": true}))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let mut streamed = Vec::new();
        for d in sse_data(&body).iter().filter(|d| *d != "[DONE]") {
            let chunk: Value = serde_json::from_str(d).unwrap();
            if let Some(ids) = chunk["ddtree"]["token_ids"].as_array() {
                streamed.extend(ids.iter().map(|i| i.as_u64().unwrap() as u32));
            }
        }
        assert_eq!(streamed, expected, "{source:?}: {body}");

        // A client that leaves mid-stream: every rank stops and frees its cache.
        let mut long = c
            .post(&url)
            .json(&json!({"prompt": prompt, "max_tokens": 100, "ignore_eos": true, "stream": true}))
            .send()
            .await
            .unwrap();
        assert_eq!(long.status().as_u16(), 200);
        long.chunk().await.unwrap().expect("a first chunk");
        drop(long);
        let t = Instant::now();
        loop {
            let m = c
                .get(format!("{base}/metrics"))
                .send()
                .await
                .unwrap()
                .text()
                .await
                .unwrap();
            if metric(&m, "ddtree_cancelled_requests_total") == 1.0 && metric(&m, "ddtree_running_requests") == 0.0 {
                assert!(metric(&m, "ddtree_generated_tokens_total") < 2.0 * 20.0 + 100.0);
                break;
            }
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "the cancelled request never ended:\n{m}"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(live_caches(&c, &base).await, baseline, "every rank freed its caches");

        // The next request works.
        let (s, v) = post(&c, &url, json!({"prompt": prompt, "max_tokens": 20})).await;
        assert_eq!(s, 200, "{v}");
        assert_eq!(v["ddtree"]["completion_token_ids"], json!(expected));

        // A panic on rank 1 alone (mid-generation, rank 0 in a collective) is a 500...
        let (s, v) = post(&c, &url, json!({"prompt": [PANIC_TOKEN, 9, 4], "max_tokens": 20})).await;
        assert_eq!(s, 500, "{v}");
        assert!(v["error"]["message"].as_str().unwrap().contains("panicked"), "{v}");
        assert_eq!(live_caches(&c, &base).await, baseline);
        // ...and the group recovered: the server goes on serving.
        assert_eq!(
            c.get(format!("{base}/health")).send().await.unwrap().status().as_u16(),
            200
        );
        let (s, v) = post(&c, &url, json!({"prompt": prompt, "max_tokens": 20})).await;
        assert_eq!(s, 200, "{v}");
        assert_eq!(v["ddtree"]["completion_token_ids"], json!(expected));
    }
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "took {:?}",
        started.elapsed()
    );
}

/// An engine whose first request leaves it unable to serve.
struct Breaks(bool);

impl ddtree_server::Engine for Breaks {
    fn info(&self) -> ddtree_server::ModelInfo {
        stub_info("breaks")
    }

    fn generate(
        &mut self,
        _: &[u32],
        _: &ddtree_engine::GenerateOptions,
        _: &mut ddtree_engine::TokenSink<'_>,
    ) -> Result<ddtree_server::Finished, ddtree_engine::EngineError> {
        self.0 = true;
        Err(ddtree_engine::EngineError::Forward(
            "rank 1 is stuck in a collective".into(),
        ))
    }

    fn health(&self) -> Result<(), String> {
        if self.0 {
            Err("rank(s) [1] did not return (stuck in a collective); restart the server".into())
        } else {
            Ok(())
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_cannot_serve_is_reported_by_health_and_refused_with_503() {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let config = ServerConfig {
            port: 0,
            ..Default::default()
        };
        run(&mut Breaks(false), Default::default(), config, |a| tx.send(a).unwrap()).unwrap();
    });
    let base = format!("http://{}", rx.recv().unwrap());
    let c = reqwest::Client::new();
    let url = format!("{base}/v1/completions");
    let (s, v) = post(&c, &url, json!({"prompt": [1, 2]})).await;
    assert_eq!(s, 500, "{v}");
    let r = c.get(format!("{base}/health")).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 503);
    let h: Value = r.json().await.unwrap();
    assert_eq!(h["status"], "unavailable");
    assert!(h["reason"].as_str().unwrap().contains("stuck in a collective"), "{h}");
    let (s, v) = post(&c, &url, json!({"prompt": [1, 2]})).await;
    assert_eq!(s, 503, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("engine is unavailable"),
        "{v}"
    );
}
