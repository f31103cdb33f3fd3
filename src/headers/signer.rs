//! Which of a delivery's `x-warren-*` headers warren wrote: signed with an
//! HMAC whose key lives in the database, believed only under a valid
//! signature; anything else of that name is set apart, never trusted.

use std::collections::BTreeMap;
use std::sync::Arc;

use hmac::{Hmac, KeyInit, Mac};
use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, ShortString};
use sha2::Sha256;

use super::names::*;
use crate::amqp::text;

pub(super) fn is_warren(name: &str) -> bool {
    name.starts_with("x-warren-")
}

/// Signs and verifies warren's own headers. Cheap to clone.
#[derive(Clone)]
pub struct Signer {
    key: Arc<[u8]>,
}

impl std::fmt::Debug for Signer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Signer(***)")
    }
}

impl Signer {
    /// A signer with the store's signing key.
    pub fn new(key: &[u8]) -> Self {
        Self { key: key.into() }
    }

    /// The MAC over the message id and every signed header, in name order. Each
    /// part is length-prefixed, so no two different header sets encode alike.
    fn mac(&self, message_id: &str, headers: &FieldTable) -> Hmac<Sha256> {
        let mut mac =
            Hmac::<Sha256>::new_from_slice(&self.key).expect("HMAC takes a key of any length");
        let mut part = |bytes: &[u8]| {
            mac.update(&(bytes.len() as u64).to_be_bytes());
            mac.update(bytes);
        };
        part(message_id.as_bytes());
        for (name, value) in headers.inner() {
            let name = name.as_str();
            if !is_warren(name) || name == HEADER_SIGNATURE || name == HEADER_UNVERIFIED {
                continue;
            }
            part(name.as_bytes());
            match value {
                AMQPValue::LongString(s) => {
                    part(b"S");
                    part(s.as_bytes());
                }
                AMQPValue::LongLongInt(i) => {
                    part(b"l");
                    part(&i.to_be_bytes());
                }
                // warren writes only the two types above; anything else is
                // covered by its debug form, which is enough to make it count.
                other => {
                    part(b"?");
                    part(format!("{other:?}").as_bytes());
                }
            }
        }
        mac
    }

    /// Adds the signature over `headers`' `x-warren-*` entries.
    pub fn sign(&self, message_id: &str, headers: &mut FieldTable) {
        let tag = self.mac(message_id, headers).finalize().into_bytes();
        headers.insert(HEADER_SIGNATURE.into(), text(&hex::encode(tag)));
    }

    /// True if `headers` carries a valid signature over its `x-warren-*` entries.
    pub(crate) fn verify(&self, message_id: &str, headers: &FieldTable) -> bool {
        let Some(AMQPValue::LongString(given)) = headers.inner().get(HEADER_SIGNATURE) else {
            return false;
        };
        let Ok(given) = hex::decode(given.as_bytes()) else {
            return false;
        };
        self.mac(message_id, headers).verify_slice(&given).is_ok()
    }

    /// The delivery's properties as warren may rely on them: `x-warren-*` headers
    /// without a valid signature are moved into [`HEADER_UNVERIFIED`]; the
    /// broker's headers are left for the caller to judge.
    pub fn trusted(&self, properties: &BasicProperties) -> BasicProperties {
        let mut trusted = properties.clone();
        self.trust(&mut trusted);
        trusted
    }

    /// [`trusted`](Self::trusted) in place: a delivery whose headers are
    /// signed, or claim nothing of warren's, is left as it came (no copy of
    /// its headers on every delivery).
    pub(crate) fn trust(&self, properties: &mut BasicProperties) {
        let Some(headers) = properties.headers() else {
            return;
        };
        let message_id = properties
            .message_id()
            .as_ref()
            .map(|s| s.as_str())
            .unwrap_or_default();
        let claims = headers
            .inner()
            .keys()
            .any(|k| is_warren(k.as_str()) && k.as_str() != HEADER_UNVERIFIED);
        if !claims || self.verify(message_id, headers) {
            return;
        }
        let mut kept = BTreeMap::new();
        let mut unverified = match headers.inner().get(HEADER_UNVERIFIED) {
            Some(AMQPValue::FieldTable(t)) => t.clone(),
            _ => FieldTable::default(),
        };
        for (name, value) in headers.inner() {
            if name.as_str() == HEADER_UNVERIFIED {
                continue;
            }
            if is_warren(name.as_str()) {
                unverified.insert(name.clone(), value.clone());
            } else {
                kept.insert(name.clone(), value.clone());
            }
        }
        kept.insert(
            ShortString::from(HEADER_UNVERIFIED),
            AMQPValue::FieldTable(unverified),
        );
        *properties = std::mem::take(properties).with_headers(FieldTable::from(kept));
    }
}
