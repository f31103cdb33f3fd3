//! Headers on copies warren publishes: which of a delivery's headers can be
//! trusted, what a copy drops, and how large its headers may grow.
//!
//! A producer can set any header, including every `x-warren-*` one warren uses
//! for its bookkeeping, and on RabbitMQ 3.10 the broker's own headers too. So
//! warren signs the `x-warren-*` headers it writes with an HMAC whose key lives in
//! the database ([`SigningKey::signing_key`](crate::store::SigningKey::signing_key)), and believes
//! such a header only under a valid signature. Anything else named `x-warren-*` is
//! moved, untouched, into one table header, [`HEADER_UNVERIFIED`], where operators
//! still see it, labelled as not warren's.

pub(crate) mod copies;
mod fit;
mod names;
pub(crate) mod signer;

pub(crate) use copies::{
    Origin, copy_base, dead_letter_copy, onward_copy, original_route, park_copy, rebuild,
    retry_copy,
};
pub(crate) use fit::{DEFAULT_FRAME_MAX, MAX_ERROR_LEN, check_frame_size, seal};
pub use fit::{LARGEST_OWN_HEADERS, SMALLEST_OWN_HEADERS};
pub use names::*;
pub(crate) use signer::Signer;

#[cfg(test)]
mod tests;
