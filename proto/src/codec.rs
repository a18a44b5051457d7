//! The codec of every kmm-fleet gRPC stream: prost, with buffers sized for a hub that keeps
//! thousands of streams open for weeks.
//!
//! tonic keeps each stream's decode buffer at the largest it ever grew, so what a stream
//! once held at a time is paid for as long as it lives. Two settings keep that small:
//! - every message is sent in its own HTTP/2 chunk (a yield threshold of zero), so a
//!   receiver never buffers one message together with the start of the next;
//! - the decode buffer starts large enough for a report part (the largest message a
//!   proxy sends routinely) plus the room tonic reserves for it on top of what it has
//!   consumed ([`DECODE_BUFFER`]), so it never has to grow for one.

use std::marker::PhantomData;

use prost::Message;
use tonic::codec::{BufferSettings, Codec};
use tonic_prost::{ProstCodec, ProstDecoder, ProstEncoder};

use crate::limits::REPORT_PART;

/// What a report part's message adds to its entries: the `ProxyMessage` envelope and the
/// part's own fields (`full`, `intent_revision`, `continued`), with room to spare.
pub const PART_ENVELOPE: usize = 64;

/// A stream's first decode buffer. Once a message's length is read, tonic reserves that
/// length again beyond the bytes already buffered, and moves consumed bytes out of the way
/// only when they are at least as long as what is left. Three lengths of the largest
/// part therefore hold it wherever in the buffer it arrives.
pub const DECODE_BUFFER: usize = 3 * (REPORT_PART + PART_ENVELOPE);

/// The encoder's first buffer, and the step it grows by for a larger message.
const ENCODE_BUFFER: usize = 1 << 10;

/// A prost codec with kmm-fleet's buffer settings; the generated clients and servers of
/// package `kmm.v1` use it.
#[derive(Debug, Clone)]
pub struct FleetCodec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for FleetCodec<T, U> {
    fn default() -> Self {
        Self(PhantomData)
    }
}

impl<T, U> Codec for FleetCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = ProstDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstCodec::<T, U>::raw_encoder(BufferSettings::new(ENCODE_BUFFER, 0))
    }

    fn decoder(&mut self) -> Self::Decoder {
        ProstCodec::<T, U>::raw_decoder(BufferSettings::new(DECODE_BUFFER, 0))
    }
}
