//! The drafter interface of the speculative loop.

use crate::backend::Backend;
use crate::error::Result;
use crate::model::Model;

/// What a drafter gets each round.
#[derive(Debug, Clone, Copy)]
pub struct DraftRequest<'a, T> {
    /// Every committed token: the prompt, the generated tokens, and last the bonus token (chosen
    /// by the target but not yet run through it). The bonus sits at position `tokens.len() - 1`.
    pub tokens: &'a [u32],
    /// The target's hidden features (at [`Drafter::target_layers`], concatenated) of the tokens
    /// committed since the previous request: the rows just before the bonus, in order. `None`
    /// when the drafter asks for no layers.
    pub features: Option<&'a T>,
}

/// Proposes, once per round, a distribution for each of the next `block_size - 1` positions after
/// the bonus token. The loop builds the draft tree from them.
pub trait Drafter<B: Backend> {
    /// A short description for reports (`"oracle"`, `"noisy:0.7"`, the drafter's directory).
    fn name(&self) -> String;
    /// Block size: the bonus slot plus the `block_size - 1` drafted positions (>= 2).
    fn block_size(&self) -> usize;
    /// Target decoder layers whose hidden states the drafter consumes (empty for none).
    fn target_layers(&self) -> &[usize];
    /// Starts a new sequence whose positions stay below `capacity`, dropping all state.
    fn begin(&mut self, target: &Model<B>, capacity: usize) -> Result<()>;
    /// Logits `[block_size - 1, vocab]` for the positions after the bonus token.
    fn draft(&mut self, target: &Model<B>, request: DraftRequest<'_, B::Tensor>) -> Result<B::Tensor>;
}
