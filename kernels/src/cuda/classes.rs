//! The size classes the CUDA backend's caching allocator serves blocks in ([`block_bytes`]):
//! one rule for the pool itself, for the emulated device that counts its buffers as the pool
//! would, and for pipe's model of a device's memory, which rounds each tensor it expects the
//! same way. Built without the `cuda` feature, since the last two need no GPU.

/// The smallest block the pool hands out.
const SMALLEST_CLASS: usize = 512;
/// Up to this many bytes, a block is the next power of two.
const POWER_OF_TWO_UP_TO: usize = 64 << 20;
/// Above [`POWER_OF_TWO_UP_TO`], a block is a multiple of this.
const LARGE_GRANULE: usize = 2 << 20;

/// The bytes of the block a request of `bytes` is served from: a power of two from 512 bytes
/// up to 64 MiB, then a multiple of 2 MiB. A block wastes at most half of itself below 64 MiB
/// and under 2 MiB above.
pub fn block_bytes(bytes: usize) -> usize {
    if bytes <= SMALLEST_CLASS {
        SMALLEST_CLASS
    } else if bytes <= POWER_OF_TWO_UP_TO {
        bytes.next_power_of_two()
    } else {
        bytes.div_ceil(LARGE_GRANULE) * LARGE_GRANULE
    }
}

#[cfg(test)]
mod tests {
    use super::block_bytes;

    #[test]
    fn size_classes_cover_the_request_and_bound_the_waste() {
        for bytes in [
            0,
            1,
            512,
            513,
            4096,
            5000,
            1 << 20,
            (64 << 20) + 1,
            300 << 20,
        ] {
            let class = block_bytes(bytes);
            assert!(class >= bytes, "{bytes} -> {class}");
            assert!(
                class <= (2 * bytes).max(512).max(bytes + (2 << 20)),
                "{bytes}"
            );
        }
        assert_eq!(block_bytes(5000), 8192);
        assert_eq!(block_bytes((64 << 20) + 1), (64 << 20) + (2 << 20));
    }
}
