//! Multi-tensor optimizer launches: the arguments of `adam_group_f32` (kernels.cu), which updates
//! up to [`ADAM_GROUP`] tensors in one launch, and the grouping of an update's tensors into
//! such launches.
//!
//! A GPT-2 has 149 parameter tensors, most of them small (biases and LayerNorm gains of 768
//! values), and one launch each costs more in launching than in work. The group travels by
//! value as the kernel's only argument, under the 4 KiB of parameters every driver takes, so a
//! launch needs no upload and no wait, as the per-tensor kernel needed none. The grouping is
//! plain Rust, kept apart from the launch so that it is tested without a device.

use cudarc::driver::DeviceRepr;

use crate::Result;
use crate::backend::AdamStep;
use crate::error::shape_err;

/// Tensors per launch (`ADAM_GROUP` in kernels.cu).
pub(crate) const ADAM_GROUP: usize = 64;

/// Elements per block (`ADAM_CHUNK` in kernels.cu).
pub(crate) const ADAM_CHUNK: u64 = 4096;

/// The most blocks one launch may have along x (CUDA's grid limit).
const MAX_GRID_BLOCKS: u64 = (1 << 31) - 1;

/// One tensor of a group (`AdamTensor` in kernels.cu): its four buffers' device addresses, its
/// length, its weight decay, and its first block in the launch.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct AdamTensorArg {
    w: u64,
    g: u64,
    m: u64,
    v: u64,
    n: u64,
    weight_decay: f32,
    first_block: u32,
}

/// One launch's argument (`AdamGroup` in kernels.cu): `count` tensors and the hyperparameters
/// they share.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct AdamGroupArg {
    t: [AdamTensorArg; ADAM_GROUP],
    count: u32,
    lr: f32,
    beta1: f32,
    beta2: f32,
    eps: f32,
    bias_correction1: f32,
    bias_correction2: f32,
    decoupled: i32,
}

// kernels.cu asserts the same sizes of its structures.
const _: () = assert!(std::mem::size_of::<AdamTensorArg>() == 48);
const _: () = assert!(std::mem::size_of::<AdamGroupArg>() == 3104);

// SAFETY: `#[repr(C)]` plain data (integers and floats, no padding the kernel reads), laid out
// as kernels.cu's `AdamGroup` (both sides assert its size); passed by value as a kernel
// parameter.
unsafe impl DeviceRepr for AdamGroupArg {}

/// One tensor's update as the backend hands it over: its buffers' device addresses, its length
/// and its hyperparameters.
#[derive(Clone, Copy, Debug)]
pub(crate) struct AdamOperands {
    /// The weights.
    pub(crate) w: u64,
    /// The gradient.
    pub(crate) g: u64,
    /// The first moment.
    pub(crate) m: u64,
    /// The second moment.
    pub(crate) v: u64,
    /// Elements in each.
    pub(crate) n: u64,
    /// Its hyperparameters.
    pub(crate) hp: AdamStep,
}

/// The hyperparameters a group's tensors share: all but the weight decay, compared by their
/// bits.
fn shared(hp: &AdamStep) -> [u32; 7] {
    [
        hp.lr.to_bits(),
        hp.beta1.to_bits(),
        hp.beta2.to_bits(),
        hp.eps.to_bits(),
        u32::from(hp.decoupled),
        hp.bias_correction1.to_bits(),
        hp.bias_correction2.to_bits(),
    ]
}

impl AdamGroupArg {
    /// An empty group with `hp`'s shared hyperparameters.
    fn new(hp: &AdamStep) -> Self {
        AdamGroupArg {
            t: [AdamTensorArg::default(); ADAM_GROUP],
            count: 0,
            lr: hp.lr,
            beta1: hp.beta1,
            beta2: hp.beta2,
            eps: hp.eps,
            bias_correction1: hp.bias_correction1,
            bias_correction2: hp.bias_correction2,
            decoupled: i32::from(hp.decoupled),
        }
    }

    /// The tensors in the group.
    fn tensors(&self) -> &[AdamTensorArg] {
        &self.t[..self.count as usize]
    }

    /// The blocks the launch needs: the last tensor's first block and its own.
    pub(crate) fn blocks(&self) -> u32 {
        self.tensors().last().map_or(0, |t| {
            // At most MAX_GRID_BLOCKS (`adam_groups`), which fits u32.
            t.first_block + t.n.div_ceil(ADAM_CHUNK) as u32
        })
    }

    /// Whether `op` can join: room, the same shared hyperparameters, and the blocks within a
    /// grid.
    fn takes(&self, op: &AdamOperands, blocks: u64) -> bool {
        (self.count as usize) < ADAM_GROUP
            && shared(&self.hp()) == shared(&op.hp)
            && u64::from(self.blocks()) + blocks <= MAX_GRID_BLOCKS
    }

    /// The shared hyperparameters as a step (with no weight decay).
    fn hp(&self) -> AdamStep {
        AdamStep {
            lr: self.lr,
            beta1: self.beta1,
            beta2: self.beta2,
            eps: self.eps,
            weight_decay: 0.0,
            decoupled: self.decoupled != 0,
            bias_correction1: self.bias_correction1,
            bias_correction2: self.bias_correction2,
        }
    }

    /// Appends `op` (the caller checked [`AdamGroupArg::takes`]).
    fn push(&mut self, op: &AdamOperands) {
        let first_block = self.blocks();
        self.t[self.count as usize] = AdamTensorArg {
            w: op.w,
            g: op.g,
            m: op.m,
            v: op.v,
            n: op.n,
            weight_decay: op.hp.weight_decay,
            first_block,
        };
        self.count += 1;
    }
}

/// `operands` as launches of `adam_group_f32`, in order: a new group starts when one is full,
/// when the shared hyperparameters change, or when the blocks would pass the grid's limit.
/// Empty tensors are left out (nothing to update).
///
/// # Errors
/// A tensor too long for one grid of [`ADAM_CHUNK`]-element blocks (about 8.8 * 10^12 values).
pub(crate) fn adam_groups(operands: &[AdamOperands]) -> Result<Vec<AdamGroupArg>> {
    let mut groups: Vec<AdamGroupArg> = Vec::new();
    for op in operands.iter().filter(|op| op.n > 0) {
        let blocks = op.n.div_ceil(ADAM_CHUNK);
        if blocks > MAX_GRID_BLOCKS {
            return Err(shape_err(
                "adam_updates",
                format!("a tensor of {} values is too long for one launch", op.n),
            ));
        }
        match groups.last_mut() {
            Some(group) if group.takes(op, blocks) => group.push(op),
            _ => {
                let mut group = AdamGroupArg::new(&op.hp);
                group.push(op);
                groups.push(group);
            }
        }
    }
    Ok(groups)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hp(lr: f32, weight_decay: f32) -> AdamStep {
        AdamStep {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay,
            decoupled: true,
            bias_correction1: 0.1,
            bias_correction2: 0.001,
        }
    }

    fn tensor(i: u64, n: u64, hp: AdamStep) -> AdamOperands {
        AdamOperands {
            w: 0x1000 * i,
            g: 0x1000 * i + 1,
            m: 0x1000 * i + 2,
            v: 0x1000 * i + 3,
            n,
            hp,
        }
    }

    #[test]
    fn each_tensor_owns_its_blocks_in_order_with_its_own_weight_decay() {
        let ops = [
            tensor(1, 768, hp(1e-3, 0.1)),
            tensor(2, ADAM_CHUNK * 3, hp(1e-3, 0.0)),
            tensor(3, ADAM_CHUNK + 1, hp(1e-3, 0.1)),
        ];
        let groups = adam_groups(&ops).unwrap();
        assert_eq!(groups.len(), 1);
        let g = &groups[0];
        let first: Vec<u32> = g.tensors().iter().map(|t| t.first_block).collect();
        assert_eq!(first, [0, 1, 4]);
        assert_eq!(g.blocks(), 6);
        let decay: Vec<f32> = g.tensors().iter().map(|t| t.weight_decay).collect();
        assert_eq!(decay, [0.1, 0.0, 0.1]);
        assert_eq!((g.tensors()[2].w, g.tensors()[2].v), (0x3000, 0x3003));
        assert_eq!(g.lr, 1e-3);
        assert_eq!(g.decoupled, 1);
    }

    #[test]
    fn a_full_group_or_other_shared_hyperparameters_start_a_new_launch() {
        let mut ops: Vec<AdamOperands> = (0..ADAM_GROUP as u64 + 3)
            .map(|i| tensor(i + 1, 10, hp(1e-3, 0.1)))
            .collect();
        ops.push(tensor(99, 10, hp(2e-3, 0.1)));
        ops.push(tensor(100, 10, hp(1e-3, 0.1)));
        let groups = adam_groups(&ops).unwrap();
        let counts: Vec<u32> = groups.iter().map(|g| g.count).collect();
        assert_eq!(counts, [ADAM_GROUP as u32, 3, 1, 1]);
        assert_eq!(groups[2].lr, 2e-3);
        assert_eq!(groups[1].blocks(), 3);
        // Every tensor is in exactly one launch, in order.
        let all: Vec<u64> = groups
            .iter()
            .flat_map(|g| g.tensors())
            .map(|t| t.w)
            .collect();
        let want: Vec<u64> = ops.iter().map(|op| op.w).collect();
        assert_eq!(all, want);
    }

    #[test]
    fn empty_tensors_are_left_out_and_an_empty_list_launches_nothing() {
        assert!(adam_groups(&[]).unwrap().is_empty());
        let groups = adam_groups(&[tensor(1, 0, hp(1e-3, 0.0))]).unwrap();
        assert!(groups.is_empty());
        let groups =
            adam_groups(&[tensor(1, 0, hp(1e-3, 0.0)), tensor(2, 5, hp(1e-3, 0.0))]).unwrap();
        assert_eq!(groups.len(), 1);
        assert_eq!(groups[0].tensors()[0].w, 0x2000);
    }

    #[test]
    fn the_grid_limit_splits_launches_and_refuses_a_tensor_past_it() {
        let big = ADAM_CHUNK * (MAX_GRID_BLOCKS - 10);
        let groups = adam_groups(&[
            tensor(1, big, hp(1e-3, 0.0)),
            tensor(2, ADAM_CHUNK * 20, hp(1e-3, 0.0)),
        ])
        .unwrap();
        assert_eq!(groups.len(), 2);
        assert_eq!(groups[0].blocks() as u64, MAX_GRID_BLOCKS - 10);
        let too_long = ADAM_CHUNK * MAX_GRID_BLOCKS + 1;
        let err = adam_groups(&[tensor(1, too_long, hp(1e-3, 0.0))]).unwrap_err();
        assert!(err.to_string().contains("too long"), "{err}");
    }
}
