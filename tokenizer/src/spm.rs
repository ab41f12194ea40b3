//! SentencePiece tokenization from a vocabulary with scores (`tokenizer.ggml.model = llama`), as
//! llama.cpp runs it: a piece of text becomes its UTF-8 characters, then the adjacent pair whose
//! concatenation is the highest-scoring token is merged (the leftmost among equals) until no
//! pair is a token; a character that is no token falls back to its bytes' `<0xXX>` tokens.
//!
//! Written by hand because the `tokenizers` crate can express this model only as BPE with merges
//! derived from the scores (every split of every token into two tokens: over a million for a
//! 262k vocabulary, held by the router too), where the algorithm itself is this one loop.

use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::hash::{BuildHasher, RandomState};

use hashbrown::HashTable;
use hashbrown::hash_table::Entry;

use crate::pieces::Pieces;

/// The SentencePiece word boundary, which stands for a space.
pub(crate) const SPACE: char = '\u{2581}';

#[derive(Debug)]
pub(crate) struct Spm {
    /// Each token's text.
    pub(crate) texts: Pieces<String>,
    /// Token ids, found by their text (the last id of a text given twice).
    ids: HashTable<u32>,
    hasher: RandomState,
    pub(crate) scores: Vec<f32>,
    /// The `<0xXX>` token of each byte, where the vocabulary has it.
    byte_ids: [Option<u32>; 256],
    add_space_prefix: bool,
}

/// A candidate merge of symbols `left` and its right neighbour.
#[derive(Debug, PartialEq)]
struct Bigram {
    score: f32,
    left: usize,
    /// The merged text's length in bytes, to recognise a candidate made stale by other merges.
    len: usize,
}

impl Eq for Bigram {}

impl Ord for Bigram {
    /// Highest score first, then leftmost.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then(other.left.cmp(&self.left))
    }
}

impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// A run of the text: `start..start + len`, linked to its neighbours (`usize::MAX`: none).
#[derive(Clone, Copy, Debug)]
struct Symbol {
    start: usize,
    len: usize,
    prev: usize,
    next: usize,
}

const NONE: usize = usize::MAX;

impl Spm {
    pub(crate) fn new(texts: Pieces<String>, scores: Vec<f32>, add_space_prefix: bool) -> Self {
        let hasher = RandomState::new();
        let mut ids = HashTable::with_capacity(texts.len());
        for (id, text) in texts.iter().enumerate() {
            let found = |&i: &u32| texts.get(i as usize) == Some(text);
            let rehash = |&i: &u32| hasher.hash_one(texts.get(i as usize));
            match ids.entry(hasher.hash_one(Some(text)), found, rehash) {
                Entry::Occupied(mut e) => *e.get_mut() = id as u32,
                Entry::Vacant(e) => {
                    e.insert(id as u32);
                }
            }
        }
        let mut spm = Self {
            texts,
            ids,
            hasher,
            scores,
            byte_ids: [None; 256],
            add_space_prefix,
        };
        spm.byte_ids = std::array::from_fn(|b| spm.id(&format!("<0x{b:02X}>")));
        spm
    }

    /// The id of the token spelled `text`.
    fn id(&self, text: &str) -> Option<u32> {
        let found = |&i: &u32| self.texts.get(i as usize) == Some(text);
        self.ids
            .find(self.hasher.hash_one(Some(text)), found)
            .copied()
    }

    /// Appends the ids of `text` (plain text: special tokens were split off before).
    pub(crate) fn encode(&self, text: &str, first: bool, out: &mut Vec<u32>) {
        if text.is_empty() {
            return;
        }
        let mut escaped = String::with_capacity(text.len() + 3);
        if self.add_space_prefix && first {
            escaped.push(SPACE);
        }
        escaped.extend(text.chars().map(|c| if c == ' ' { SPACE } else { c }));
        let text = escaped.as_str();
        let mut symbols: Vec<Symbol> = text
            .char_indices()
            .map(|(start, c)| Symbol {
                start,
                len: c.len_utf8(),
                prev: NONE,
                next: NONE,
            })
            .collect();
        let n = symbols.len();
        for (i, s) in symbols.iter_mut().enumerate() {
            s.prev = if i == 0 { NONE } else { i - 1 };
            s.next = if i + 1 == n { NONE } else { i + 1 };
        }
        let mut queue = BinaryHeap::new();
        let candidate = |symbols: &[Symbol], left: usize, queue: &mut BinaryHeap<Bigram>| {
            if left == NONE || symbols[left].next == NONE {
                return;
            }
            let (l, r) = (symbols[left], symbols[symbols[left].next]);
            let merged = &text[l.start..r.start + r.len];
            if let Some(id) = self.id(merged) {
                queue.push(Bigram {
                    score: self.scores.get(id as usize).copied().unwrap_or(0.0),
                    left,
                    len: merged.len(),
                });
            }
        };
        for i in 0..n.saturating_sub(1) {
            candidate(&symbols, i, &mut queue);
        }
        while let Some(b) = queue.pop() {
            let left = symbols[b.left];
            // Stale: the left symbol was merged into another, or grew, since.
            if left.len == 0 || left.next == NONE || left.len + symbols[left.next].len != b.len {
                continue;
            }
            let right = left.next;
            symbols[b.left].len = b.len;
            symbols[b.left].next = symbols[right].next;
            symbols[right].len = 0;
            if symbols[right].next != NONE {
                let after = symbols[right].next;
                symbols[after].prev = b.left;
            }
            candidate(&symbols, symbols[b.left].prev, &mut queue);
            candidate(&symbols, b.left, &mut queue);
        }
        let mut i = 0;
        while i != NONE {
            let s = symbols[i];
            let piece = &text[s.start..s.start + s.len];
            match self.id(piece) {
                Some(id) => out.push(id),
                None => out.extend(piece.bytes().filter_map(|b| self.byte_ids[b as usize])),
            }
            i = s.next;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spm(vocab: &[(&str, f32)]) -> Spm {
        let texts = vocab.iter().map(|(t, _)| t).collect();
        Spm::new(texts, vocab.iter().map(|(_, s)| *s).collect(), false)
    }

    #[test]
    fn the_best_scoring_pair_merges_first_and_the_leftmost_among_equals() {
        // "abc": "ab" (-1) beats "bc" (-2); then "abc" is no token, so [ab, c].
        let s = spm(&[
            ("a", -5.0),
            ("b", -5.0),
            ("c", -5.0),
            ("ab", -1.0),
            ("bc", -2.0),
        ]);
        let mut out = Vec::new();
        s.encode("abc", true, &mut out);
        assert_eq!(out, [3, 2]);
        // "aaa" with "aa": the left pair merges, [aa, a].
        let s = spm(&[("a", -5.0), ("aa", -1.0)]);
        out.clear();
        s.encode("aaa", true, &mut out);
        assert_eq!(out, [1, 0]);
    }

    #[test]
    fn spaces_become_word_boundaries_and_unknown_characters_bytes() {
        let mut vocab = vec![("\u{2581}x".to_string(), -1.0), ("x".to_string(), -3.0)];
        vocab.push(("\u{2581}".to_string(), -4.0));
        for b in 0..=255u8 {
            vocab.push((format!("<0x{b:02X}>"), 0.0));
        }
        let texts = vocab.iter().map(|(t, _)| t).collect();
        let s = Spm::new(texts, vocab.iter().map(|(_, s)| *s).collect(), false);
        let mut out = Vec::new();
        s.encode("x x\u{e9}", true, &mut out);
        // x, ▁x, then é as its two UTF-8 bytes.
        assert_eq!(out, [1, 0, 3 + 0xC3, 3 + 0xA9]);
    }
}
