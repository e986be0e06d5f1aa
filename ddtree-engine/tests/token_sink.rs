//! The token sink of `generate_*_with_sink`: it sees every committed token once, in order (one
//! per plain step, a round's accepted group at once for DDTree), it changes nothing, and
//! returning `false` stops the generation at the next round and gives the KV cache back.

use ddtree_engine::backend::live_kv_caches;
use ddtree_engine::spec::Oracle;
use ddtree_engine::{
    generate_plain, generate_plain_with_sink, generate_speculative, generate_speculative_with_sink, tiny, CpuBackend,
    GenerateOptions, LoadOptions, SpecOptions, StopReason,
};

fn options(max_new_tokens: usize) -> GenerateOptions {
    GenerateOptions {
        max_new_tokens,
        ..Default::default()
    }
}

#[test]
fn sink_sees_the_same_tokens_and_can_cancel() {
    let model = tiny::kimi::load(CpuBackend::default(), LoadOptions::default()).unwrap();
    let prompt = [5, 17, 99];
    let opts = options(20);

    let plain = generate_plain(&model, &prompt, &opts).unwrap();
    let mut seen = Vec::new();
    let mut groups = 0;
    let out = generate_plain_with_sink(&model, &prompt, &opts, &mut |t| {
        seen.extend_from_slice(t);
        groups += 1;
        true
    })
    .unwrap();
    assert_eq!(
        (out.tokens.clone(), seen.clone()),
        (plain.tokens.clone(), plain.tokens.clone())
    );
    assert_eq!(groups, plain.tokens.len(), "plain decoding commits one token per step");

    let spec = SpecOptions::fixed(8);
    let reference = generate_speculative(&model, &mut Oracle::new(8).unwrap(), &prompt, &opts, &spec).unwrap();
    let mut seen = Vec::new();
    let mut groups = Vec::new();
    let out = generate_speculative_with_sink(&model, &mut Oracle::new(8).unwrap(), &prompt, &opts, &spec, &mut |t| {
        seen.extend_from_slice(t);
        groups.push(t.len());
        true
    })
    .unwrap();
    assert_eq!(out.generation.tokens, plain.tokens);
    assert_eq!(seen, plain.tokens);
    assert_eq!(reference.generation.tokens, plain.tokens);
    // The prefill's token, then one group per round; the oracle commits several per round.
    assert_eq!(groups.len(), out.stats.rounds + 1);
    assert!(groups.iter().any(|&g| g > 1), "{groups:?}");

    // Cancel after the second group: the tokens so far are a prefix, the reason says so, and no
    // cache stays alive.
    let before = live_kv_caches();
    let mut calls = 0;
    let out = generate_speculative_with_sink(&model, &mut Oracle::new(8).unwrap(), &prompt, &opts, &spec, &mut |_| {
        calls += 1;
        calls < 2
    })
    .unwrap();
    assert_eq!(out.generation.stop_reason, StopReason::Cancelled);
    assert!(out.generation.tokens.len() < plain.tokens.len());
    assert_eq!(out.generation.tokens[..], plain.tokens[..out.generation.tokens.len()]);
    assert_eq!(calls, 2);
    let out = generate_plain_with_sink(&model, &prompt, &opts, &mut |_| false).unwrap();
    assert_eq!((out.tokens.len(), out.stop_reason), (1, StopReason::Cancelled));
    assert_eq!(live_kv_caches(), before);
}
