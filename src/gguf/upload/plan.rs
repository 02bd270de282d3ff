//! How a staged upload cuts its tensors into fills of the staging buffers.
//!
//! Tensors are taken in the order given and cut into pieces of at most what is left of the
//! current fill: a fill holds pieces of as many tensors as fit, and a tensor larger than a
//! buffer spans several fills. A raw upload cuts anywhere and packs pieces back to back; a
//! dequantizing upload cuts a tensor only at multiples of its `granule` (whole blocks, see
//! [`super::DEQUANT_GRANULE`]) and starts every piece on an `align`-byte boundary of the buffer,
//! so that each piece is a run of whole blocks the device kernel can take as it is.

use std::ops::Range;

/// One piece: bytes `src` of tensor `tensor`, written at byte `at` of its fill's buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Piece {
    pub(crate) tensor: usize,
    pub(crate) src: Range<usize>,
    pub(crate) at: usize,
}

/// Cuts tensors into fills (see the module docs).
#[derive(Debug)]
pub(crate) struct Planner {
    /// Byte length of each tensor.
    lens: Vec<usize>,
    /// Bytes a cut inside tensor i falls on a multiple of (1: anywhere).
    granules: Vec<usize>,
    /// Every piece starts at a multiple of this in its buffer.
    align: usize,
    /// Bytes per buffer.
    staging: usize,
    /// The next byte to plan: `off` of tensor `tensor`.
    tensor: usize,
    off: usize,
}

impl Planner {
    /// Pieces packed back to back, cut anywhere.
    pub(crate) fn raw(lens: Vec<usize>, staging: usize) -> Self {
        let granules = vec![1; lens.len()];
        Self {
            lens,
            granules,
            align: 1,
            staging: staging.max(1),
            tensor: 0,
            off: 0,
        }
    }

    /// Pieces cut at multiples of `granules[i]` and aligned to `align` (a power of two).
    ///
    /// # Errors
    /// The largest granule when `staging` is smaller: an empty buffer (whose first piece
    /// starts at offset 0, aligned) could not take one granule, so no fill could make progress.
    pub(crate) fn aligned(
        lens: Vec<usize>,
        granules: Vec<usize>,
        align: usize,
        staging: usize,
    ) -> Result<Self, usize> {
        debug_assert_eq!(lens.len(), granules.len());
        debug_assert!(align.is_power_of_two());
        // A fill starts at offset 0 (aligned), so one granule always fits an empty buffer.
        let needed = granules.iter().copied().max().unwrap_or(1);
        if needed > staging {
            return Err(needed);
        }
        Ok(Self {
            lens,
            granules: granules.into_iter().map(|g| g.max(1)).collect(),
            align,
            staging,
            tensor: 0,
            off: 0,
        })
    }

    /// The pieces of the next fill, or `None` once every byte is planned.
    pub(crate) fn next_fill(&mut self) -> Option<Vec<Piece>> {
        let mut pieces = Vec::new();
        let mut at = 0usize;
        while self.tensor < self.lens.len() {
            let left = self.lens[self.tensor] - self.off;
            if left == 0 {
                self.tensor += 1;
                self.off = 0;
                continue;
            }
            let start = at.next_multiple_of(self.align);
            if start >= self.staging {
                break;
            }
            let room = self.staging - start;
            let g = self.granules[self.tensor];
            // The tensor's last piece may be any length (whole blocks by construction of the
            // lengths); a cut inside it falls on a granule.
            let take = if left <= room { left } else { room / g * g };
            if take == 0 {
                break; // not even one granule left in this buffer: the next fill takes it
            }
            pieces.push(Piece {
                tensor: self.tensor,
                src: self.off..self.off + take,
                at: start,
            });
            at = start + take;
            self.off += take;
        }
        (!pieces.is_empty()).then_some(pieces)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(mut p: Planner) -> Vec<Vec<Piece>> {
        std::iter::from_fn(|| p.next_fill()).collect()
    }

    #[test]
    fn raw_packs_and_spans() {
        let fills = all(Planner::raw(vec![5, 12, 0, 3], 8));
        let flat: Vec<(usize, Range<usize>, usize)> = fills
            .iter()
            .flatten()
            .map(|p| (p.tensor, p.src.clone(), p.at))
            .collect();
        assert_eq!(
            flat,
            [
                (0, 0..5, 0),
                (1, 0..3, 5),
                (1, 3..11, 0),
                (1, 11..12, 0),
                (3, 0..3, 1)
            ]
        );
        assert_eq!(fills.len(), 3);
    }

    #[test]
    fn aligned_cuts_on_granules_and_aligns_starts() {
        // Granule 10, align 16, buffer 40: tensor 0 (25 bytes) fits whole at 0; tensor 1 (55)
        // would start at 32 with room for no granule -> next fill; there 40 of it (4
        // granules), then its last 15 bytes in the fill after.
        let fills = all(Planner::aligned(vec![25, 55], vec![10, 10], 16, 40).expect("plan"));
        let flat: Vec<Vec<(usize, Range<usize>, usize)>> = fills
            .iter()
            .map(|f| f.iter().map(|p| (p.tensor, p.src.clone(), p.at)).collect())
            .collect();
        assert_eq!(
            flat,
            [
                vec![(0, 0..25, 0)],
                vec![(1, 0..40, 0)],
                vec![(1, 40..55, 0)]
            ]
        );
        assert_eq!(
            Planner::aligned(vec![1], vec![50], 16, 40).map(|_| ()),
            Err(50)
        );
    }
}
