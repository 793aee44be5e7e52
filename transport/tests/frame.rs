//! The wire format: round trips, and a decoder that refuses every malformed frame without
//! panicking or allocating what the frame claims. The property cases are bounded so that CI
//! runs them on every change; `PIPE_FRAME_CASES` raises the count for a longer search (the
//! README gives the figures of one).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use pipe_kernels::Tensor;
use pipe_transport::frame::{
    self, FrameError, FrameLimits, Header, MAX_HEADER_BYTES, PREFIX_BYTES, PROTOCOL_VERSION,
    WireDType,
};
use pipe_transport::{Key, Kind, Message};
use proptest::prelude::*;

const RUN: u64 = 0x005e_ed0f_2026;

fn cases(default: u32) -> u32 {
    std::env::var("PIPE_FRAME_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

fn message(shape: &[usize], kind: Kind, seed: u32) -> Message {
    let n: usize = shape.iter().product();
    let values = (0..n)
        .map(|i| ((i as u32).wrapping_mul(2_654_435_761) ^ seed) as f32 * 1e-7 - 3.0)
        .collect();
    Message {
        key: Key {
            from: seed % 7,
            to: seed % 5,
            kind,
            stage: seed % 11,
            index: seed,
            step: seed % 3,
        },
        version: u64::from(seed) << 20,
        tensor: Tensor::from_vec(shape, values).unwrap(),
    }
}

fn valid_frame() -> Vec<u8> {
    frame::encode(&message(&[3, 5], Kind::Gradient, 9), RUN, WireDType::F32).unwrap()
}

/// A frame with `header` and `payload` bytes appended, whatever they claim.
fn raw_frame(header: &Header, payload: &[u8]) -> Vec<u8> {
    let mut out = frame::encode_header(header).unwrap();
    out.extend_from_slice(payload);
    out
}

fn header() -> Header {
    frame::header_of(&message(&[2, 2], Kind::Activation, 1), RUN, WireDType::F32)
}

fn kind_strategy() -> impl Strategy<Value = Kind> {
    prop_oneof![
        Just(Kind::Activation),
        Just(Kind::Gradient),
        Just(Kind::Chunk)
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases(256)))]

    #[test]
    fn f32_frames_round_trip_bit_for_bit(
        shape in prop::collection::vec(0usize..6, 0..4),
        kind in kind_strategy(),
        seed in any::<u32>(),
    ) {
        let m = message(&shape, kind, seed);
        let bytes = frame::encode(&m, RUN, WireDType::F32).unwrap();
        let back = frame::decode(&bytes, &FrameLimits::new(RUN)).unwrap();
        prop_assert_eq!(back.key, m.key);
        prop_assert_eq!(back.version, m.version);
        prop_assert_eq!(back.tensor.shape(), m.tensor.shape());
        let bits = |t: &Tensor| t.host().unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        prop_assert_eq!(bits(&back.tensor), bits(&m.tensor));
    }

    #[test]
    fn bf16_frames_carry_the_rounded_values_in_half_the_bytes(
        shape in prop::collection::vec(1usize..6, 1..4),
        seed in any::<u32>(),
    ) {
        let m = message(&shape, Kind::Activation, seed);
        let f32_bytes = frame::encode(&m, RUN, WireDType::F32).unwrap();
        let bf16_bytes = frame::encode(&m, RUN, WireDType::Bf16).unwrap();
        let n = m.tensor.len();
        // Same header size: the dtype is a one-byte variant either way.
        prop_assert_eq!(f32_bytes.len() - bf16_bytes.len(), 2 * n);
        let back = frame::decode(&bf16_bytes, &FrameLimits::new(RUN)).unwrap();
        let mut want = m.tensor.host().unwrap().to_vec();
        frame::round_to_wire(&mut want, WireDType::Bf16);
        prop_assert_eq!(back.tensor.host().unwrap(), &want[..]);
    }

    #[test]
    fn garbage_is_refused_without_panicking(bytes in prop::collection::vec(any::<u8>(), 0..2048)) {
        // Anything may come back as an error; nothing may panic or allocate without bound.
        let _ = frame::decode(&bytes, &FrameLimits::new(RUN));
    }

    #[test]
    fn garbage_after_a_valid_prefix_is_refused_without_panicking(
        len in 0u32..(MAX_HEADER_BYTES as u32 + 64),
        body in prop::collection::vec(any::<u8>(), 0..1200),
    ) {
        let mut bytes = frame::MAGIC.to_vec();
        bytes.extend_from_slice(&len.to_le_bytes());
        bytes.extend_from_slice(&body);
        let _ = frame::decode(&bytes, &FrameLimits::new(RUN));
    }

    #[test]
    fn corrupted_frames_never_panic_and_decode_only_to_consistent_messages(
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
    ) {
        let mut bytes = valid_frame();
        for (at, value) in flips {
            let i = at.index(bytes.len());
            bytes[i] = value;
        }
        if let Ok(m) = frame::decode(&bytes, &FrameLimits::new(RUN)) {
            // A frame that still decodes is self-consistent: its payload filled its shape.
            prop_assert_eq!(m.tensor.len(), m.tensor.shape().iter().product::<usize>());
        }
    }
}

#[test]
fn every_truncation_of_a_frame_is_an_error() {
    let bytes = valid_frame();
    for cut in 0..bytes.len() {
        let err = frame::decode(&bytes[..cut], &FrameLimits::new(RUN)).unwrap_err();
        assert!(
            matches!(
                err,
                FrameError::Truncated { .. }
                    | FrameError::Header(_)
                    | FrameError::HeaderLength { .. }
            ),
            "cut at {cut}: {err}"
        );
    }
    assert!(frame::decode(&bytes, &FrameLimits::new(RUN)).is_ok());
}

#[test]
fn bytes_after_the_frame_are_refused() {
    let mut bytes = valid_frame();
    bytes.push(0);
    assert_eq!(
        frame::decode(&bytes, &FrameLimits::new(RUN)).unwrap_err(),
        FrameError::Trailing(1)
    );
}

#[test]
fn a_huge_claimed_payload_is_refused_before_anything_is_allocated() {
    let mut h = header();
    h.shape = vec![1 << 20, 1 << 20, 1 << 10];
    let err = frame::decode(&raw_frame(&h, &[]), &FrameLimits::new(RUN)).unwrap_err();
    assert_eq!(
        err,
        FrameError::PayloadTooLarge {
            bytes: 4 << 50,
            max: FrameLimits::DEFAULT_MAX_PAYLOAD
        }
    );
    h.shape = vec![u64::MAX, 3];
    assert!(matches!(
        frame::decode(&raw_frame(&h, &[]), &FrameLimits::new(RUN)).unwrap_err(),
        FrameError::Shape { .. }
    ));
    // Within u64 but not within the byte count.
    h.shape = vec![u64::MAX / 2];
    assert!(matches!(
        frame::decode(&raw_frame(&h, &[]), &FrameLimits::new(RUN)).unwrap_err(),
        FrameError::Shape { .. }
    ));
}

#[test]
fn a_receiver_limit_below_the_payload_refuses_it() {
    let bytes = frame::encode(&message(&[64], Kind::Chunk, 3), RUN, WireDType::F32).unwrap();
    let limits = FrameLimits {
        run_id: RUN,
        max_payload_bytes: 255,
    };
    assert_eq!(
        frame::decode(&bytes, &limits).unwrap_err(),
        FrameError::PayloadTooLarge {
            bytes: 256,
            max: 255
        }
    );
}

#[test]
fn a_claimed_shape_vector_of_huge_length_is_refused_by_the_header_limit() {
    // Hand-built header bytes: the fields before the shape, then a length of 2^60 for it.
    let good = frame::encode_header(&header()).unwrap();
    let body = &good[PREFIX_BYTES..];
    // With fixed-width integers the shape's length is the 8 bytes before its two entries.
    let shape_len_at = body.len() - 2 * 8 - 8;
    let mut forged = body.to_vec();
    forged[shape_len_at..shape_len_at + 8].copy_from_slice(&(1u64 << 60).to_le_bytes());
    let err = frame::parse_header(&forged, &FrameLimits::new(RUN)).unwrap_err();
    assert!(matches!(err, FrameError::Header(_)), "{err}");
}

#[test]
fn other_runs_versions_kinds_and_magics_are_named() {
    let limits = FrameLimits::new(RUN);
    let mut h = header();
    h.run_id = RUN + 1;
    assert_eq!(
        frame::decode(&raw_frame(&h, &[0; 16]), &limits).unwrap_err(),
        FrameError::Run {
            expected: RUN,
            got: RUN + 1
        }
    );
    let mut h = header();
    h.protocol = PROTOCOL_VERSION + 1;
    assert_eq!(
        frame::decode(&raw_frame(&h, &[0; 16]), &limits).unwrap_err(),
        FrameError::Version {
            got: PROTOCOL_VERSION + 1
        }
    );
    let mut h = header();
    h.kind = 9;
    assert!(
        frame::decode(&raw_frame(&h, &[0; 16]), &limits)
            .unwrap_err()
            .to_string()
            .contains("unknown message kind 9")
    );
    let mut bytes = valid_frame();
    bytes[0] = b'X';
    assert!(matches!(
        frame::decode(&bytes, &limits).unwrap_err(),
        FrameError::BadMagic(_)
    ));
    let mut bytes = valid_frame();
    bytes[4..8].copy_from_slice(&(MAX_HEADER_BYTES as u32 + 1).to_le_bytes());
    assert!(matches!(
        frame::decode(&bytes, &limits).unwrap_err(),
        FrameError::HeaderLength { .. }
    ));
    let mut h = header();
    h.shape = vec![1; frame::MAX_RANK + 1];
    assert!(frame::encode_header(&h).is_err());
}

#[test]
fn wire_dtypes_parse_by_name() {
    assert_eq!("bf16".parse::<WireDType>(), Ok(WireDType::Bf16));
    assert_eq!("f32".parse::<WireDType>(), Ok(WireDType::F32));
    assert!("fp8".parse::<WireDType>().unwrap_err().contains("fp8"));
}

/// A payload of bf16 values is recognised (it then travels in two bytes a value without loss);
/// anything else, NaN included, is not.
#[test]
fn exact_bf16_payloads_are_recognised() {
    use pipe_transport::frame::{exact_in_bf16, round_to_wire};
    let mut v = vec![0.1f32, -3.7, 1e-30, 0.0, 65504.0];
    assert!(!exact_in_bf16(&v));
    round_to_wire(&mut v, WireDType::Bf16);
    assert!(exact_in_bf16(&v));
    assert!(!exact_in_bf16(&[f32::NAN]));
    assert!(exact_in_bf16(&[]));
}
