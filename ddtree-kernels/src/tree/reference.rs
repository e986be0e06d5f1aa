//! CPU references of the DDTree step: the semantic definition the GPU kernels must match.
//!
//! * Builder: per depth, log-softmax in f32 and the top `K = min(B, V)` tokens (larger logit
//!   first; equal logits: smaller token id first), then the best-first expansion of DDTree to
//!   the best `B` prefixes (the root, the bonus token, is node 0 and is not counted).
//!   A node's score is `score(parent) + logprob(depth, rank)` in f32 (root 0.0), so CPU and GPU
//!   round identically. Order (the tie rule of DESIGN.md): higher score first; equal scores:
//!   lexicographically smaller rank tuple first. Nodes come out in that order, so
//!   `parent < child` and siblings are in rank order.
//! * Accept: walk from the root along the child whose token equals the target's token at the
//!   current node (its argmax, or its sample for temperature > 0).
//! * Verify attention: MLA absorbed form, each (node, head) query attends to the whole prefix
//!   plus the tree rows of its ancestors and itself.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

/// Latent (`c_kv`) dimensions of an MLA cache row; also the attention output width.
pub const LATENT: usize = 512;
/// RoPE (`k_pe`) dimensions of an MLA cache row.
pub const ROPE: usize = 64;
/// Width of one MLA cache row and of one absorbed query: `LATENT + ROPE`.
pub const ROW: usize = LATENT + ROPE;

/// A draft tree for one sequence, in the layout of DESIGN.md. Node 0 is the root (the bonus
/// token); `n = token.len()` nodes in best-first order.
#[derive(Clone, Debug, PartialEq)]
pub struct DraftTree {
    /// Token id per node.
    pub token: Vec<u32>,
    /// Parent index per node (-1 for the root); `parent[i] < i`.
    pub parent: Vec<i32>,
    /// Depth per node (root 0); the position of node `i` is `start + depth[i]`.
    pub depth: Vec<u32>,
    /// First child per node (-1 = none): the child with the best score.
    pub first_child: Vec<i32>,
    /// Next sibling per node (-1 = none), in rank order.
    pub next_sibling: Vec<i32>,
    /// Ancestor-or-self bitmask, `n` rows of `words` u32: bit `j % 32` of word `j / 32` of row
    /// `i` is set iff node `j` is `i` or an ancestor of `i`.
    pub mask: Vec<u32>,
    /// Words per mask row: `ceil(n / 32)`.
    pub words: usize,
    /// Summed log-probability of each node's path (root 0.0).
    pub path_logprob: Vec<f32>,
}

impl DraftTree {
    /// Number of nodes, root included.
    pub fn len(&self) -> usize {
        self.token.len()
    }

    /// Whether the tree is empty (never true for a built tree: it has the root).
    pub fn is_empty(&self) -> bool {
        self.token.is_empty()
    }

    /// Absolute positions `start + depth` (start = the root's position).
    pub fn positions(&self, start: u32) -> Vec<u32> {
        self.depth.iter().map(|d| start + d).collect()
    }

    /// Whether node `i` sees node `j` (j is i or an ancestor of i).
    pub fn visible(&self, i: usize, j: usize) -> bool {
        self.mask[i * self.words + j / 32] >> (j % 32) & 1 == 1
    }

    /// The children of node `i`, in rank order.
    pub fn children(&self, i: usize) -> Vec<usize> {
        let mut out = Vec::new();
        let mut c = self.first_child[i];
        while c >= 0 {
            out.push(c as usize);
            c = self.next_sibling[c as usize];
        }
        out
    }

    /// Keeps the first `n` nodes (root included; `n >= 1`, no-op when `n >= len`).
    ///
    /// The builder emits nodes best first and every parent before its children, so the first
    /// `n` nodes are a prefix-closed tree; for a tree from [`expand`] they are exactly the tree
    /// the builder gives at budget `n - 1` (a node of rank `r` needs its `r` better siblings
    /// before it, so the first `n - 1` pops never use a rank `>= n - 1`, and `K = min(B, V)`
    /// does not change them). Links to dropped nodes become -1 (children and later siblings
    /// have larger indices than their first sibling), and the mask rows are cut to
    /// `ceil(n / 32)` words (a kept node's ancestors are kept nodes).
    pub fn truncate(&mut self, n: usize) {
        assert!(n >= 1, "a tree keeps at least its root");
        let old = self.len();
        if n >= old {
            return;
        }
        self.token.truncate(n);
        self.parent.truncate(n);
        self.depth.truncate(n);
        self.path_logprob.truncate(n);
        for links in [&mut self.first_child, &mut self.next_sibling] {
            links.truncate(n);
            for l in links.iter_mut() {
                if *l >= n as i32 {
                    *l = -1;
                }
            }
        }
        let words = n.div_ceil(32);
        let mut mask = Vec::with_capacity(n * words);
        for row in self.mask.chunks(self.words).take(n) {
            mask.extend_from_slice(&row[..words]);
        }
        self.mask = mask;
        self.words = words;
    }
}

/// Per-depth top-K of the drafter distribution: `[depth][k]` log-probs and token ids, best
/// first.
#[derive(Clone, Debug, PartialEq)]
pub struct DepthTopk {
    /// Entries per depth.
    pub k: usize,
    /// Log-probabilities `[depth * k]`, non-increasing per depth, all `<= 0`.
    pub logprob: Vec<f32>,
    /// Token ids `[depth * k]`.
    pub token: Vec<u32>,
}

/// The order key of an f32: `a < b` as floats iff `key(a) < key(b)` (with -0.0 < +0.0).
pub fn order_key(x: f32) -> u32 {
    let b = x.to_bits();
    if b >> 31 == 1 {
        !b
    } else {
        b | 0x8000_0000
    }
}

/// Log-sum-exp of each row of `logits` (`[rows, vocab]`), accumulated in f64.
pub fn logsumexp_rows(logits: &[f32], vocab: usize) -> Vec<f32> {
    logits
        .chunks(vocab)
        .map(|row| {
            let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let s: f64 = row.iter().map(|&x| ((x - m) as f64).exp()).sum();
            m + s.ln() as f32
        })
        .collect()
}

/// The log-prob of logit `x` in a row with log-sum-exp `lse`: `min(x - lse, 0)` in f32.
pub fn logprob(x: f32, lse: f32) -> f32 {
    (x - lse).min(0.0)
}

/// Per-depth top-`k` (`logits` is `[depth, vocab]`, `lse` one value per depth): larger logit
/// first, equal logits by smaller token id. Logits must not be NaN.
pub fn depth_topk(logits: &[f32], vocab: usize, k: usize, lse: &[f32]) -> DepthTopk {
    let mut logprob = Vec::new();
    let mut token = Vec::new();
    for (row, &l) in logits.chunks(vocab).zip(lse) {
        let mut idx: Vec<u32> = (0..vocab as u32).collect();
        idx.sort_by(|&a, &b| {
            order_key(row[b as usize])
                .cmp(&order_key(row[a as usize]))
                .then(a.cmp(&b))
        });
        for &i in &idx[..k] {
            logprob.push(self::logprob(row[i as usize], l));
            token.push(i);
        }
    }
    DepthTopk { k, logprob, token }
}

/// A heap entry: a rank tuple (its last rank is `rank`), with the emitted parent node.
#[derive(Clone, Debug)]
struct Entry {
    score: f32,
    ranks: Vec<u32>,
    parent: usize,
    prev_sibling: Option<usize>,
}

/// The tie rule: `Greater` = better (popped first).
fn better(a_score: f32, a_ranks: &[u32], b_score: f32, b_ranks: &[u32]) -> Ordering {
    a_score
        .partial_cmp(&b_score)
        .expect("scores are never NaN")
        .then_with(|| b_ranks.cmp(a_ranks))
}

impl PartialEq for Entry {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}
impl Eq for Entry {}
impl PartialOrd for Entry {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Entry {
    fn cmp(&self, o: &Self) -> Ordering {
        better(self.score, &self.ranks, o.score, &o.ranks)
    }
}

/// Best-first expansion (DDTree Alg. 1) over per-depth top-K lists to at most `budget` nodes
/// besides the root `root_token`. Depth `L = topk.logprob.len() / topk.k`.
pub fn expand(topk: &DepthTopk, budget: usize, root_token: u32) -> DraftTree {
    let k = topk.k;
    let depths = topk.logprob.len().checked_div(k).unwrap_or(0);
    let mut t = DraftTree {
        token: vec![root_token],
        parent: vec![-1],
        depth: vec![0],
        first_child: vec![-1],
        next_sibling: vec![-1],
        mask: Vec::new(),
        words: 0,
        path_logprob: vec![0.0],
    };
    let mut heap = BinaryHeap::new();
    if depths > 0 && budget > 0 {
        heap.push(Entry {
            score: topk.logprob[0],
            ranks: vec![0],
            parent: 0,
            prev_sibling: None,
        });
    }
    while t.len() <= budget {
        let Some(e) = heap.pop() else { break };
        let node = t.len();
        let d = e.ranks.len();
        let r = *e.ranks.last().expect("entries have a rank") as usize;
        t.token.push(topk.token[(d - 1) * k + r]);
        t.parent.push(e.parent as i32);
        t.depth.push(d as u32);
        t.first_child.push(-1);
        t.next_sibling.push(-1);
        t.path_logprob.push(e.score);
        match e.prev_sibling {
            Some(p) => t.next_sibling[p] = node as i32,
            None => t.first_child[e.parent] = node as i32,
        }
        let parent_score = t.path_logprob[e.parent];
        if r + 1 < k {
            let mut ranks = e.ranks.clone();
            *ranks.last_mut().expect("non-empty") += 1;
            let score = parent_score + topk.logprob[(d - 1) * k + r + 1];
            heap.push(Entry {
                score,
                ranks,
                parent: e.parent,
                prev_sibling: Some(node),
            });
        }
        if d < depths {
            let mut ranks = e.ranks.clone();
            ranks.push(0);
            let score = e.score + topk.logprob[d * k];
            heap.push(Entry {
                score,
                ranks,
                parent: node,
                prev_sibling: None,
            });
        }
    }
    fill_mask(&mut t);
    t
}

/// Fills `mask` and `words` from `parent`.
pub fn fill_mask(t: &mut DraftTree) {
    let n = t.len();
    t.words = n.div_ceil(32);
    t.mask = vec![0; n * t.words];
    for i in 0..n {
        let mut j = i as i32;
        while j >= 0 {
            t.mask[i * t.words + j as usize / 32] |= 1 << (j as usize % 32);
            j = t.parent[j as usize];
        }
    }
}

/// The node count (root included) of the tree [`build_reference`] (and the GPU builder, which
/// equals it) builds for `depth` positions over `vocab` tokens at `budget`: the root plus
/// `min(budget, K + K^2 + .. + K^depth)` prefixes, `K = min(budget, vocab)` (the expansion stops
/// only at the budget or when every prefix of the per-depth top-K is taken). Known without
/// looking at the logits, so a host can size the verify step of a tree that stays on the GPU.
pub fn tree_size(depth: usize, vocab: usize, budget: usize) -> usize {
    let k = budget.min(vocab);
    let (mut prefixes, mut level) = (0usize, 1usize);
    for _ in 0..depth {
        if prefixes >= budget {
            break;
        }
        level = level.saturating_mul(k);
        prefixes = prefixes.saturating_add(level);
    }
    1 + prefixes.min(budget)
}

/// The CPU reference builder: `logits` is the drafter's `[depth, vocab]` logits for the `L`
/// future positions, `budget` the node budget B (root not counted), `root_token` the bonus
/// token. Uses [`logsumexp_rows`] for the log-softmax; [`build_with_lse`] takes the per-depth
/// log-sum-exp from elsewhere (e.g. the GPU) so trees can be compared bit for bit.
pub fn build_reference(logits: &[f32], depth: usize, vocab: usize, budget: usize, root_token: u32) -> DraftTree {
    assert_eq!(logits.len(), depth * vocab, "logits must be [depth, vocab]");
    build_with_lse(logits, vocab, budget, root_token, &logsumexp_rows(logits, vocab))
}

/// [`build_reference`] with given per-depth log-sum-exp values.
pub fn build_with_lse(logits: &[f32], vocab: usize, budget: usize, root_token: u32, lse: &[f32]) -> DraftTree {
    let k = budget.min(vocab);
    expand(&depth_topk(logits, vocab, k, lse), budget, root_token)
}

/// The result of acceptance (DESIGN.md): accepted node indices (root first), the target's token
/// at each of them, and the next bonus token. The accepted length (root included) is
/// `indices.len()`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Acceptance {
    /// Accepted node indices, root first, increasing.
    pub indices: Vec<u32>,
    /// The target's token at each accepted node, in the same order: the tokens a round emits.
    /// Entry `k < len - 1` is the token of accepted node `k + 1` (the accept rule); the last is
    /// the bonus.
    pub tokens: Vec<u32>,
    /// The target's token at the last accepted node: the next round's root.
    pub bonus: u32,
}

/// The CPU reference accept: `target[i]` is the target's token at node `i` (its argmax for
/// greedy decoding, its sample for temperature > 0). Walks from the root along the child whose
/// token equals the current node's target token.
pub fn accept_reference(tree: &DraftTree, target: &[u32]) -> Acceptance {
    let mut cur = 0usize;
    let mut indices = vec![0u32];
    'walk: loop {
        let want = target[cur];
        for c in tree.children(cur) {
            if tree.token[c] == want {
                indices.push(c as u32);
                cur = c;
                continue 'walk;
            }
        }
        break;
    }
    Acceptance {
        tokens: indices.iter().map(|&i| target[i as usize]).collect(),
        indices,
        bonus: target[cur],
    }
}

/// Argmax per row of `logits` (`[rows, vocab]`); equal values: smaller id.
pub fn argmax_rows(logits: &[f32], vocab: usize) -> Vec<u32> {
    logits
        .chunks(vocab)
        .map(|row| {
            let mut best = 0usize;
            for (i, &x) in row.iter().enumerate() {
                if order_key(x) > order_key(row[best]) {
                    best = i;
                }
            }
            best as u32
        })
        .collect()
}

/// The murmur3 32-bit finalizer.
pub fn fmix32(mut h: u32) -> u32 {
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^= h >> 13;
    h = h.wrapping_mul(0xc2b2_ae35);
    h ^ (h >> 16)
}

/// The counter-based uniform in (0, 1) used for sampling node `row`, token `token`, step `seed`.
pub fn uniform(seed: u32, row: u32, token: u32) -> f32 {
    let h = fmix32(fmix32(fmix32(token) ^ row.wrapping_mul(0x9e37_79b9)) ^ seed);
    ((h >> 8) as f32 + 0.5) * (1.0 / 16_777_216.0)
}

/// The sampling score of logit `x`: `x / temperature + Gumbel noise`; the token with the
/// largest score is an exact sample of `softmax(logits / temperature)` (Gumbel-max).
pub fn gumbel_score(x: f32, temperature: f32, seed: u32, row: u32, token: u32) -> f32 {
    let u = uniform(seed, row, token);
    x / temperature - (-u.ln()).ln()
}

/// One sample per row of `logits` (`[rows, vocab]`) at `temperature > 0` with seed `seed`
/// (Gumbel-max with [`uniform`]; equal scores: smaller id). Feed the result to
/// [`accept_reference`] for the lossless sampling accept.
pub fn sample_rows(logits: &[f32], vocab: usize, temperature: f32, seed: u32) -> Vec<u32> {
    logits
        .chunks(vocab)
        .enumerate()
        .map(|(r, row)| {
            let mut best = (f32::NEG_INFINITY, 0u32);
            for (i, &x) in row.iter().enumerate() {
                let g = gumbel_score(x, temperature, seed, r as u32, i as u32);
                if order_key(g) > order_key(best.0) {
                    best = (g, i as u32);
                }
            }
            best.1
        })
        .collect()
}

/// A chain mask of `n` nodes (node `i` sees `0..=i`): the causal decode (n = 1) and
/// prefill-chunk case of the verify attention. Returns (mask, words).
pub fn chain_mask(n: usize) -> (Vec<u32>, usize) {
    let words = n.div_ceil(32).max(1);
    let mut mask = vec![0u32; n * words];
    for i in 0..n {
        for j in 0..=i {
            mask[i * words + j / 32] |= 1 << (j % 32);
        }
    }
    (mask, words)
}

/// Tree-verify attention in MLA absorbed form, in f64.
///
/// `q` is `[nodes, heads, ROW]`; `cache` is `[prefix + nodes, ROW]` (node `t`'s own row at
/// `prefix + t`); `mask` is `[nodes, words]` (ancestor-or-self bits). Row `(i, h)` attends to
/// every prefix row and to the tree rows visible to node `i`, with scores `scale * q . row`;
/// the value is the row's first `LATENT` entries. Returns (`[nodes, heads, LATENT]`,
/// `[nodes, heads]` natural-log log-sum-exp of the scaled scores).
#[allow(clippy::too_many_arguments)]
pub fn verify_attention_reference(
    q: &[f32],
    cache: &[f32],
    mask: &[u32],
    words: usize,
    nodes: usize,
    heads: usize,
    prefix: usize,
    scale: f32,
) -> (Vec<f32>, Vec<f32>) {
    let mut out = vec![0f32; nodes * heads * LATENT];
    let mut lse = vec![0f32; nodes * heads];
    for i in 0..nodes {
        let keys: Vec<usize> = (0..prefix)
            .chain(
                (0..nodes)
                    .filter(|&t| mask[i * words + t / 32] >> (t % 32) & 1 == 1)
                    .map(|t| prefix + t),
            )
            .collect();
        for h in 0..heads {
            let qr = &q[(i * heads + h) * ROW..][..ROW];
            let s: Vec<f64> = keys
                .iter()
                .map(|&j| {
                    scale as f64
                        * qr.iter()
                            .zip(&cache[j * ROW..][..ROW])
                            .map(|(a, b)| *a as f64 * *b as f64)
                            .sum::<f64>()
                })
                .collect();
            let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let p: Vec<f64> = s.iter().map(|v| (v - m).exp()).collect();
            let l: f64 = p.iter().sum();
            let mut o = vec![0f64; LATENT];
            for (pj, &j) in p.iter().zip(&keys) {
                for (oc, v) in o.iter_mut().zip(&cache[j * ROW..][..LATENT]) {
                    *oc += pj / l * *v as f64;
                }
            }
            for (dst, v) in out[(i * heads + h) * LATENT..][..LATENT].iter_mut().zip(o) {
                *dst = v as f32;
            }
            lse[i * heads + h] = (m + l.ln()) as f32;
        }
    }
    (out, lse)
}

/// The split-KV merge in f64: row `r` of the output is the sum over splits `s` of
/// `exp(lse[s, r] - m) part[s, r]` divided by the sum of the weights, `m` the row's largest
/// split log-sum-exp, and its log-sum-exp is `m + ln(sum of weights)`. `part` is `[splits,
/// rows, 512]`, `lse` `[splits, rows]`; a split at `-inf` saw no key and its partial is not read
/// (it may be anything, NaN included). A row whose splits are all `-inf` merges to zeros and
/// `-inf`.
pub fn combine_reference(part: &[f32], lse: &[f32], rows: usize, splits: usize) -> (Vec<f32>, Vec<f32>) {
    let mut out = vec![0f32; rows * LATENT];
    let mut out_lse = vec![f32::NEG_INFINITY; rows];
    for r in 0..rows {
        let live: Vec<usize> = (0..splits)
            .filter(|&s| lse[s * rows + r] != f32::NEG_INFINITY)
            .collect();
        let m = live
            .iter()
            .map(|&s| lse[s * rows + r] as f64)
            .fold(f64::NEG_INFINITY, f64::max);
        if live.is_empty() {
            continue;
        }
        let w: Vec<f64> = live.iter().map(|&s| (lse[s * rows + r] as f64 - m).exp()).collect();
        let l: f64 = w.iter().sum();
        for (c, dst) in out[r * LATENT..][..LATENT].iter_mut().enumerate() {
            let sum: f64 = live
                .iter()
                .zip(&w)
                .map(|(&s, wi)| wi * part[(s * rows + r) * LATENT + c] as f64)
                .sum();
            *dst = (sum / l) as f32;
        }
        out_lse[r] = (m + l.ln()) as f32;
    }
    (out, out_lse)
}
