//! Ancestor-or-self bitmasks for tree attention.

use crate::error::{EngineError, Result};

/// Which of `n` new tokens each new token may attend to: row `i` has bit `j` set iff node `j` is
/// an ancestor of node `i` or `i` itself.
///
/// Layout (shared with the GPU kernels): `n` rows of `ceil(n / 32)` `u32` words; bit `j % 32` of
/// word `j / 32`. Nodes are topologically ordered (a parent's index is below its children's), so
/// only bits `j <= i` can be set. A chain (plain causal decoding) is the mask with every `j <= i`
/// set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AncestorMask {
    n: usize,
    words_per_row: usize,
    words: Vec<u32>,
}

impl AncestorMask {
    /// The mask of a chain of `n` tokens (causal attention).
    pub fn causal(n: usize) -> Self {
        let parents: Vec<i32> = (0..n as i32).map(|i| i - 1).collect();
        Self::build(&parents)
    }

    /// Builds the mask of a tree given each node's parent (`-1` for the root, node 0).
    pub fn from_parents(parents: &[i32]) -> Result<Self> {
        for (i, &p) in parents.iter().enumerate() {
            let ok = if i == 0 { p == -1 } else { p >= 0 && (p as usize) < i };
            if !ok {
                return Err(EngineError::Forward(format!(
                    "tree parent[{i}] = {p}: node 0 must be the root (-1) and every other node's \
                     parent must be an earlier node"
                )));
            }
        }
        Ok(Self::build(parents))
    }

    /// Wraps raw mask words, checking the layout: `n * ceil(n/32)` words, every diagonal bit set
    /// and no bit above the diagonal.
    pub fn from_words(n: usize, words: Vec<u32>) -> Result<Self> {
        let words_per_row = n.div_ceil(32);
        if words.len() != n * words_per_row {
            return Err(EngineError::Forward(format!(
                "ancestor mask for {n} nodes needs {} words, got {}",
                n * words_per_row,
                words.len()
            )));
        }
        let mask = Self {
            n,
            words_per_row,
            words,
        };
        for i in 0..n {
            if !mask.get(i, i) {
                return Err(EngineError::Forward(format!("ancestor mask row {i} lacks its own bit")));
            }
            if let Some(j) = (i + 1..words_per_row * 32).find(|&j| mask.bit(i, j)) {
                return Err(EngineError::Forward(format!(
                    "ancestor mask row {i} has bit {j} set: a node can only see earlier nodes"
                )));
            }
        }
        Ok(mask)
    }

    fn build(parents: &[i32]) -> Self {
        let n = parents.len();
        let words_per_row = n.div_ceil(32);
        let mut words = vec![0u32; n * words_per_row];
        for i in 0..n {
            if let Ok(p) = usize::try_from(parents[i]) {
                words.copy_within(p * words_per_row..(p + 1) * words_per_row, i * words_per_row);
            }
            words[i * words_per_row + i / 32] |= 1 << (i % 32);
        }
        Self {
            n,
            words_per_row,
            words,
        }
    }

    fn bit(&self, i: usize, j: usize) -> bool {
        self.words[i * self.words_per_row + j / 32] >> (j % 32) & 1 == 1
    }

    /// Number of nodes.
    pub fn len(&self) -> usize {
        self.n
    }

    /// Whether the mask has no nodes.
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// Whether node `i` may attend to node `j`.
    pub fn get(&self, i: usize, j: usize) -> bool {
        j < self.n && self.bit(i, j)
    }

    /// The raw words, `n` rows of [`AncestorMask::words_per_row`] words.
    pub fn words(&self) -> &[u32] {
        &self.words
    }

    /// `ceil(n / 32)`.
    pub fn words_per_row(&self) -> usize {
        self.words_per_row
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tree_mask_marks_ancestors_only() {
        // 0 -> 1 -> 3, 0 -> 2
        let m = AncestorMask::from_parents(&[-1, 0, 0, 1]).unwrap();
        let seen: Vec<Vec<usize>> = (0..4).map(|i| (0..4).filter(|&j| m.get(i, j)).collect()).collect();
        assert_eq!(seen, vec![vec![0], vec![0, 1], vec![0, 2], vec![0, 1, 3]]);
        assert_eq!(AncestorMask::from_words(4, m.words().to_vec()).unwrap(), m);
    }

    #[test]
    fn causal_mask_spans_word_boundaries() {
        let m = AncestorMask::causal(40);
        assert_eq!(m.words_per_row(), 2);
        assert!(m.get(39, 0) && m.get(39, 33) && m.get(33, 33) && !m.get(33, 34));
    }

    #[test]
    fn bad_masks_are_rejected() {
        assert!(AncestorMask::from_parents(&[-1, 1]).is_err());
        assert!(AncestorMask::from_parents(&[0]).is_err());
        assert!(AncestorMask::from_words(2, vec![0b01, 0b11, 0]).is_err());
        assert!(AncestorMask::from_words(2, vec![0b11, 0b11]).is_err());
        assert!(AncestorMask::from_words(2, vec![0b01, 0b01]).is_err());
        assert!(AncestorMask::from_words(2, vec![0b01, 0b10]).is_ok());
    }
}
