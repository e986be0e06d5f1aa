//! Drafters that measure the engine independent of drafter quality.
//!
//! - [`Oracle`]: the target's own greedy continuation, computed by the engine with a second
//!   latent cache, its tokens made near-certain so the tree always holds the greedy chain (the
//!   upper bound: with a budget of at least `block_size - 1`, every greedy round accepts the
//!   whole block);
//! - [`Noisy`]: the oracle, with each position's top token kept with probability `P` and
//!   otherwise swapped with a lower-ranked token, so the drafted distribution keeps the target's
//!   spread of probability mass but its argmax is wrong at a controlled rate.

use ddtree_kernels::tree::reference::uniform;

use crate::backend::{Backend, Matrix};
use crate::error::{EngineError, Result};
use crate::model::{ForwardInput, LogitRows, Model};
use crate::spec::drafter::{DraftRequest, Drafter};
use crate::spec::sampling::argmax;

/// How many lower-ranked tokens [`Noisy`] picks its replacement from.
const NOISY_SWAP_RANKS: usize = 8;
/// How far [`Oracle`] lifts the greedy token's logit above the rest (probability >= 1 - V e^-20).
const ORACLE_MARGIN: f32 = 20.0;

/// The target's greedy continuation as a drafter.
pub struct Oracle<B: Backend> {
    block_size: usize,
    cache: Option<B::KvCache>,
    /// Tokens in `cache`, one per position.
    seq: Vec<u32>,
    /// `rows[i]`: the target's logits after `seq[first + i]`; `first + rows.len() == seq.len()`.
    rows: Vec<Vec<f32>>,
    first: usize,
}

impl<B: Backend> Oracle<B> {
    /// An oracle drafting `block_size - 1` positions per round.
    pub fn new(block_size: usize) -> Result<Self> {
        check_block_size(block_size)?;
        Ok(Self {
            block_size,
            cache: None,
            seq: Vec::new(),
            rows: Vec::new(),
            first: 0,
        })
    }

    fn feed(&mut self, target: &Model<B>, tokens: &[u32]) -> Result<()> {
        let cache = self
            .cache
            .as_mut()
            .ok_or_else(|| EngineError::Forward("oracle drafter used before begin()".into()))?;
        let start = self.seq.len() as u32;
        let positions: Vec<u32> = (start..start + tokens.len() as u32).collect();
        let input = ForwardInput {
            tokens,
            positions: &positions,
            mask: None,
            logits: LogitRows::All,
        };
        let logits = target.backend().to_host(&target.forward(cache, input)?)?;
        self.seq.extend_from_slice(tokens);
        self.rows.extend((0..logits.rows).map(|r| logits.row(r).to_vec()));
        Ok(())
    }

    /// The target's own logits at the `block_size - 1` positions after the bonus token along its
    /// greedy continuation, on the host.
    pub fn target_logits(&mut self, target: &Model<B>, tokens: &[u32]) -> Result<Matrix> {
        let Some(bonus_position) = tokens.len().checked_sub(1) else {
            return Err(EngineError::Forward("draft request without tokens".into()));
        };
        let b = target.backend();
        let cache = self
            .cache
            .as_mut()
            .ok_or_else(|| EngineError::Forward("oracle drafter used before begin()".into()))?;
        // Keep what the cache already holds of `tokens` (all of it while the guesses are right).
        let common = self.seq.iter().zip(tokens).take_while(|(a, b)| a == b).count();
        b.kv_truncate(cache, common)?;
        self.seq.truncate(common);
        if common > self.first {
            self.rows.truncate(common - self.first);
        } else {
            self.rows.clear();
            self.first = common;
        }
        if common < tokens.len() {
            self.feed(target, &tokens[common..])?;
        }
        let depth = self.block_size - 1;
        let context = target.config().max_position_embeddings;
        while self.seq.len() < bonus_position + depth && self.seq.len() < context {
            let next = argmax(self.rows.last().expect("the bonus row exists"));
            self.feed(target, &[next])?;
        }
        let vocab = target.config().vocab_size;
        let mut out = Matrix::zeros(depth, vocab);
        for i in 0..depth {
            // Past the context the loop never uses the rows; repeat the last one.
            let r = (bonus_position + i - self.first).min(self.rows.len() - 1);
            out.row_mut(i).copy_from_slice(&self.rows[r]);
        }
        self.rows.drain(..bonus_position - self.first);
        self.first = bonus_position;
        Ok(out)
    }
}

fn check_block_size(block_size: usize) -> Result<()> {
    if block_size < 2 {
        return Err(EngineError::Forward(format!(
            "block size must be at least 2 (the bonus slot and one drafted position), got {block_size}"
        )));
    }
    Ok(())
}

impl<B: Backend> Drafter<B> for Oracle<B> {
    fn name(&self) -> String {
        "oracle".into()
    }

    fn block_size(&self) -> usize {
        self.block_size
    }

    fn target_layers(&self) -> &[usize] {
        &[]
    }

    fn begin(&mut self, target: &Model<B>, capacity: usize) -> Result<()> {
        self.cache = Some(target.new_cache(capacity)?);
        self.seq.clear();
        self.rows.clear();
        self.first = 0;
        Ok(())
    }

    fn draft(&mut self, target: &Model<B>, request: DraftRequest<'_, B::Tensor>) -> Result<B::Tensor> {
        let mut host = self.target_logits(target, request.tokens)?;
        for i in 0..host.rows {
            let row = host.row_mut(i);
            let top = argmax(row) as usize;
            row[top] += ORACLE_MARGIN;
        }
        target.backend().load_logits(host)
    }
}

/// The target's logits along the oracle's greedy continuation, with the top token kept at each
/// position with probability `keep`.
///
/// Otherwise the top token's logit is swapped with that of a token of rank 1..=8 (uniformly), so
/// the drafted argmax is wrong but the oracle token stays in the distribution at a lower rank,
/// where a wide enough tree still finds it. The choice is a deterministic function of
/// `(seed, position)`.
pub struct Noisy<B: Backend> {
    oracle: Oracle<B>,
    keep: f32,
    seed: u32,
}

impl<B: Backend> Noisy<B> {
    /// A noisy oracle; `keep` must be in `[0, 1]`.
    pub fn new(block_size: usize, keep: f32, seed: u32) -> Result<Self> {
        if !(0.0..=1.0).contains(&keep) {
            return Err(EngineError::Forward(format!(
                "noisy drafter: the keep probability must be in [0, 1], got {keep}"
            )));
        }
        Ok(Self {
            oracle: Oracle::new(block_size)?,
            keep,
            seed,
        })
    }
}

impl<B: Backend> Drafter<B> for Noisy<B> {
    fn name(&self) -> String {
        format!("noisy:{}", self.keep)
    }

    fn block_size(&self) -> usize {
        self.oracle.block_size
    }

    fn target_layers(&self) -> &[usize] {
        &[]
    }

    fn begin(&mut self, target: &Model<B>, capacity: usize) -> Result<()> {
        self.oracle.begin(target, capacity)
    }

    fn draft(&mut self, target: &Model<B>, request: DraftRequest<'_, B::Tensor>) -> Result<B::Tensor> {
        let mut host = self.oracle.target_logits(target, request.tokens)?;
        let first_position = request.tokens.len() as u32;
        for i in 0..host.rows {
            let position = first_position + i as u32;
            if uniform(self.seed, position, 0) < self.keep {
                continue;
            }
            let row = host.row_mut(i);
            let mut order: Vec<usize> = (0..row.len()).collect();
            order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
            let ranks = NOISY_SWAP_RANKS.min(row.len() - 1);
            if ranks == 0 {
                continue;
            }
            let rank = 1 + ((uniform(self.seed, position, 1) * ranks as f32) as usize).min(ranks - 1);
            row.swap(order[0], order[rank]);
            if row[order[0]] == row[order[rank]] {
                // Equal logits: make the replacement the strict argmax.
                row[order[rank]] += 1.0;
            }
        }
        target.backend().load_logits(host)
    }
}
