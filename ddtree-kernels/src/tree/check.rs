//! GPU-versus-CPU checks of the tree kernels (fresh random inputs, poisoned outputs), in the
//! style of [`crate::check`], whose comparison types they reuse.

use ddtree_codegen::Kernel;
use ddtree_runtime::{Gpu, RuntimeError};
use rand::rngs::StdRng;
use rand::Rng;

use super::gpu::{builder_fits, download, upload, verify_splits, zeros, GpuAccept, GpuBuilder};
use super::reference::{build_with_lse, combine_reference, fill_mask, logsumexp_rows};
use super::{
    accept_reference, chain_mask, combine_grid, combine_layout, combine_output_grid, sample_rows,
    verify_attention_reference, DraftTree, MlaCombineOutput, MlaVerifyCombine, MlaVerifyNaive, MlaVerifyNarrow,
    MlaVerifySplit, MlaVerifyWg, MlaVerifyWide, TreeBuild, TreeBuildParams, TreeSample, VerifyVariant, LATENT, ROW,
};
use crate::attention::mla_absorb::output_reference;
use crate::check::{
    compare, poisoned_bf16, random_bf16, result, Arg, CheckError, CheckResult, Comparison, DevBuf, Sizes, Target,
    Tolerance,
};

/// A tree flattened to exact f32 values (mask words as two 16-bit halves, log-probs as is).
fn flatten(t: &DraftTree) -> Vec<f32> {
    let mut v: Vec<f32> = t.token.iter().map(|&x| x as f32).collect();
    v.extend(
        t.parent
            .iter()
            .chain(&t.first_child)
            .chain(&t.next_sibling)
            .map(|&x| x as f32),
    );
    v.extend(t.depth.iter().map(|&x| x as f32));
    v.extend(t.mask.iter().flat_map(|&w| [(w & 0xffff) as f32, (w >> 16) as f32]));
    v.extend(&t.path_logprob);
    v
}

fn exact(kernel: &'static str, symbol: String, case: String, got: &[f32], want: &[f32]) -> CheckResult {
    let comparison = if got.len() == want.len() {
        compare(got, want, Tolerance::EXACT)
    } else {
        Comparison {
            len: got.len(),
            max_abs: f32::INFINITY,
            rel_l2: f32::INFINITY,
            bad: got.len().max(want.len()),
            first_bad: None,
        }
    };
    CheckResult {
        kernel,
        symbol,
        case,
        passed: comparison.passed(Tolerance::EXACT),
        comparison,
    }
}

/// Random drafter logits `[depth, vocab]`, with a few exact ties near the top of each row.
pub fn random_logits(rng: &mut StdRng, depth: usize, vocab: usize) -> Vec<f32> {
    let mut l: Vec<f32> = (0..depth * vocab).map(|_| rng.random_range(-12.0f32..12.0)).collect();
    for d in 0..depth {
        let top = 14.0 + rng.random_range(0..3) as f32;
        for _ in 0..3 {
            l[d * vocab + rng.random_range(0..vocab)] = top;
        }
    }
    l
}

/// Random logits `[depth, vocab]` of a confident drafter: the noise of [`random_logits`] under
/// a head of 8 random tokens holding about 80% of each row's mass (the top one about 40%), so
/// the best trees run deep and every expansion round adds nodes.
pub fn confident_logits(rng: &mut StdRng, depth: usize, vocab: usize) -> Vec<f32> {
    let mut l: Vec<f32> = (0..depth * vocab).map(|_| rng.random_range(-12.0f32..12.0)).collect();
    for d in 0..depth {
        for r in 0..8 {
            l[d * vocab + rng.random_range(0..vocab)] = 21.5 - 0.5 * r as f32 - rng.random_range(0.0f32..0.4);
        }
    }
    l
}

/// A named generator of drafter logits `[depth, vocab]` ([`random_logits`], [`confident_logits`]).
pub type LogitsProfile = (&'static str, fn(&mut StdRng, usize, usize) -> Vec<f32>);

/// The logits profiles the builder is checked and timed on.
pub const LOGITS_PROFILES: [LogitsProfile; 2] = [("random", random_logits), ("confident", confident_logits)];

/// Checks the builder, every variant of [`TreeBuild`] that fits the shape, with
/// [`builder_variant`].
pub fn builder(
    gpu: &Gpu,
    depth: usize,
    vocab: usize,
    budget: usize,
    rng: &mut StdRng,
) -> Result<Vec<CheckResult>, RuntimeError> {
    let mut out = Vec::new();
    for p in TreeBuild::space()
        .into_iter()
        .filter(|p| builder_fits(p, vocab, budget))
    {
        out.extend(builder_variant(gpu, &p, depth, vocab, budget, rng)?);
    }
    Ok(out)
}

/// Checks builder variant `p` (which must [fit](builder_fits) the shape) on fresh logits of
/// each profile (random with ties, and confident) and poisoned outputs: the tree must equal the
/// CPU builder's fed with the GPU's per-depth log-sum-exp (identical arithmetic), and that
/// log-sum-exp must match the CPU's (1e-5).
pub fn builder_variant(
    gpu: &Gpu,
    p: &TreeBuildParams,
    depth: usize,
    vocab: usize,
    budget: usize,
    rng: &mut StdRng,
) -> Result<Vec<CheckResult>, RuntimeError> {
    let s = gpu.stream();
    let mut out = Vec::new();
    for (profile, make) in LOGITS_PROFILES {
        let logits = make(rng, depth, vocab);
        let root = rng.random_range(0..vocab as u32);
        let mut b = GpuBuilder::with_params(gpu, p, depth, vocab, budget)?;
        // Poison the outputs.
        b.token = upload(s, &vec![u32::MAX; budget + 1])?;
        b.parent = upload(s, &vec![i32::MIN; budget + 1])?;
        b.first_child = upload(s, &vec![i32::MIN; budget + 1])?;
        b.path_lp = upload(s, &vec![f32::NAN; budget + 1])?;
        b.mask = upload(s, &vec![0xdead_beef; (budget + 1) * (budget + 1).div_ceil(32)])?;
        b.lse = upload(s, &vec![f32::NAN; depth])?;
        // Twice: the second build checks that the launch left its counters at zero.
        let dl = upload(s, &logits)?;
        let dr = upload(s, &[root])?;
        b.build(s, &dl, &dr)?;
        b.build(s, &dl, &dr)?;
        let (tree, lse) = b.download(s)?;
        let want = build_with_lse(&logits, vocab, budget, root, &lse);
        let case = format!("{profile} depth={depth} vocab={vocab} budget={budget}");
        let sym = TreeBuild::symbol(p);
        let cpu_lse = logsumexp_rows(&logits, vocab);
        let tol = Tolerance {
            rtol: 1e-5,
            atol: 1e-5,
            rel_l2: 1e-5,
        };
        let c = compare(&lse, &cpu_lse, tol);
        out.push(exact(
            "tree_build",
            sym.clone(),
            case.clone(),
            &flatten(&tree),
            &flatten(&want),
        ));
        out.push(CheckResult {
            kernel: "tree_build_lse",
            symbol: sym,
            case,
            passed: c.passed(tol),
            comparison: c,
        });
    }
    Ok(out)
}

/// A random tree of `nodes` nodes (random earlier parents) as mask rows, or a chain.
pub fn random_mask(rng: &mut StdRng, nodes: usize, chain: bool) -> (Vec<u32>, usize) {
    if chain {
        return chain_mask(nodes);
    }
    let parent = (0..nodes)
        .map(|t| if t == 0 { -1 } else { rng.random_range(0..t) as i32 })
        .collect();
    let mut t = DraftTree {
        token: vec![0; nodes],
        parent,
        depth: vec![0; nodes],
        first_child: vec![-1; nodes],
        next_sibling: vec![-1; nodes],
        mask: vec![],
        words: 0,
        path_logprob: vec![0.0; nodes],
    };
    fill_mask(&mut t);
    (t.mask, t.words)
}

/// One verify-attention problem: the committed prefix on the device, the upper bound the grid
/// is sized from, nodes, heads, a chain or a random tree, and the split count (`None`: automatic
/// for 132 SMs).
#[derive(Clone, Copy, Debug)]
pub struct VerifyCase {
    /// Committed prefix length (`lens[0]`).
    pub prefix: usize,
    /// Upper bound of the prefix (grid sizing), `>= prefix`.
    pub bound: usize,
    /// Tree nodes.
    pub nodes: usize,
    /// Heads.
    pub heads: usize,
    /// A chain instead of a random tree.
    pub chain: bool,
    /// Split count (`None`: [`verify_splits`] for 132 SMs and `bound`).
    pub splits: Option<usize>,
}

/// Most tokens [`verify`] checks [`MlaCombineOutput`] at (its use: the decode step's one or two).
const COMBINE_OUTPUT_MAX_TOKENS: usize = 2;

/// Every candidate of [`MlaCombineOutput`] on the split partials `po` / `pl` of one verify case
/// (`(tokens, heads, splits)`) against [`MlaVerifyCombine`]'s merged rows `merged` through the
/// f64 absorbed output projection of a fresh random `kv_b` (64 output columns per head, so the
/// 128- and 32-column slabs see a partial and several full slabs): the same sums up to their
/// order and the latent row's rounding. Poisoned outputs, bf16 tolerance.
fn combine_output(
    t: &Target<'_>,
    po: &DevBuf<u32>,
    pl: &DevBuf<f32>,
    merged: &[f32],
    (tokens, heads, splits): (usize, usize, usize),
    case: &str,
    rng: &mut StdRng,
) -> Result<Vec<CheckResult>, CheckError> {
    let (nope, v) = (16usize, 72usize);
    let (kh, kf) = random_bf16(rng, heads * (nope + v) * LATENT, -1.0, 1.0);
    let want = output_reference(merged, &kf, tokens, heads, (nope, v, LATENT));
    let tol = Tolerance::bf16_sums(&want);
    let dk = t.upload(&kh)?;
    let rows = tokens * heads;
    let mut results = Vec::new();
    for p in MlaCombineOutput::space() {
        let mut o = poisoned_bf16(t, rows * v)?;
        let mut args = [
            Arg::In(po),
            Arg::In(pl),
            Arg::In(&dk),
            Arg::Out(&mut o),
            Arg::from(rows as u32),
            Arg::from(splits as u32),
            Arg::from(heads as u32),
            Arg::from(nope as u32),
            Arg::from(v as u32),
        ];
        let grid = combine_output_grid(&p, tokens as u32, heads as u32, v as u32);
        // SAFETY: the partials hold splits * rows rows, kv_b heads * (nope + v) rows of 512,
        // out tokens * heads * v.
        unsafe { t.launch::<MlaCombineOutput>(&p, grid, &mut args)? };
        let got: Vec<f32> = t.download(&o)?.iter().map(|x| x.to_f32()).collect();
        results.push(result::<MlaCombineOutput>(
            &p,
            format!("{case} nope={nope} v={v}"),
            &got,
            &want,
            tol,
        ));
    }
    Ok(results)
}

/// Tolerance of a merged log-sum-exp.
const LSE_TOL: Tolerance = Tolerance {
    rtol: 1e-3,
    atol: 1e-3,
    rel_l2: 1e-3,
};

/// Runs [`MlaVerifyCombine`] on the split partials `po` / `pl` (`splits` x `rows`) into poisoned
/// outputs; returns the merged rows and log-sum-exps.
fn run_combine(
    t: &Target<'_>,
    po: &DevBuf<u32>,
    pl: &DevBuf<f32>,
    rows: usize,
    splits: usize,
) -> Result<(Vec<f32>, Vec<f32>), CheckError> {
    let layout = combine_layout(splits as u32);
    let mut o = poisoned_bf16(t, rows * LATENT)?;
    let mut l = t.upload(&vec![f32::NAN; rows])?;
    let mut args = [
        Arg::In(po),
        Arg::In(pl),
        Arg::Out(&mut o),
        Arg::Out(&mut l),
        Arg::from(rows as u32),
        Arg::from(splits as u32),
        Arg::from(layout.0),
        Arg::from(layout.1),
    ];
    // SAFETY: the partials hold splits * rows rows; out and lse hold rows rows.
    unsafe { t.launch::<MlaVerifyCombine>(&(), combine_grid(rows as u32, layout), &mut args)? };
    let got = t.download(&o)?.iter().map(|x| x.to_f32()).collect();
    Ok((got, t.download(&l)?))
}

/// Checks [`MlaVerifyCombine`] (and every [`MlaCombineOutput`] candidate on the same partials)
/// on synthetic split partials of `tokens * heads` rows over `splits` splits against the f64
/// merge: log-sum-exps that grow with the split index (the row's largest in a warp's last
/// rounds), about one split in eight at `-inf` with a NaN partial (never written by a split that
/// saw no key), bf16 partials.
fn combine_merge(
    t: &Target<'_>,
    (tokens, heads, splits): (usize, usize, usize),
    rng: &mut StdRng,
) -> Result<Vec<CheckResult>, CheckError> {
    let rows = tokens * heads;
    let (mut ph, mut pf) = random_bf16(rng, splits * rows * LATENT, -1.0, 1.0);
    let mut lse = vec![0f32; splits * rows];
    for s in 0..splits {
        for r in 0..rows {
            let dead = rng.random_range(0..8) == 0;
            lse[s * rows + r] = if dead {
                f32::NEG_INFINITY
            } else {
                -20.0 + 24.0 * s as f32 / splits as f32 + rng.random_range(-4.0f32..4.0)
            };
            if dead {
                let at = (s * rows + r) * LATENT;
                ph[at..at + LATENT].fill(half::bf16::NAN);
                pf[at..at + LATENT].fill(f32::NAN);
            }
        }
    }
    let (want, want_lse) = combine_reference(&pf, &lse, rows, splits);
    let pairs: Vec<u32> = ph
        .chunks(2)
        .map(|p| p[0].to_bits() as u32 | (p[1].to_bits() as u32) << 16)
        .collect();
    let (po, pl) = (t.upload(&pairs)?, t.upload(&lse)?);
    let (lsg, lwp) = combine_layout(splits as u32);
    let case = format!("tokens={tokens} heads={heads} splits={splits} lsg={lsg} lwp={lwp} synthetic partials");
    let (got, got_lse) = run_combine(t, &po, &pl, rows, splits)?;
    let mut out = vec![
        result::<MlaVerifyCombine>(&(), case.clone(), &got, &want, Tolerance::bf16_sums(&want)),
        result::<MlaVerifyCombine>(&(), format!("{case} lse"), &got_lse, &want_lse, LSE_TOL),
    ];
    out.extend(combine_output(t, &po, &pl, &got, (tokens, heads, splits), &case, rng)?);
    Ok(out)
}

/// Checks split-KV + combine for each of `variants` (and the naive kernel when `naive`) on one
/// case against the f64 CPU reference, computed once: fresh random inputs, poisoned outputs and
/// partials (NaN) per run, bf16 tolerance on the output (absolute part scaled by its RMS), 1e-3
/// on the LSE.
pub fn verify(
    t: &Target<'_>,
    variants: &[VerifyVariant],
    c: VerifyCase,
    naive: bool,
    rng: &mut StdRng,
) -> Result<Vec<CheckResult>, CheckError> {
    let VerifyCase {
        prefix,
        bound,
        nodes,
        heads,
        chain,
        ..
    } = c;
    let rows = nodes * heads;
    let (qh, qf) = random_bf16(rng, rows * ROW, -1.0, 1.0);
    let (ch, cf) = random_bf16(rng, (prefix + nodes) * ROW, -1.0, 1.0);
    let (mask, words) = random_mask(rng, nodes, chain);
    let scale = 2.0047 / (192f32).sqrt();
    let (want, want_lse) = verify_attention_reference(&qf, &cf, &mask, words, nodes, heads, prefix, scale);
    let (dq, dc, dm, dl) = (
        t.upload(&qh)?,
        t.upload(&ch)?,
        t.upload(&mask)?,
        t.upload(&[prefix as u32])?,
    );
    // The output is a convex combination of value rows, through bf16 probabilities and bf16
    // split partials: its error scales with the values (here up to 1), not with the output,
    // which averaging over many keys makes smaller (an RMS-scaled bound failed on a valid run).
    let vrms = (cf.iter().map(|v| v * v).sum::<f32>() / cf.len().max(1) as f32).sqrt();
    let tol = Tolerance {
        atol: 1e-2 * vrms,
        ..Tolerance::bf16_sums(&want)
    };
    let kind = if chain { "chain" } else { "tree" };
    let mut out = Vec::new();
    for (vi, v) in variants.iter().enumerate() {
        let splits = c
            .splits
            .unwrap_or_else(|| verify_splits(v, 132, rows, bound + nodes, usize::MAX));
        let (lsg, lwp) = combine_layout(splits as u32);
        let case = format!(
            "ctx={prefix} bound={bound} nodes={nodes} heads={heads} {kind} splits={splits} lsg={lsg} lwp={lwp}"
        );
        let mut po = t.upload(&vec![0x7fc0_7fc0u32; splits * rows * LATENT / 2])?;
        let mut pl = t.upload(&vec![f32::NAN; splits * rows])?;
        let grid = ((rows as u32).div_ceil(v.rows_per_block()), splits as u32);
        let mut args = [
            Arg::In(&dq),
            Arg::In(&dc),
            Arg::In(&dm),
            Arg::In(&dl),
            Arg::Out(&mut po),
            Arg::Out(&mut pl),
            Arg::from(rows as u32),
            Arg::from(heads as u32),
            Arg::from(nodes as u32),
            Arg::from(words as u32),
            Arg::from(scale),
        ];
        // SAFETY: q holds rows rows, the cache lens[0] + nodes rows, the mask nodes rows of
        // words, the partials splits * rows rows.
        unsafe {
            match v {
                VerifyVariant::Split(p) => t.launch::<MlaVerifySplit>(p, grid, &mut args)?,
                VerifyVariant::Wide(p) => t.launch::<MlaVerifyWide>(p, grid, &mut args)?,
                VerifyVariant::Wg(p) => t.launch::<MlaVerifyWg>(p, grid, &mut args)?,
                VerifyVariant::Narrow => t.launch::<MlaVerifyNarrow>(&(), grid, &mut args)?,
            }
        };
        let (got, got_lse) = run_combine(t, &po, &pl, rows, splits)?;
        // On the first variant's partials (every split pass writes the same format).
        if vi == 0 && nodes <= COMBINE_OUTPUT_MAX_TOKENS {
            out.extend(combine_output(t, &po, &pl, &got, (nodes, heads, splits), &case, rng)?);
        }
        for (case, got, want, tol) in [
            (case.clone(), &got, &want, tol),
            (format!("{case} lse"), &got_lse, &want_lse, LSE_TOL),
        ] {
            let comparison = compare(got, want, tol);
            out.push(CheckResult {
                kernel: "mla_verify",
                symbol: v.symbol(),
                case,
                passed: comparison.passed(tol),
                comparison,
            });
        }
    }
    if naive {
        let case = format!("ctx={prefix} nodes={nodes} heads={heads} {kind}");
        let mut o = poisoned_bf16(t, rows * LATENT)?;
        let mut l = t.upload(&vec![f32::NAN; rows])?;
        let mut args = [
            Arg::In(&dq),
            Arg::In(&dc),
            Arg::In(&dm),
            Arg::Out(&mut o),
            Arg::Out(&mut l),
            Arg::from(heads as u32),
            Arg::from(prefix as u32),
            Arg::from(nodes as u32),
            Arg::from(words as u32),
            Arg::from(scale),
        ];
        // SAFETY: as above; out and lse hold rows rows.
        unsafe { t.launch::<MlaVerifyNaive>(&(), rows as u32, &mut args)? };
        let got: Vec<f32> = t.download(&o)?.iter().map(|x| x.to_f32()).collect();
        out.push(result::<MlaVerifyNaive>(&(), case.clone(), &got, &want, tol));
        out.push(result::<MlaVerifyNaive>(
            &(),
            format!("{case} lse"),
            &t.download(&l)?,
            &want_lse,
            LSE_TOL,
        ));
    }
    Ok(out)
}

/// Every candidate of [`MlaVerifySplit`], [`MlaVerifyWide`] and [`MlaVerifyWg`] (with [`MlaVerifyCombine`]), and
/// the naive kernel, at the sizes of `sizes`: nodes 1..64, heads 8 and 64, chains and random
/// trees, ragged prefixes, a grid sized from a larger bound than the device length (empty
/// splits), one and several splits. The full sizes add contexts up to 32K.
pub fn verify_suite(t: &Target<'_>, sizes: Sizes, rng: &mut StdRng) -> Result<Vec<CheckResult>, CheckError> {
    let case = |prefix, bound, nodes, heads, chain, splits| VerifyCase {
        prefix,
        bound,
        nodes,
        heads,
        chain,
        splits,
    };
    let mut cases = vec![
        case(1, 1, 1, 8, true, Some(1)),
        case(37, 200, 6, 8, false, Some(3)),
        case(70, 70, 1, 64, true, Some(2)),
        case(5, 5, 64, 1, false, Some(2)),
        case(200, 200, 2, 8, false, Some(1)),
        // Many splits (the combine's multi-warp items; most splits past the keys see none).
        case(300, 300, 1, 8, true, Some(37)),
        case(130, 200, 2, 8, false, Some(9)),
        // Long splits of one 8-row block (six 64-key tiles each: the online rescale).
        case(700, 700, 1, 8, true, Some(2)),
    ];
    if sizes == Sizes::Full {
        cases.extend([
            case(100, 100, 7, 8, false, None),
            case(1000, 1000, 16, 8, false, None),
            case(1000, 1000, 8, 64, false, None),
            case(4096, 4096, 64, 8, false, None),
            case(32768, 32768, 8, 8, false, None),
            case(32768, 32768, 1, 8, true, None),
            case(32768, 32768, 1, 64, true, None),
            case(513, 513, 33, 8, true, None),
            case(2000, 2000, 64, 64, false, None),
            case(5000, 32768, 4, 64, false, None),
            case(3, 32768, 16, 64, false, None),
        ]);
    }
    if sizes == Sizes::Full {
        cases.push(case(9, 9, 3, 64, false, Some(1)));
        cases.push(case(5, 5, 40, 2, false, Some(2)));
    }
    // The interpreter runs every variant; a GPU those it can (no `wgmma` before or after sm_90).
    let variants: Vec<VerifyVariant> = VerifyVariant::all()
        .into_iter()
        .filter(|v| match t {
            Target::Interp => true,
            Target::Gpu(g) => v.runs_on(g.fingerprint().compute_capability),
        })
        .collect();
    let mut out = Vec::new();
    for &c in &cases {
        out.extend(verify(t, &variants, c, true, rng)?);
    }
    // The merge alone: many live splits (two rounds per combine thread at 600), and a few.
    for shape in [(1, 8, 150), (2, 64, 132), (1, 3, 5), (1, 2, 600)] {
        out.extend(combine_merge(t, shape, rng)?);
    }
    Ok(out)
}

/// Checks the staging of a tree built on the GPU as a verify step's inputs, sampling (GPU
/// samples == CPU samples), greedy accept on those samples (its one-copy result and the bonus
/// token) and the compaction of 61 layers of 576-wide rows.
pub fn accept(
    gpu: &Gpu,
    depth: usize,
    vocab: usize,
    budget: usize,
    rng: &mut StdRng,
) -> Result<Vec<CheckResult>, RuntimeError> {
    let s = gpu.stream();
    let mut b = GpuBuilder::new(gpu, depth, vocab, budget)?;
    let logits = random_logits(rng, depth, vocab);
    let mut root = upload(s, &[1u32])?;
    b.build(s, &upload(s, &logits)?, &root)?;
    let (tree, _) = b.download(s)?;
    let n = tree.len();
    let case = format!("depth={depth} vocab={vocab} budget={budget} nodes={n}");
    let f = |v: &[u32]| v.iter().map(|&x| x as f32).collect::<Vec<f32>>();
    // The tree staged as a verify step's inputs: the builder's node count, tokens, positions
    // and mask rows.
    let start = 1000u32;
    let words = b.nodes().div_ceil(32);
    let (mut tokens, mut positions) = (zeros::<u32>(s, n)?, zeros::<u32>(s, n)?);
    let mut mask = zeros::<u32>(s, b.nodes() * words)?;
    b.stage(s, start, n, &mut tokens, &mut positions, &mut mask)?;
    let mut got_stage = vec![b.nodes() as u32];
    got_stage.extend(download(s, &tokens)?);
    got_stage.extend(download(s, &positions)?);
    got_stage.extend(download(s, &mask)?);
    let mut want_stage = vec![n as u32];
    want_stage.extend(&tree.token);
    want_stage.extend(tree.positions(start));
    want_stage.extend(&tree.mask);
    let mut out = vec![exact(
        "tree_stage",
        "tree_stage".into(),
        case.clone(),
        &f(&got_stage),
        &f(&want_stage),
    )];
    // Its top-(m - 1) tree (`auto`'s cut: mask rows re-strided when fewer words) and the
    // path log-probs that choose it.
    let m = (n - n / 3).max(1);
    let mut cut = tree.clone();
    cut.truncate(m);
    let cw = m.div_ceil(32);
    let (mut tokens, mut positions) = (zeros::<u32>(s, m)?, zeros::<u32>(s, m)?);
    let mut mask = zeros::<u32>(s, m * cw)?;
    b.stage(s, start, m, &mut tokens, &mut positions, &mut mask)?;
    let mut got_cut = download(s, &tokens)?;
    got_cut.extend(download(s, &positions)?);
    got_cut.extend(download(s, &mask)?);
    let mut want_cut = cut.token.clone();
    want_cut.extend(cut.positions(start));
    want_cut.extend(&cut.mask);
    out.push(exact(
        "tree_stage",
        "tree_stage (top-(m - 1) cut)".into(),
        format!("{case} cut={m}"),
        &f(&got_cut),
        &f(&want_cut),
    ));
    out.push(exact(
        "tree_build",
        "path log-probs read".into(),
        case.clone(),
        &b.path_logprobs(s)?,
        &tree.path_logprob,
    ));
    // Target logits that mostly agree with the draft's first children, sampled at T = 0.8.
    let mut tl: Vec<f32> = (0..n * vocab).map(|_| rng.random_range(-4.0f32..4.0)).collect();
    for i in 0..n {
        if let Some(&c) = tree.children(i).first() {
            tl[i * vocab + tree.token[c] as usize] = 30.0;
        }
    }
    let (temp, seed) = (0.8f32, rng.random::<u32>());
    let sp = TreeSample::default_params();
    let sk = gpu.compile::<TreeSample>(&sp)?;
    let mut samples = upload(s, &vec![u32::MAX; n])?;
    // SAFETY: logits hold n * vocab values, samples n.
    unsafe {
        TreeSample::launch(
            &sk,
            s,
            n as u32,
            &upload(s, &tl)?,
            &mut samples,
            vocab as u32,
            temp,
            seed,
        )?
    };
    let got_s = download(s, &samples)?;
    let want_s = sample_rows(&tl, vocab, temp, seed);
    out.push(exact(
        "tree_sample",
        TreeSample::symbol(&sp),
        case.clone(),
        &f(&got_s),
        &f(&want_s),
    ));
    let mut a = GpuAccept::new(gpu, depth)?;
    a.accept(s, &b, &samples, &mut root)?;
    let want = accept_reference(&tree, &got_s);
    let read = a.read(s)?;
    let mut got = read.indices;
    got.extend(read.tokens);
    got.push(read.bonus);
    got.push(download(s, &root)?[0]);
    let mut w = want.indices.clone();
    w.extend(&want.tokens);
    w.push(want.bonus);
    w.push(want.bonus);
    out.push(exact(
        "tree_accept",
        "tree_accept".into(),
        case.clone(),
        &f(&got),
        &f(&w),
    ));
    // Compaction: 61 layers, prefix 100, rows of 576.
    let (layers, base) = (61usize, 100usize);
    let cap = base + n;
    let (data, _) = random_bf16(rng, layers * cap * ROW, -1.0, 1.0);
    let mut d = upload(s, &data)?;
    a.compact(s, &mut d, layers, base, ROW, cap * ROW)?;
    let gotc = download(s, &d)?;
    let mut g = Vec::new();
    let mut wv = Vec::new();
    for l in 0..layers {
        for (i, &src) in want.indices.iter().enumerate() {
            g.extend(gotc[(l * cap + base + i) * ROW..][..ROW].iter().map(|x| x.to_f32()));
            wv.extend(
                data[(l * cap + base + src as usize) * ROW..][..ROW]
                    .iter()
                    .map(|x| x.to_f32()),
            );
        }
    }
    out.push(exact("compact_rows", "compact_rows".into(), case.clone(), &g, &wv));
    // Accept on the top-(m - 1) cut (`auto`'s rounds): the walk stays within its m nodes.
    b.truncate(s, m)?;
    let mut a = GpuAccept::new(gpu, depth)?;
    let mut bonus = upload(s, &[u32::MAX])?;
    a.accept(s, &b, &samples, &mut bonus)?;
    let want = accept_reference(&cut, &got_s[..m]);
    let read = a.read(s)?;
    let mut got = read.indices;
    got.extend(read.tokens);
    got.push(download(s, &bonus)?[0]);
    let mut w = want.indices.clone();
    w.extend(&want.tokens);
    w.push(want.bonus);
    out.push(exact(
        "tree_accept",
        "tree_accept (top-(m - 1) cut)".into(),
        format!("{case} cut={m}"),
        &f(&got),
        &f(&w),
    ));
    Ok(out)
}
