//! Signing, the base of a copy, and fitting a frame.

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable};

use super::fit::{SHRUNK_ERROR_LEN, fit};
use super::*;
use crate::amqp::{header_str, text};

fn props(headers: &[(&str, AMQPValue)]) -> BasicProperties {
    let mut table = FieldTable::default();
    for (k, v) in headers {
        table.insert((*k).into(), v.clone());
    }
    BasicProperties::default()
        .with_message_id("m1".into())
        .with_headers(table)
}

#[test]
fn signed_headers_are_trusted_and_forged_ones_set_apart() {
    let signer = Signer::new(b"key");
    let mut headers = FieldTable::default();
    headers.insert(HEADER_ATTEMPT.into(), AMQPValue::LongLongInt(2));
    signer.sign("m1", &mut headers);
    let signed = BasicProperties::default()
        .with_message_id("m1".into())
        .with_headers(headers.clone());
    assert_eq!(signer.trusted(&signed), signed);

    // The same headers on another message, with another key, or altered.
    let moved = signed.clone().with_message_id("m2".into());
    let other_key = Signer::new(b"other");
    let mut altered = headers.clone();
    altered.insert(HEADER_ATTEMPT.into(), AMQPValue::LongLongInt(1));
    let altered = signed.clone().with_headers(altered);
    let forged = props(&[
        (HEADER_ATTEMPT, AMQPValue::LongLongInt(999)),
        ("tenant", text("acme")),
    ]);
    for (case, p, s) in [
        ("moved", &moved, &signer),
        ("other key", &signed, &other_key),
        ("altered", &altered, &signer),
        ("forged", &forged, &signer),
    ] {
        let t = s.trusted(p);
        let h = t.headers().as_ref().unwrap();
        assert!(!h.contains_key(HEADER_ATTEMPT), "{case}: not believed");
        let Some(AMQPValue::FieldTable(set_apart)) = h.inner().get(HEADER_UNVERIFIED) else {
            panic!("{case}: kept apart");
        };
        assert!(set_apart.contains_key(HEADER_ATTEMPT), "{case}");
    }
    let t = signer.trusted(&forged);
    let h = t.headers().as_ref().unwrap();
    assert_eq!(
        header_str(h, "tenant").unwrap(),
        "acme",
        "the producer's own headers are kept"
    );
}

#[test]
fn copies_drop_user_id_and_broker_headers_but_record_the_user() {
    let p = props(&[("x-delivery-count", AMQPValue::LongLongInt(9))])
        .with_user_id("A".into())
        .with_expiration("100".into());
    let copy = copy_base(&p, false);
    assert_eq!(*copy.user_id(), None);
    assert_eq!(*copy.expiration(), None);
    let h = copy.headers().as_ref().unwrap();
    assert!(!h.contains_key("x-delivery-count"));
    assert_eq!(header_str(h, HEADER_ORIGINAL_USER_ID).unwrap(), "A");
}

#[test]
fn oversized_headers_are_cut_to_fit_a_frame() {
    let p = props(&[
        ("big", text(&"x".repeat(200_000))),
        ("small", text("keep")),
        (HEADER_ERROR, text(&"e".repeat(5000))),
    ]);
    assert!(check_frame_size(&p, DEFAULT_FRAME_MAX).is_err());
    let fitted = fit(p, DEFAULT_FRAME_MAX);
    check_frame_size(&fitted, DEFAULT_FRAME_MAX).unwrap();
    let h = fitted.headers().as_ref().unwrap();
    assert!(!h.contains_key("big"));
    assert_eq!(header_str(h, "small").unwrap(), "keep");
    assert_eq!(header_str(h, HEADER_DROPPED).unwrap(), "big");
    assert!(header_str(h, HEADER_ERROR).unwrap().len() <= SHRUNK_ERROR_LEN);
}
