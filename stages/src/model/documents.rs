//! Packed documents (`--pack-documents`): token windows are cut from a corpus of documents,
//! each ending with the end-of-text id, so a window holds the tail of one document, whole
//! documents and the head of another. Packed, a window is read as the documents it holds:
//! attention does not cross a document's start, positions restart at 0 there, and the first
//! token of a document is not a loss term (its label is
//! [`IGNORED_LABEL`](pipe_kernels::IGNORED_LABEL), set where windows are gathered).
//!
//! Every stage of a pipeline derives the same layout from the microbatch's token ids, which
//! every worker reads from its own copy of the corpus, so nothing about documents travels
//! between stages.

use pipe_kernels::{Backend, Tensor};

/// Where the documents of a microbatch of packed windows start, placed on the backend that
/// computes with it: what the attention layers mask by and the position embedding reads.
#[derive(Debug)]
pub struct Documents {
    /// Per token (`[batch * seq]`, whole numbers in `f32`), the index in its window of its
    /// document's first token.
    pub starts: Tensor,
    /// Per token, its position in its document (its index less its start): the position
    /// embedding's rows.
    pub positions: Tensor,
}

/// Per token of `ids` (windows of `seq` tokens), the index in its window where its document
/// starts: a document starts at a window's first token and after each `end` id (the end id is
/// its own document's last token).
pub fn document_starts(ids: &[f32], seq: usize, end: u32) -> Vec<f32> {
    let end = end as f32;
    let mut starts = Vec::with_capacity(ids.len());
    for window in ids.chunks(seq.max(1)) {
        let mut start = 0usize;
        for (i, &id) in window.iter().enumerate() {
            starts.push(start as f32);
            if id == end {
                start = i + 1;
            }
        }
    }
    starts
}

impl Documents {
    /// The documents of `ids` (`[batch, seq]` token ids in host memory, as windows are
    /// gathered), each ending with an `end` id, placed on `be`.
    ///
    /// # Errors
    /// Ids not shaped `[batch, seq]`; a failed placement.
    pub fn of(be: &dyn Backend, ids: &Tensor, end: u32) -> pipe_kernels::Result<Self> {
        let seq = match ids.shape() {
            [_, t] => *t,
            other => {
                return Err(pipe_kernels::KernelError::Shape {
                    op: "documents",
                    detail: format!("token ids shaped {other:?}, not [batch, tokens]"),
                });
            }
        };
        let starts = document_starts(ids.host()?, seq, end);
        let positions = starts
            .iter()
            .enumerate()
            .map(|(k, &s)| (k % seq) as f32 - s)
            .collect();
        let n = starts.len();
        Ok(Self {
            starts: be.place(Tensor::from_vec(&[n], starts)?)?,
            positions: be.place(Tensor::from_vec(&[n], positions)?)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::document_starts;

    #[test]
    fn a_document_starts_at_a_window_and_after_each_end() {
        // End id 9; two windows of 5.
        let ids = [1.0, 9.0, 2.0, 3.0, 9.0, 4.0, 5.0, 9.0, 9.0, 6.0];
        assert_eq!(
            document_starts(&ids, 5, 9),
            [0.0, 0.0, 2.0, 2.0, 2.0, 0.0, 0.0, 0.0, 3.0, 4.0]
        );
    }
}
