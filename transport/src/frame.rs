//! The wire format of a message between processes: a fixed prefix, a versioned header encoded
//! with bincode, then the raw little-endian payload.
//!
//! ```text
//! "PIPE" | header length: u32 LE | header (bincode) | payload (shape's elements x dtype size)
//! ```
//!
//! The header carries the protocol version, the run id, the message [`Key`], its version tag,
//! the payload's [`WireDType`] and the tensor's shape. The payload is the tensor's values as
//! little-endian f32, or as bf16 (round to nearest even) when the run asked for a half-width
//! wire: activations and gradients then cost half the bytes, at bf16's precision.
//!
//! Decoding trusts nothing a peer sends. The header's length is bounded
//! ([`MAX_HEADER_BYTES`]) before it is read; bincode decodes it under the same limit, so a
//! claimed vector length cannot allocate; the shape's rank is bounded ([`MAX_RANK`]); its
//! element count is multiplied with overflow checks and the payload's byte count is checked
//! against the receiver's limit ([`FrameLimits`]) before any buffer for it exists. A frame that
//! is truncated, oversized, from another run or another protocol version, or garbage, is a
//! [`FrameError`], never a panic. The reader and the decoder of a whole buffer share these
//! checks: [`parse_prefix`], [`parse_header`] and [`payload_into_message`] are the only places
//! that interpret bytes.

use bincode::{Decode, Encode};
use pipe_kernels::Tensor;
use thiserror::Error;

use crate::{Key, Kind, Message};

/// First bytes of every frame.
pub const MAGIC: [u8; 4] = *b"PIPE";

/// The protocol version this build speaks. A frame of any other version is refused.
pub const PROTOCOL_VERSION: u16 = 1;

/// Bytes before the header: the magic and the header's length.
pub const PREFIX_BYTES: usize = 8;

/// Largest header accepted. A header holds a few integers and a shape of at most
/// [`MAX_RANK`] dimensions: under 150 bytes.
pub const MAX_HEADER_BYTES: usize = 1024;

/// Largest tensor rank accepted.
pub const MAX_RANK: usize = 8;

/// Element type of a payload on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default, Encode, Decode)]
pub enum WireDType {
    /// 32-bit IEEE floats, exactly the values sent.
    #[default]
    F32,
    /// bfloat16: the top 16 bits of an f32, rounded to nearest even. Half the bytes.
    Bf16,
}

impl WireDType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            WireDType::F32 => 4,
            WireDType::Bf16 => 2,
        }
    }

    /// The name `--wire-dtype` takes.
    pub fn name(self) -> &'static str {
        match self {
            WireDType::F32 => "f32",
            WireDType::Bf16 => "bf16",
        }
    }
}

impl std::fmt::Display for WireDType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for WireDType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f32" => Ok(WireDType::F32),
            "bf16" => Ok(WireDType::Bf16),
            other => Err(format!("unknown wire dtype '{other}' (f32, bf16)")),
        }
    }
}

/// What a receiver accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameLimits {
    /// The run every frame must belong to.
    pub run_id: u64,
    /// Largest payload in bytes.
    pub max_payload_bytes: u64,
}

impl FrameLimits {
    /// Default payload limit: 4 GiB, above any activation or gradient chunk a stage sends
    /// here, below what would exhaust a worker's memory by accident.
    pub const DEFAULT_MAX_PAYLOAD: u64 = 4 << 30;

    /// Limits for `run_id` with the default payload bound.
    pub fn new(run_id: u64) -> Self {
        FrameLimits {
            run_id,
            max_payload_bytes: Self::DEFAULT_MAX_PAYLOAD,
        }
    }
}

/// Why a frame was refused.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum FrameError {
    /// The first bytes are not [`MAGIC`].
    #[error("not a pipe frame (first bytes {0:02x?})")]
    BadMagic([u8; 4]),
    /// The header length is zero or above [`MAX_HEADER_BYTES`].
    #[error("header of {len} bytes (limit {MAX_HEADER_BYTES})")]
    HeaderLength {
        /// The claimed length.
        len: u32,
    },
    /// bincode could not decode the header, or bytes were left after it.
    #[error("malformed header: {0}")]
    Header(String),
    /// The peer speaks another protocol version.
    #[error("protocol version {got}, this build speaks {PROTOCOL_VERSION}")]
    Version {
        /// The peer's version.
        got: u16,
    },
    /// The frame belongs to another run.
    #[error("frame of run {got:#x}, this run is {expected:#x}")]
    Run {
        /// This run.
        expected: u64,
        /// The frame's.
        got: u64,
    },
    /// The shape has too many dimensions or too many elements.
    #[error("shape {shape:?} is not accepted: {why}")]
    Shape {
        /// The claimed shape.
        shape: Vec<u64>,
        /// What is wrong with it.
        why: String,
    },
    /// The payload would exceed the receiver's limit.
    #[error("payload of {bytes} bytes (limit {max})")]
    PayloadTooLarge {
        /// Bytes the header implies.
        bytes: u64,
        /// The limit.
        max: u64,
    },
    /// The buffer ended before the frame did.
    #[error("frame truncated: {part} needs {needed} bytes, {got} present")]
    Truncated {
        /// Which part.
        part: &'static str,
        /// Bytes it needs.
        needed: u64,
        /// Bytes there were.
        got: u64,
    },
    /// Bytes follow the frame in a buffer meant to hold exactly one.
    #[error("{0} bytes after the end of the frame")]
    Trailing(usize),
}

/// The header of a frame as it travels.
#[derive(Clone, Debug, PartialEq, Eq, Encode, Decode)]
pub struct Header {
    /// [`PROTOCOL_VERSION`] of the sender.
    pub protocol: u16,
    /// The run the frame belongs to.
    pub run_id: u64,
    /// Sending worker.
    pub from: u32,
    /// Receiving worker.
    pub to: u32,
    /// [`Kind`] as its wire number (0 activation, 1 gradient, 2 chunk).
    pub kind: u8,
    /// Key fields, as in [`Key`].
    pub stage: u32,
    /// Microbatch or update.
    pub index: u32,
    /// Ring step.
    pub step: u32,
    /// The message's version tag.
    pub version: u64,
    /// Element type of the payload.
    pub dtype: WireDType,
    /// Tensor shape.
    pub shape: Vec<u64>,
}

impl Header {
    /// The message key the header names.
    ///
    /// # Errors
    /// [`FrameError::Header`] for an unknown kind number.
    pub fn key(&self) -> Result<Key, FrameError> {
        let kind = match self.kind {
            0 => Kind::Activation,
            1 => Kind::Gradient,
            2 => Kind::Chunk,
            3 => Kind::Control,
            k => return Err(FrameError::Header(format!("unknown message kind {k}"))),
        };
        Ok(Key {
            from: self.from,
            to: self.to,
            kind,
            stage: self.stage,
            index: self.index,
            step: self.step,
        })
    }

    /// Elements of the payload (the shape's product; checked by [`parse_header`]).
    pub fn elements(&self) -> u64 {
        self.shape.iter().product()
    }

    /// Bytes of the payload.
    pub fn payload_bytes(&self) -> u64 {
        self.elements() * self.dtype.size() as u64
    }
}

fn kind_number(kind: Kind) -> u8 {
    match kind {
        Kind::Activation => 0,
        Kind::Gradient => 1,
        Kind::Chunk => 2,
        Kind::Control => 3,
    }
}

fn bincode_config() -> impl bincode::config::Config {
    bincode::config::standard()
        .with_little_endian()
        .with_fixed_int_encoding()
        .with_limit::<MAX_HEADER_BYTES>()
}

/// The header describing `message` in run `run_id`, with its payload as `dtype`.
pub fn header_of(message: &Message, run_id: u64, dtype: WireDType) -> Header {
    let shape: Vec<u64> = message.tensor.shape().iter().map(|&d| d as u64).collect();
    header_for(message.key, message.version, shape, run_id, dtype)
}

/// The header of a message with `key`, `version` and a payload of `shape` as `dtype`, in
/// run `run_id`: for a sender that writes values it does not hold as a tensor.
pub fn header_for(
    key: Key,
    version: u64,
    shape: Vec<u64>,
    run_id: u64,
    dtype: WireDType,
) -> Header {
    let k = key;
    Header {
        protocol: PROTOCOL_VERSION,
        run_id,
        from: k.from,
        to: k.to,
        kind: kind_number(k.kind),
        stage: k.stage,
        index: k.index,
        step: k.step,
        version,
        dtype,
        shape,
    }
}

/// The prefix and encoded header of `header`: the bytes before the payload.
///
/// # Errors
/// [`FrameError::Header`] if the header cannot be encoded within [`MAX_HEADER_BYTES`] (a
/// shape of more than [`MAX_RANK`] dimensions).
pub fn encode_header(header: &Header) -> Result<Vec<u8>, FrameError> {
    if header.shape.len() > MAX_RANK {
        return Err(FrameError::Header(format!(
            "rank {} above the limit {MAX_RANK}",
            header.shape.len()
        )));
    }
    let body = bincode::encode_to_vec(header, bincode_config())
        .map_err(|e| FrameError::Header(e.to_string()))?;
    let mut out = Vec::with_capacity(PREFIX_BYTES + body.len());
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(&body);
    Ok(out)
}

/// Appends `values` to `out` as little-endian elements of `dtype`.
pub fn encode_payload(values: &[f32], dtype: WireDType, out: &mut Vec<u8>) {
    match dtype {
        WireDType::F32 => {
            if cfg!(target_endian = "little") {
                out.extend_from_slice(bytemuck::cast_slice(values));
            } else {
                values
                    .iter()
                    .for_each(|v| out.extend_from_slice(&v.to_le_bytes()));
            }
        }
        WireDType::Bf16 => {
            out.reserve(values.len() * 2);
            values.iter().for_each(|&v| {
                out.extend_from_slice(&half::bf16::from_f32(v).to_bits().to_le_bytes());
            });
        }
    }
}

/// `values` as a payload of `dtype`. An f32 payload on a little-endian machine is the
/// tensor's own buffer, handed over without a copy; bf16 is converted.
pub fn payload(values: Vec<f32>, dtype: WireDType) -> bytes::Bytes {
    /// A tensor buffer seen as its little-endian bytes.
    struct F32Bytes(Vec<f32>);
    impl AsRef<[u8]> for F32Bytes {
        fn as_ref(&self) -> &[u8] {
            bytemuck::cast_slice(&self.0)
        }
    }
    if dtype == WireDType::F32 && cfg!(target_endian = "little") {
        return bytes::Bytes::from_owner(F32Bytes(values));
    }
    let mut out = Vec::with_capacity(values.len() * dtype.size());
    encode_payload(&values, dtype, &mut out);
    bytes::Bytes::from(out)
}

/// The buffer a checked header's payload is read into: for f32 on a little-endian machine the
/// tensor's own buffer, so a received payload is never copied after the socket.
#[derive(Debug)]
pub struct PayloadBuffer {
    direct: Option<Vec<f32>>,
    raw: Vec<u8>,
}

impl PayloadBuffer {
    /// A zeroed buffer of exactly `header`'s payload size. `header` must have passed
    /// [`parse_header`], which bounds that size.
    pub fn for_header(header: &Header) -> Self {
        let elements = header.elements() as usize;
        if header.dtype == WireDType::F32 && cfg!(target_endian = "little") {
            PayloadBuffer {
                direct: Some(vec![0.0; elements]),
                raw: Vec::new(),
            }
        } else {
            PayloadBuffer {
                direct: None,
                raw: vec![0; header.payload_bytes() as usize],
            }
        }
    }

    /// The bytes to fill.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        match &mut self.direct {
            Some(values) => bytemuck::cast_slice_mut(values),
            None => &mut self.raw,
        }
    }

    /// The message the filled buffer and its header make.
    ///
    /// # Errors
    /// As [`payload_into_message`].
    pub fn into_message(self, header: &Header) -> Result<Message, FrameError> {
        let Some(values) = self.direct else {
            return payload_into_message(header, &self.raw);
        };
        let shape: Vec<usize> = header.shape.iter().map(|&d| d as usize).collect();
        let tensor = Tensor::from_vec(&shape, values)
            .map_err(|e| FrameError::Header(format!("payload does not fit the shape: {e}")))?;
        Ok(Message {
            key: header.key()?,
            version: header.version,
            tensor,
        })
    }
}

/// A whole frame for `message`: prefix, header and payload.
///
/// # Errors
/// As [`encode_header`]; a tensor not held on the host.
pub fn encode(message: &Message, run_id: u64, dtype: WireDType) -> Result<Vec<u8>, FrameError> {
    let header = header_of(message, run_id, dtype);
    let mut out = encode_header(&header)?;
    let values = message
        .tensor
        .host()
        .map_err(|e| FrameError::Header(format!("payload not on the host: {e}")))?;
    out.reserve(values.len() * dtype.size());
    encode_payload(values, dtype, &mut out);
    Ok(out)
}

/// The header length a frame's first [`PREFIX_BYTES`] announce, checked against the magic and
/// [`MAX_HEADER_BYTES`].
///
/// # Errors
/// [`FrameError::BadMagic`], [`FrameError::HeaderLength`].
pub fn parse_prefix(prefix: &[u8; PREFIX_BYTES]) -> Result<usize, FrameError> {
    let magic = [prefix[0], prefix[1], prefix[2], prefix[3]];
    if magic != MAGIC {
        return Err(FrameError::BadMagic(magic));
    }
    let len = u32::from_le_bytes([prefix[4], prefix[5], prefix[6], prefix[7]]);
    if len == 0 || len as usize > MAX_HEADER_BYTES {
        return Err(FrameError::HeaderLength { len });
    }
    Ok(len as usize)
}

/// Decodes and checks a header: exactly `bytes`, this protocol version, this run, a known
/// kind, a bounded rank, and a payload within `limits` (element count and byte count computed
/// with overflow checks). After this, [`Header::payload_bytes`] is safe to allocate.
///
/// # Errors
/// [`FrameError::Header`], [`FrameError::Version`], [`FrameError::Run`],
/// [`FrameError::Shape`], [`FrameError::PayloadTooLarge`].
pub fn parse_header(bytes: &[u8], limits: &FrameLimits) -> Result<Header, FrameError> {
    let (header, used): (Header, usize) = bincode::decode_from_slice(bytes, bincode_config())
        .map_err(|e| FrameError::Header(e.to_string()))?;
    if used != bytes.len() {
        return Err(FrameError::Header(format!(
            "{} bytes after the header",
            bytes.len() - used
        )));
    }
    if header.protocol != PROTOCOL_VERSION {
        return Err(FrameError::Version {
            got: header.protocol,
        });
    }
    if header.run_id != limits.run_id {
        return Err(FrameError::Run {
            expected: limits.run_id,
            got: header.run_id,
        });
    }
    header.key()?;
    let shape_err = |why: String| FrameError::Shape {
        shape: header.shape.clone(),
        why,
    };
    if header.shape.len() > MAX_RANK {
        return Err(shape_err(format!("rank above {MAX_RANK}")));
    }
    let elements = header
        .shape
        .iter()
        .try_fold(1u64, |n, &d| n.checked_mul(d))
        .ok_or_else(|| shape_err("element count overflows".into()))?;
    let bytes = elements
        .checked_mul(header.dtype.size() as u64)
        .ok_or_else(|| shape_err("byte count overflows".into()))?;
    if bytes > limits.max_payload_bytes {
        return Err(FrameError::PayloadTooLarge {
            bytes,
            max: limits.max_payload_bytes,
        });
    }
    if usize::try_from(elements).is_err() {
        return Err(shape_err(
            "element count beyond this machine's address space".into(),
        ));
    }
    Ok(header)
}

/// The message a checked header and its payload bytes make. `payload` must hold exactly
/// [`Header::payload_bytes`] bytes.
///
/// # Errors
/// [`FrameError::Truncated`] or [`FrameError::Trailing`] when `payload` has another length;
/// [`FrameError::Header`] for an unknown kind.
pub fn payload_into_message(header: &Header, payload: &[u8]) -> Result<Message, FrameError> {
    let key = header.key()?;
    let needed = header.payload_bytes();
    if (payload.len() as u64) < needed {
        return Err(FrameError::Truncated {
            part: "payload",
            needed,
            got: payload.len() as u64,
        });
    }
    if payload.len() as u64 > needed {
        return Err(FrameError::Trailing(payload.len() - needed as usize));
    }
    let values: Vec<f32> = match header.dtype {
        WireDType::F32 => payload
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        WireDType::Bf16 => payload
            .chunks_exact(2)
            .map(|b| half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32())
            .collect(),
    };
    let shape: Vec<usize> = header.shape.iter().map(|&d| d as usize).collect();
    let tensor = Tensor::from_vec(&shape, values)
        .map_err(|e| FrameError::Header(format!("payload does not fit the shape: {e}")))?;
    Ok(Message {
        key,
        version: header.version,
        tensor,
    })
}

/// Decodes a buffer holding exactly one frame: what a fuzzer feeds and what tests check.
///
/// # Errors
/// Every [`FrameError`].
pub fn decode(bytes: &[u8], limits: &FrameLimits) -> Result<Message, FrameError> {
    let truncated = |part, needed: usize| FrameError::Truncated {
        part,
        needed: needed as u64,
        got: bytes.len() as u64,
    };
    let prefix: &[u8; PREFIX_BYTES] = bytes
        .get(..PREFIX_BYTES)
        .and_then(|p| p.try_into().ok())
        .ok_or_else(|| truncated("prefix", PREFIX_BYTES))?;
    let header_len = parse_prefix(prefix)?;
    let header_end = PREFIX_BYTES + header_len;
    let header_bytes = bytes
        .get(PREFIX_BYTES..header_end)
        .ok_or_else(|| truncated("header", header_end))?;
    let header = parse_header(header_bytes, limits)?;
    let rest = &bytes[header_end..];
    payload_into_message(&header, rest)
}

/// Whether every value is a bf16 value (its low 16 bits zero, and not a NaN, whose payload
/// a conversion may change): such a payload travels as bf16 without losing a bit.
pub fn exact_in_bf16(values: &[f32]) -> bool {
    values
        .iter()
        .all(|v| v.to_bits() & 0xFFFF == 0 && !v.is_nan())
}

/// The values a tensor arrives with after a trip through `dtype`: unchanged for f32, rounded
/// to bf16 (nearest even) for bf16. Lets a transport that moves tensors without encoding them
/// (in-process) give a run exactly the precision a networked one has.
pub fn round_to_wire(values: &mut [f32], dtype: WireDType) {
    if dtype == WireDType::Bf16 {
        values
            .iter_mut()
            .for_each(|v| *v = half::bf16::from_f32(*v).to_f32());
    }
}
