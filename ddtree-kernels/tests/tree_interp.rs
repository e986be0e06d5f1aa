//! The tree kernels run on the CPU interpreter at small sizes against the CPU references:
//! builder (top-K + expansion + mask) identical, accept / sampling identical, compaction exact.
//! (Verify attention is `tests/interp.rs`'s `verify_attention`, through the registry.)

use ddtree_codegen::interp::{Buffer, Element, HostArg, Program};
use ddtree_codegen::Kernel;
use ddtree_kernels::tree::build::expansion_candidates;
use ddtree_kernels::tree::reference::{build_with_lse, DraftTree};
use ddtree_kernels::tree::{
    accept_reference, build_reference, sample_rows, tree_size, CompactRows, TreeAccept, TreeBuild, TreeBuildParams,
    TreeSample, TreeStage,
};
use half::bf16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn run<K: Kernel>(p: &K::Params, grid: [u32; 3], args: &mut [HostArg<'_>]) {
    Program::of::<K>(p)
        .expect("lowers")
        .launch(grid, args)
        .unwrap_or_else(|e| panic!("{}: {e:?}", K::NAME));
}

fn buf<T: Element>(v: &[T]) -> Buffer {
    Buffer::from_slice(v)
}

fn u(v: u32) -> HostArg<'static> {
    HostArg::Scalar(v.into())
}

/// Builds a tree with [`TreeBuild`] variant `p` (one launch; slices of `span` logits); returns
/// it and the kernel's lse. Launches twice to check that the counters are left at zero.
fn gpu_build(
    p: &TreeBuildParams,
    logits: &[f32],
    l: usize,
    v: usize,
    budget: usize,
    root: u32,
    span: usize,
) -> (DraftTree, Vec<f32>) {
    let k = budget.min(v);
    let cap = budget + 1;
    let span = span.min(p.tile() as usize);
    let nb = v.div_ceil(span);
    let lg = buf(logits);
    let rootb = buf(&[root]);
    let cands = (l * nb * k).max(expansion_candidates(budget, k));
    let mut scratch = [
        buf(&vec![u32::MAX; cands]),
        buf(&vec![u32::MAX; cands]),
        buf(&vec![f32::NAN; l * nb * 2]),
        buf(&vec![f32::NAN; l * k]),
        buf(&vec![u32::MAX; l * k]),
        buf(&vec![f32::NAN; l]),
        buf(&vec![0u32; l + 1]),
    ];
    let mut outs = [
        buf(&vec![u32::MAX; cap]),
        buf(&vec![i32::MIN; cap]),
        buf(&vec![u32::MAX; cap]),
        buf(&vec![i32::MIN; cap]),
        buf(&vec![i32::MIN; cap]),
        buf(&vec![f32::NAN; cap]),
        buf(&[0u32]),
        buf(&vec![0xdead_beefu32; cap * cap.div_ceil(32)]),
    ];
    for _ in 0..2 {
        let [ck, ct, ms, lp, tok, lse, counters] = &mut scratch;
        let [tk, par, dep, fc, ns, plp, n, mask] = &mut outs;
        run::<TreeBuild>(
            p,
            [nb as u32, l as u32, 1],
            &mut [
                HostArg::In(&lg),
                HostArg::In(&rootb),
                HostArg::Out(ck),
                HostArg::Out(ct),
                HostArg::Out(ms),
                HostArg::Out(lp),
                HostArg::Out(tok),
                HostArg::Out(lse),
                HostArg::Out(counters),
                HostArg::Out(tk),
                HostArg::Out(par),
                HostArg::Out(dep),
                HostArg::Out(fc),
                HostArg::Out(ns),
                HostArg::Out(plp),
                HostArg::Out(n),
                HostArg::Out(mask),
                u(v as u32),
                u(k as u32),
                u(v.div_ceil(nb) as u32),
                u(l as u32),
                u(budget as u32),
                u(3),
            ],
        );
        assert_eq!(counters.to_vec::<u32>(), vec![0; l + 1], "counters left at zero");
    }
    let n = outs[6].to_vec::<u32>()[0] as usize;
    let words = n.div_ceil(32);
    let t = DraftTree {
        token: outs[0].to_vec::<u32>()[..n].to_vec(),
        parent: outs[1].to_vec::<i32>()[..n].to_vec(),
        depth: outs[2].to_vec::<u32>()[..n].to_vec(),
        first_child: outs[3].to_vec::<i32>()[..n].to_vec(),
        next_sibling: outs[4].to_vec::<i32>()[..n].to_vec(),
        mask: outs[7].to_vec::<u32>()[..n * words].to_vec(),
        words,
        path_logprob: outs[5].to_vec::<f32>()[..n].to_vec(),
    };
    (t, scratch[5].to_vec())
}

/// Every how many variants a case runs: `reduced` in the default run (case `i` takes the
/// variants `j` with `(i + j) % reduced == 0`, so every variant meets every `reduced`-th case and
/// every case some variants), 1 (every variant on every case) with `DDTREE_FULL_CHECKS=1`.
fn sweep_stride(reduced: usize) -> usize {
    if std::env::var_os("DDTREE_FULL_CHECKS").is_some_and(|v| v != "0") {
        1
    } else {
        reduced
    }
}

/// Builds each case `(depth, vocab, budget, ties, span)` on fresh logits (half steps in
/// -1.5..=1 with `ties`, else uniform in -8..8) with every variant `keep` takes, against the
/// CPU builder.
fn builds_match(seed: u64, cases: &[(usize, usize, usize, bool, usize)], keep: impl Fn(&TreeBuildParams) -> bool) {
    let mut rng = StdRng::seed_from_u64(seed);
    let stride = sweep_stride(3).min(cases.len().max(1));
    for (ci, &(l, v, budget, ties, span)) in cases.iter().enumerate() {
        let logits: Vec<f32> = (0..l * v)
            .map(|_| {
                if ties {
                    rng.random_range(-3i32..3) as f32 * 0.5
                } else {
                    rng.random_range(-8.0f32..8.0)
                }
            })
            .collect();
        let variants = TreeBuild::space().into_iter().filter(|p| keep(p));
        for (_, p) in variants.enumerate().filter(|(j, _)| (j + ci) % stride == 0) {
            let (t, lse) = gpu_build(&p, &logits, l, v, budget, 17, span);
            let want = build_with_lse(&logits, v, budget, 17, &lse);
            assert_eq!(t, want, "{} l={l} v={v} budget={budget}", TreeBuild::symbol(&p));
        }
    }
}

#[test]
fn builder_kernels_match_the_reference() {
    builds_match(
        5,
        &[
            (3, 300, 20, false, 64),
            (2, 50, 40, true, 16),
            (4, 9, 30, true, 4),
            (4, 9, 30, false, 9),
            (4, 9, 30, true, 9),
            (1, 700, 64, false, 8192),
            (3, 1000, 100, true, 128),
            (5, 40, 12, true, 8),
            (3, 64, 300, true, 16),
            (3, 512, 1, false, 64),
            (3, 512, 2, true, 64),
            (3, 512, 3, false, 64),
            (7, 512, 8, true, 64),
        ],
        |_| true,
    );
}

#[test]
fn accept_sample_and_compaction_kernels_match_the_reference() {
    let mut rng = StdRng::seed_from_u64(3);
    let (l, v, budget) = (3usize, 6usize, 30usize);
    let logits: Vec<f32> = (0..l * v).map(|_| rng.random_range(-2.0f32..2.0)).collect();
    let tree = ddtree_kernels::tree::build_reference(&logits, l, v, budget, 2);
    let n = tree.len();
    let target_logits: Vec<f32> = (0..n * v).map(|_| rng.random_range(-2.0f32..2.0)).collect();
    let mut samples = buf(&vec![u32::MAX; n]);
    let tl = buf(&target_logits);
    let sp = TreeSample::space()[1];
    run::<TreeSample>(
        &sp,
        [n as u32, 1, 1],
        &mut [
            HostArg::In(&tl),
            HostArg::Out(&mut samples),
            u(v as u32),
            HostArg::Scalar(0.7f32.into()),
            u(1234),
        ],
    );
    let want_s = sample_rows(&target_logits, v, 0.7, 1234);
    assert_eq!(samples.to_vec::<u32>(), want_s);
    // Accept with a target that follows the tree for a while.
    let mut target = want_s.clone();
    if let Some(&c) = tree.children(0).get(1) {
        target[0] = tree.token[c];
    }
    let want = accept_reference(&tree, &target);
    let (tk, par, dep, tg) = (buf(&tree.token), buf(&tree.parent), buf(&tree.depth), buf(&target));
    let (mut acc, mut path, mut len, mut bonus) = (
        buf(&vec![u32::MAX; l + 1]),
        buf(&vec![u32::MAX; l + 1]),
        buf(&[0u32]),
        buf(&[0u32]),
    );
    run::<TreeAccept>(
        &(),
        [1, 1, 1],
        &mut [
            HostArg::In(&tk),
            HostArg::In(&par),
            HostArg::In(&dep),
            HostArg::In(&tg),
            HostArg::Out(&mut acc),
            HostArg::Out(&mut path),
            HostArg::Out(&mut len),
            HostArg::Out(&mut bonus),
            u(n as u32),
        ],
    );
    let len = len.to_vec::<u32>()[0] as usize;
    assert!(len > 1, "the target follows the tree for a while");
    assert_eq!(acc.to_vec::<u32>()[..len], want.indices[..]);
    assert_eq!(path.to_vec::<u32>()[..len], want.tokens[..]);
    assert_eq!(bonus.to_vec::<u32>()[0], want.bonus);
    // Compaction of 2 layers of 24-wide rows after a prefix of 3.
    let (layers, width, base, cap) = (2usize, 24usize, 3usize, 3 + n);
    let data: Vec<bf16> = (0..layers * cap * width).map(|i| bf16::from_f32(i as f32)).collect();
    let mut b = buf(&data);
    let idx = buf(&want.indices);
    let lenb = buf(&[want.indices.len() as u32]);
    run::<CompactRows>(
        &(),
        [layers as u32, 1, 1],
        &mut [
            HostArg::Out(&mut b),
            HostArg::In(&idx),
            HostArg::In(&lenb),
            u(base as u32),
            u(width as u32),
            u((cap * width) as u32),
        ],
    );
    let got = b.to_vec::<bf16>();
    for layer in 0..layers {
        for (i, &src) in want.indices.iter().enumerate() {
            let off = layer * cap * width;
            assert_eq!(
                got[off + (base + i) * width..][..width],
                data[off + (base + src as usize) * width..][..width]
            );
        }
    }
}

/// Heavy exact ties at a tiny vocabulary (every path score equal across many prefixes): the
/// expansion's candidate bound must count only the members of the expanded depth (a regression
/// found by the GPU check at vocab 9, budget 30).
#[test]
fn builder_matches_the_reference_under_heavy_ties() {
    let stride = sweep_stride(4);
    for seed in 0..40u64 {
        let mut rng = StdRng::seed_from_u64(seed);
        let logits = ddtree_kernels::tree::check::random_logits(&mut rng, 4, 9);
        let variants = TreeBuild::space().into_iter().enumerate();
        for (_, p) in variants.filter(|(j, _)| (*j + seed as usize) % stride == 0) {
            let (t, lse) = gpu_build(&p, &logits, 4, 9, 30, 17, 9);
            let want = build_with_lse(&logits, 9, 30, 17, &lse);
            assert_eq!(t, want, "seed {seed} {}", TreeBuild::symbol(&p));
        }
    }
}

/// The slice floor when k is more than two keys per warp (each warp's m-th largest of its
/// lanes' second-largest keys): here the largest keys are the multiples of 32, two to a lane
/// (one lane of each warp at two items per thread) and fewer than k, so a floor from fewer
/// lanes would drop keys of the top k.
#[test]
fn builder_floor_holds_when_the_largest_keys_share_lanes() {
    let mut rng = StdRng::seed_from_u64(9);
    let (l, v, budget) = (2usize, 1500usize, 64usize);
    let logits: Vec<f32> = (0..l * v)
        .map(|i| {
            if (i % v) % 32 == 0 {
                6.0 + rng.random_range(0.0f32..1.0)
            } else {
                rng.random_range(-4.0f32..4.0)
            }
        })
        .collect();
    for p in TreeBuild::space() {
        let (t, lse) = gpu_build(&p, &logits, l, v, budget, 17, 8192);
        let want = build_with_lse(&logits, v, budget, 17, &lse);
        assert_eq!(t, want, "{}", TreeBuild::symbol(&p));
    }
}

/// The sorted merge over many slices (18 and 50 lists: level-one merges in registers, then
/// three and four rounds through shared memory), with and without ties.
#[test]
fn sorted_merge_matches_the_reference_over_many_slices() {
    builds_match(21, &[(2, 1152, 64, false, 64), (2, 1300, 20, true, 26)], |p| p.sorted);
}

/// The staging kernel writes a built tree as a verify step's inputs: the tree's tokens, its
/// positions from `start` and its mask rows, for trees of one to three mask words per row
/// (at 40 and 70 nodes, some lanes past `n` and past `n * words` do nothing).
#[test]
fn staging_kernel_matches_the_tree() {
    let mut rng = StdRng::seed_from_u64(5);
    for (l, v, budget) in [(3usize, 6usize, 30usize), (4, 9, 39), (5, 3, 69), (2, 2, 40)] {
        let logits: Vec<f32> = (0..l * v).map(|_| rng.random_range(-2.0f32..2.0)).collect();
        let tree = build_reference(&logits, l, v, budget, 11);
        let n = tree.len();
        assert_eq!(n, tree_size(l, v, budget));
        let start = 77u32;
        // The builder's buffers hold budget + 1 nodes; stale values past the tree.
        let cap = budget + 1;
        let mut token = tree.token.clone();
        token.resize(cap, u32::MAX);
        let mut depth = tree.depth.clone();
        depth.resize(cap, u32::MAX);
        let mut mask = tree.mask.clone();
        mask.resize(cap * cap.div_ceil(32), u32::MAX);
        let (tk, dp, mk) = (buf(&token), buf(&depth), buf(&mask));
        // The whole tree, and its top-(m - 1) trees (`auto`'s cut; fewer mask words per row).
        for m in [n, n - n / 3, n / 2 + 1, 1] {
            let mut cut = tree.clone();
            cut.truncate(m);
            let (mut tokens, mut positions, mut mask_out) = (
                buf(&vec![u32::MAX; m]),
                buf(&vec![u32::MAX; m]),
                buf(&vec![u32::MAX; m * cut.words]),
            );
            let grid = (m * cut.words).div_ceil(256) as u32;
            run::<TreeStage>(
                &(),
                [grid, 1, 1],
                &mut [
                    HostArg::In(&tk),
                    HostArg::In(&dp),
                    HostArg::In(&mk),
                    HostArg::Out(&mut tokens),
                    HostArg::Out(&mut positions),
                    HostArg::Out(&mut mask_out),
                    u(m as u32),
                    u(cut.words as u32),
                    u(tree.words as u32),
                    u(start),
                ],
            );
            let case = format!("l={l} v={v} budget={budget} cut={m}");
            assert_eq!(tokens.to_vec::<u32>(), cut.token, "{case}");
            assert_eq!(positions.to_vec::<u32>(), cut.positions(start), "{case}");
            assert_eq!(mask_out.to_vec::<u32>(), cut.mask, "{case}");
        }
    }
}
