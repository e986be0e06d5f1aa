//! Teacher-forced comparisons of two models' logits on the tiny fixtures, shared by the GPU tests
//! and the CPU bf16-mirror tests.

use std::path::{Path, PathBuf};

use ddtree_engine::{generate_plain, Backend, ForwardInput, GenerateOptions, LoadOptions, LogitRows, Model};

/// The fixture directory `name` under `tests/fixtures`.
pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

/// The fixture `name` loaded on `b`.
pub fn load<B: Backend>(b: B, name: &str) -> Model<B> {
    Model::load_dir(b, &fixture(name), LoadOptions::default(), &mut |_, _| {}).unwrap()
}

/// The index of the largest value (the first among equal maxima).
fn argmax(row: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best
}

/// Teacher-forced logits of `tokens`: one prefill over the first half, then one token at a
/// time (both the chain-masked many-row path and the decode path).
pub fn teacher_forced<B: Backend>(m: &Model<B>, tokens: &[u32]) -> Vec<Vec<f32>> {
    let mut cache = m.new_cache(tokens.len() + 1).unwrap();
    let half = tokens.len() / 2;
    let mut rows = Vec::new();
    let mut run = |from: usize, to: usize, cache: &mut B::KvCache| {
        let positions: Vec<u32> = (from as u32..to as u32).collect();
        let input = ForwardInput {
            tokens: &tokens[from..to],
            positions: &positions,
            mask: None,
            logits: LogitRows::All,
        };
        let logits = m.backend().to_host(&m.forward(cache, input).unwrap()).unwrap();
        for r in 0..logits.rows {
            rows.push(logits.row(r).to_vec());
        }
    };
    run(0, half, &mut cache);
    for t in half..tokens.len() {
        run(t, t + 1, &mut cache);
    }
    rows
}

/// The sequences the comparisons run: one `model` itself finds likely (a prompt and its greedy
/// continuation) and three scrambled ones (vocab 512).
pub fn sequences<B: Backend>(model: &Model<B>) -> Vec<Vec<u32>> {
    let opts = GenerateOptions {
        max_new_tokens: 40,
        ..GenerateOptions::default()
    };
    let prompt = [5u32, 17, 300, 2];
    let greedy = generate_plain(model, &prompt, &opts).unwrap().tokens;
    let mut seqs = vec![prompt.iter().chain(&greedy).copied().collect::<Vec<u32>>()];
    for (mul, add) in [(193u32, 11u32), (71, 5), (389, 200)] {
        seqs.push((0..40u32).map(|i| (i * mul + add) % 512).collect());
    }
    seqs
}

/// Teacher-forced top-1 agreement of a model against a reference, and the largest logit error.
#[derive(Debug, Default)]
pub struct Agreement {
    /// Rows whose argmax matches the reference's.
    pub agree: usize,
    /// Rows compared.
    pub total: usize,
    /// The largest `|logit - reference logit|`.
    pub max_err: f32,
    /// The largest `|reference logit|`, for scale.
    pub max_abs: f32,
}

impl Agreement {
    /// Adds the rows of one sequence of `seq_len` tokens: `want` the reference's logits, `got`
    /// the model's. Prints each row whose top-1 differs with the reference's own top-2 margin (a
    /// flip on a near tie is precision); `label` names the comparison in those lines.
    pub fn add(&mut self, label: &str, seq_len: usize, want: &[Vec<f32>], got: &[Vec<f32>]) {
        assert_eq!(want.len(), got.len(), "{label}: row counts differ");
        for (r, (w, g)) in want.iter().zip(got).enumerate() {
            assert!(g.iter().all(|v| v.is_finite()), "{label}: non-finite logits");
            self.total += 1;
            let same = argmax(w) == argmax(g);
            self.agree += usize::from(same);
            if !same {
                let mut sorted = w.clone();
                sorted.sort_by(|a, b| b.total_cmp(a));
                let path = if r < seq_len / 2 { "prefill" } else { "decode" };
                eprintln!(
                    "{label}: row {r} ({path}) differs: reference top-2 margin {:.4}, model picks reference rank {}",
                    sorted[0] - sorted[1],
                    sorted.iter().position(|&v| v == w[argmax(g)]).unwrap_or(usize::MAX)
                );
            }
            for (a, b) in w.iter().zip(g) {
                self.max_err = self.max_err.max((a - b).abs());
                self.max_abs = self.max_abs.max(a.abs());
            }
        }
    }

    /// The fraction of rows that agree.
    pub fn rate(&self) -> f64 {
        self.agree as f64 / self.total as f64
    }

    /// `label: top-1 agreement a/n = p%, max |logit error| e (max |logit| m)`.
    pub fn line(&self, label: &str) -> String {
        format!(
            "{label}: teacher-forced top-1 agreement {}/{} = {:.1}%, max |logit error| {:.4} (max |logit| {:.2})",
            self.agree,
            self.total,
            100.0 * self.rate(),
            self.max_err,
            self.max_abs
        )
    }
}
