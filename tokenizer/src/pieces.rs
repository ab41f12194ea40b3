//! A vocabulary's strings in one buffer. Held as `Vec<String>`, a 262k-token vocabulary costs a
//! 24-byte header and an allocation per token, several times the text itself.

use std::ops::Range;

/// Strings (`Pieces<String>`) or byte strings (`Pieces<Vec<u8>>`), indexed by token id.
#[derive(Debug, Default)]
pub(crate) struct Pieces<B> {
    all: B,
    /// Where each piece ends in `all`.
    ends: Vec<usize>,
}

/// What [`Pieces`] keeps its text in.
pub(crate) trait Buffer: Default {
    type Piece: ?Sized;
    fn append(&mut self, piece: &Self::Piece);
    fn size(&self) -> usize;
    fn shrink(&mut self);
    fn slice(&self, at: Range<usize>) -> &Self::Piece;
}

impl Buffer for String {
    type Piece = str;
    fn append(&mut self, piece: &str) {
        self.push_str(piece);
    }
    fn size(&self) -> usize {
        self.len()
    }
    fn shrink(&mut self) {
        self.shrink_to_fit();
    }
    fn slice(&self, at: Range<usize>) -> &str {
        &self[at]
    }
}

impl Buffer for Vec<u8> {
    type Piece = [u8];
    fn append(&mut self, piece: &[u8]) {
        self.extend_from_slice(piece);
    }
    fn size(&self) -> usize {
        self.len()
    }
    fn shrink(&mut self) {
        self.shrink_to_fit();
    }
    fn slice(&self, at: Range<usize>) -> &[u8] {
        &self[at]
    }
}

impl<B: Buffer> Pieces<B> {
    pub(crate) fn len(&self) -> usize {
        self.ends.len()
    }

    pub(crate) fn get(&self, id: usize) -> Option<&B::Piece> {
        let end = *self.ends.get(id)?;
        let start = id.checked_sub(1).map_or(0, |i| self.ends[i]);
        Some(self.all.slice(start..end))
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = &B::Piece> {
        (0..self.len()).filter_map(|id| self.get(id))
    }

    fn push(&mut self, piece: &B::Piece) {
        self.all.append(piece);
        self.ends.push(self.all.size());
    }
}

impl<B: Buffer, P: AsRef<B::Piece>> FromIterator<P> for Pieces<B> {
    fn from_iter<I: IntoIterator<Item = P>>(pieces: I) -> Self {
        let mut out = Self::default();
        for p in pieces {
            out.push(p.as_ref());
        }
        out.all.shrink();
        out.ends.shrink_to_fit();
        out
    }
}
