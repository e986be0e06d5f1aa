//! The target's verify latency by tree size, as the [`CostModel`] of `--budget auto`:
//! [`measure_verify_cost`], stored per (GPU, model shape) next to the tune cache
//! ([`save_verify_cost`], [`load_verify_cost`]; `autotune --verify-cost` measures it).

use std::path::{Path, PathBuf};
use std::time::Instant;

use ddtree_runtime::Fingerprint;

use super::Progress;
use crate::backend::Backend;
use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::mask::AncestorMask;
use crate::model::{ForwardInput, LogitRows, Model};
use crate::spec::{CostModel, VerifyPoint};

/// Every verify length up to this one is timed by `autotune --verify-cost` ([`VERIFY_SIZES`]).
pub const VERIFY_DENSE_UP_TO: usize = 64;

/// The verify sizes `autotune --verify-cost` times ([`measure_verify_cost`]): every length
/// 1..=[`VERIFY_DENSE_UP_TO`], then every 8th to 128 and every 16th to 256 (80 sizes). The
/// verify latency is a staircase (on the H200, Kimi K2.6 EP8 verifies 16 tokens in 22.7 ms and
/// 17 in 25.5 ms: a new 16-row tile), and [`CostModel::verify_us`] interpolates linearly between
/// points, so only points at every length show where the steps are; `auto`'s trees mostly stay
/// below 64 tokens, and above it the points sit on the 8- and 16-row tile edges. At 20-110 ms a
/// forward and 6 forwards a size (one untimed, the median of 5), the curve takes about a minute
/// on Kimi K2.6 EP8, each size's eager first forward and CUDA-graph recording included.
pub const VERIFY_SIZES: [usize; 80] = verify_sizes();

const fn verify_sizes() -> [usize; 80] {
    let mut sizes = [0; 80];
    let (mut i, mut n) = (0, 1);
    while i < sizes.len() {
        sizes[i] = n;
        n += if n < VERIFY_DENSE_UP_TO {
            1
        } else if n < 128 {
            8
        } else {
            16
        };
        i += 1;
    }
    sizes
}
/// Rows of random latent cache the verify forwards of [`measure_verify_cost`] attend to.
pub const VERIFY_CONTEXT: usize = 1024;
/// Untimed verify forwards per size before the timed ones.
const VERIFY_WARMUP: usize = 1;
/// Timed verify forwards per size (the median is kept).
const VERIFY_REPS: usize = 5;
/// The drafter forward per round of a measured cost model, as a fraction of the measured
/// one-token verify (the ratio of [`CostModel::fallback`]: a DFlash drafter has a few layers
/// against the target's dozens, and shares its embedding and head).
pub const DRAFT_FRACTION: f64 = 0.1;
/// The tree build per round, as a fraction of the one-token verify (as in the fallback).
pub const BUILD_FRACTION: f64 = 0.01;
/// The accept walk and cache compaction per round, as a fraction of the one-token verify (as
/// in the fallback).
pub const ACCEPT_FRACTION: f64 = 0.01;

/// A random tree of `n` nodes: node 0 the root, every other node's parent one of the nodes
/// before it, about half of them the previous node (chains with branches, as DDTree builds).
fn random_tree(n: usize, rng: &mut impl rand::Rng) -> Vec<i32> {
    (0..n)
        .map(|i| match i {
            0 => -1,
            _ if rng.random_bool(0.5) => (i - 1) as i32,
            _ => rng.random_range(0..i) as i32,
        })
        .collect()
}

/// What [`measure_verify_cost`] measured.
#[derive(Debug, Clone, PartialEq)]
pub struct VerifyMeasurement {
    /// The cost model: the medians' non-decreasing envelope
    /// ([`crate::spec::budget::monotone_envelope`]) and the per-round costs.
    pub cost: CostModel,
    /// The median latency at each size, as timed.
    pub medians: Vec<VerifyPoint>,
}

/// Times the target's verify forward on `model` at each of `sizes` tokens (sorted and
/// deduplicated; zero is skipped), reporting each size to `progress`, and returns a
/// [`CostModel`] with those points (made non-decreasing by [`CostModel::new`]) and the medians
/// as timed.
///
/// Each forward is a tree-masked verify ([`LogitRows::All`]) of random tokens in a random tree
/// ([`AncestorMask::from_parents`]) over a cache pre-filled with [`VERIFY_CONTEXT`] random rows
/// ([`Backend::kv_fill_random`]; fewer where the model's context is shorter); it ends with
/// [`Backend::argmax_rows`], which reads back and so synchronises, and the cache is truncated
/// back. After [`VERIFY_WARMUP`] untimed runs the median of [`VERIFY_REPS`] is kept. The
/// per-round draft, build and accept costs are not measured: they are [`DRAFT_FRACTION`],
/// [`BUILD_FRACTION`] and [`ACCEPT_FRACTION`] of the one-token verify.
pub fn measure_verify_cost<B: Backend>(
    model: &Model<B>,
    sizes: &[usize],
    progress: &Progress,
) -> Result<VerifyMeasurement> {
    use rand::{Rng, SeedableRng};
    let mut sizes: Vec<usize> = sizes.iter().copied().filter(|&n| n > 0).collect();
    sizes.sort_unstable();
    sizes.dedup();
    let Some(&largest) = sizes.last() else {
        return Err(EngineError::Forward("measure_verify_cost: no verify sizes".into()));
    };
    let config = model.config();
    let max_position = config.max_position_embeddings;
    if largest >= max_position {
        return Err(EngineError::Forward(format!(
            "measure_verify_cost: {largest} tokens do not fit the model's context of {max_position}"
        )));
    }
    let context = VERIFY_CONTEXT.min(max_position - largest);
    let backend = model.backend();
    let mut cache = model.new_cache(context + largest)?;
    backend.kv_fill_random(&mut cache, context, 0x5eed)?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x7e21f1);
    let vocab = config.vocab_size as u32;
    let mut points = Vec::with_capacity(sizes.len());
    progress.start(sizes.len());
    for (i, &n) in sizes.iter().enumerate() {
        progress.bar.set_message(format!("verify forward of {n} tokens"));
        let parents = random_tree(n, &mut rng);
        let mut depth = vec![0u32; n];
        for i in 1..n {
            depth[i] = depth[parents[i] as usize] + 1;
        }
        let mask = AncestorMask::from_parents(&parents)?;
        let positions: Vec<u32> = depth.iter().map(|d| context as u32 + d).collect();
        let mut times = Vec::with_capacity(VERIFY_REPS);
        for rep in 0..VERIFY_WARMUP + VERIFY_REPS {
            let tokens: Vec<u32> = (0..n).map(|_| rng.random_range(0..vocab)).collect();
            let t = Instant::now();
            model.forward_greedy(
                &mut cache,
                ForwardInput {
                    tokens: &tokens,
                    positions: &positions,
                    mask: Some(&mask),
                    logits: LogitRows::All,
                },
            )?;
            let us = t.elapsed().as_secs_f64() * 1e6;
            backend.kv_truncate(&mut cache, context)?;
            if rep >= VERIFY_WARMUP {
                times.push(us);
            }
        }
        times.sort_by(f64::total_cmp);
        let median = times[times.len() / 2];
        points.push((n, median));
        progress.step_done(|| {
            format!(
                "[{}/{}] verify {n} tokens: {:.3} ms (median of {VERIFY_REPS})",
                i + 1,
                sizes.len(),
                median / 1e3
            )
        });
    }
    progress.bar.finish_and_clear();
    let one = points[0].1;
    let cost = CostModel::new(
        format!(
            "measured verify on {} ({} layers, hidden {}, {} routed experts), {context}-row cache, \
             non-decreasing envelope of the medians; draft/build/accept {}/{}/{}% of one verify",
            backend.name(),
            config.num_hidden_layers,
            config.hidden_size,
            config.moe.n_routed_experts,
            DRAFT_FRACTION * 100.0,
            BUILD_FRACTION * 100.0,
            ACCEPT_FRACTION * 100.0,
        ),
        one * DRAFT_FRACTION,
        one * BUILD_FRACTION,
        one * ACCEPT_FRACTION,
        &points,
    )?;
    Ok(VerifyMeasurement {
        cost,
        medians: points
            .into_iter()
            .map(|(tokens, us)| VerifyPoint { tokens, us })
            .collect(),
    })
}

/// A stable 16-hex-digit hash of what in `config` decides the verify latency (the layer
/// shapes, expert counts and routing, the quantization group; not the tokens, norms epsilons
/// or rope constants), for the verify-cost file name.
pub fn shape_hash(config: &ModelConfig) -> String {
    let c = config;
    let m = &c.moe;
    let shape = format!(
        "ddtree-verify-shape-v1 vocab={} hidden={} inter={} layers={} heads={} q_lora={:?} kv_lora={} \
         nope={} rope={} v={} interleave={} tied={} experts={} per_tok={} shared={} groups={} topk_groups={} \
         dense_layers={} moe_inter={} int4_group={:?}",
        c.vocab_size,
        c.hidden_size,
        c.intermediate_size,
        c.num_hidden_layers,
        c.num_attention_heads,
        c.q_lora_rank,
        c.kv_lora_rank,
        c.qk_nope_head_dim,
        c.qk_rope_head_dim,
        c.v_head_dim,
        c.rope.interleave,
        c.tie_word_embeddings,
        m.n_routed_experts,
        m.num_experts_per_tok,
        m.n_shared_experts,
        m.n_group,
        m.topk_group,
        m.first_k_dense_replace,
        m.moe_intermediate_size,
        c.quantization.as_ref().map(|q| q.group_size),
    );
    // FNV-1a, 64 bits: stable across builds and platforms.
    let hash = shape.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    });
    format!("{hash:016x}")
}

/// The verify-cost file of `config` on the GPU `fingerprint` in `dir`:
/// `<fingerprint id>.verify-<shape hash>.json`.
pub fn verify_cost_file_in(dir: &Path, fingerprint: &Fingerprint, config: &ModelConfig) -> PathBuf {
    dir.join(format!("{}.verify-{}.json", fingerprint.id(), shape_hash(config)))
}

/// [`verify_cost_file_in`] the tune cache folder ([`ddtree_runtime::cache_root`]`/tune`).
pub fn verify_cost_file(fingerprint: &Fingerprint, config: &ModelConfig) -> PathBuf {
    verify_cost_file_in(&ddtree_runtime::cache_root().join("tune"), fingerprint, config)
}

/// Reads a cost model from `path`: `None` when the file is absent; unreadable or invalid
/// files are logged and ignored.
pub fn load_verify_cost_from(path: &Path) -> Option<CostModel> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) => {
            tracing::warn!("verify cost {} cannot be read ({e}); ignoring it", path.display());
            return None;
        }
    };
    CostModel::from_json(&text)
        .inspect_err(|e| tracing::warn!("verify cost {} is invalid ({e}); ignoring it", path.display()))
        .ok()
}

/// The stored verify cost of `config` on the GPU `fingerprint`, if `autotune --verify-cost`
/// measured one.
pub fn load_verify_cost(fingerprint: &Fingerprint, config: &ModelConfig) -> Option<CostModel> {
    load_verify_cost_from(&verify_cost_file(fingerprint, config))
}

/// Writes `cost` to `path` (creating the folder).
pub fn save_verify_cost_to(path: &Path, cost: &CostModel) -> Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| EngineError::io(dir, e))?;
    }
    let mut text = cost.to_json();
    text.push('\n');
    std::fs::write(path, text).map_err(|e| EngineError::io(path, e))
}

/// Stores `cost` for `config` on the GPU `fingerprint` next to the tune cache; returns the
/// file.
pub fn save_verify_cost(fingerprint: &Fingerprint, config: &ModelConfig, cost: &CostModel) -> Result<PathBuf> {
    let path = verify_cost_file(fingerprint, config);
    save_verify_cost_to(&path, cost)?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fingerprint() -> Fingerprint {
        Fingerprint {
            name: "NVIDIA H200".into(),
            compute_capability: (9, 0),
            sm_count: 132,
            memory_bytes: 150_000_000_000,
            driver_version: 13000,
            nvrtc_version: Some((13, 0)),
        }
    }

    #[test]
    fn shape_hash_is_stable_and_follows_the_shapes() {
        let tiny = crate::tiny::kimi::config().unwrap();
        assert_eq!(shape_hash(&tiny), shape_hash(&tiny.clone()));
        assert_eq!(shape_hash(&tiny).len(), 16);
        // A pinned value: the file names must not change between builds.
        assert_eq!(shape_hash(&tiny), "5977e3cad7cf9661");
        let mut eos = tiny.clone();
        eos.eos_token_ids.push(7);
        assert_eq!(shape_hash(&eos), shape_hash(&tiny), "tokens do not change the shapes");
        let mut deeper = tiny.clone();
        deeper.num_hidden_layers += 1;
        assert_ne!(shape_hash(&deeper), shape_hash(&tiny));
        let kimi = crate::bench::Preset::KimiK26Ep8.config().unwrap();
        assert_ne!(shape_hash(&kimi), shape_hash(&tiny));
    }

    #[test]
    fn verify_cost_file_round_trips() {
        let dir = std::env::temp_dir().join(format!("ddtree-verify-cost-{}", std::process::id()));
        let config = crate::tiny::kimi::config().unwrap();
        let path = verify_cost_file_in(&dir, &fingerprint(), &config);
        let name = path.file_name().unwrap().to_str().unwrap().to_string();
        assert!(
            name.starts_with(&fingerprint().id()) && name.ends_with(&format!(".verify-{}.json", shape_hash(&config))),
            "{name}"
        );
        assert_eq!(load_verify_cost_from(&path), None);
        let cost = CostModel::new("test", 100.0, 10.0, 10.0, &[(1, 1000.0), (8, 1100.0), (64, 2000.0)]).unwrap();
        save_verify_cost_to(&path, &cost).unwrap();
        assert_eq!(load_verify_cost_from(&path), Some(cost));
        std::fs::write(&path, "{\"source\": \"x\"}").unwrap();
        assert_eq!(load_verify_cost_from(&path), None, "an invalid file is ignored");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn verify_cost_measured_on_the_cpu_is_valid() {
        let model = Model::random(
            crate::CpuBackend::default(),
            crate::tiny::kimi::config().unwrap(),
            3,
            &mut |_, _| {},
        )
        .unwrap();
        let m = measure_verify_cost(&model, &[4, 1, 2, 2, 0], &Progress::silent()).unwrap();
        let cost = &m.cost;
        cost.validate().unwrap();
        let tokens: Vec<usize> = cost.verify.iter().map(|p| p.tokens).collect();
        assert_eq!(tokens, [1, 2, 4]);
        assert_eq!(m.medians.iter().map(|p| p.tokens).collect::<Vec<_>>(), tokens);
        assert!(cost.verify.iter().all(|p| p.us > 0.0));
        assert!(cost.verify.windows(2).all(|w| w[0].us <= w[1].us), "{cost:?}");
        // The model is the medians' envelope: each point the least median at its size or above.
        for (i, p) in cost.verify.iter().enumerate() {
            let least = m.medians[i..].iter().map(|q| q.us).fold(f64::INFINITY, f64::min);
            assert_eq!(p.us, least);
        }
        assert!(cost.draft_us > 0.0 && cost.source.contains("cpu"), "{cost:?}");
        assert!(measure_verify_cost(&model, &[], &Progress::silent()).is_err());
    }

    #[test]
    fn verify_sizes_are_dense_where_the_steps_matter() {
        assert!(VERIFY_SIZES.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(
            VERIFY_SIZES[..VERIFY_DENSE_UP_TO],
            *(1..=VERIFY_DENSE_UP_TO).collect::<Vec<_>>()
        );
        let rest: Vec<usize> = (72..=128).step_by(8).chain((144..=256).step_by(16)).collect();
        assert_eq!(VERIFY_SIZES[VERIFY_DENSE_UP_TO..], *rest);
        assert_eq!(
            *VERIFY_SIZES.last().unwrap(),
            crate::spec::AUTO_MAX_BUDGET,
            "the curve reaches the largest auto tree (its root's token is extrapolated)"
        );
    }
}
