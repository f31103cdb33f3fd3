use lapin::BasicProperties;
use lapin::types::AMQPValue;
use sha2::{Digest, Sha256};
use warren_chaos::hostile::{Properties, Value};

use super::super::{
    Cause, MAX_HEADER_DEPTH, MAX_HEADER_ENTRIES, MAX_RECORD_ENTRIES, Pruned, take_pruned,
};
use super::{content_header, method};

const FRAME_MAX: usize = 128 * 1024;

/// A content header payload (class, weight, body size, properties).
fn payload(p: &Properties) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&60u16.to_be_bytes());
    out.extend_from_slice(&0u16.to_be_bytes());
    out.extend_from_slice(&2u64.to_be_bytes());
    out.extend_from_slice(&p.encode());
    out
}

/// The properties as lapin reads them from a content header payload: its
/// own frame parser, on the whole frame, which must be consumed exactly.
fn parsed(payload: &[u8]) -> Option<BasicProperties> {
    let mut frame = vec![2, 0, 1];
    frame.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    frame.extend_from_slice(payload);
    frame.push(0xCE);
    match amq_protocol::frame::parse_frame(&frame[..]) {
        Ok((&[], amq_protocol::frame::AMQPFrame::Header(1, header))) => Some(header.properties),
        _ => None,
    }
}

/// Nothing in `p`'s headers is past the guard's limits.
pub(in crate::broker::guard) fn within_limits(p: &BasicProperties) -> bool {
    let h = p.headers().clone().unwrap_or_default();
    let deepest = h.inner().values().map(depth_of).max().unwrap_or(0);
    let values: usize = h.inner().values().map(values_of).sum();
    deepest <= MAX_HEADER_DEPTH && values <= MAX_HEADER_ENTRIES + MAX_RECORD_ENTRIES
}

/// Inspects `p` and returns what lapin then reads, with the guard's report.
fn guarded(p: &Properties) -> (BasicProperties, Option<Pruned>) {
    let original = payload(p);
    let passed = content_header(&original, None, FRAME_MAX).unwrap_or_else(|| original.clone());
    assert!(passed.len() + 8 <= FRAME_MAX, "fits the frame");
    let mut properties = parsed(&passed).expect("lapin reads what the guard passes");
    assert!(within_limits(&properties), "and it is within the limits");
    let pruned = take_pruned(&mut properties);
    (properties, pruned)
}

fn header<'a>(p: &'a BasicProperties, name: &str) -> Option<&'a AMQPValue> {
    p.headers().as_ref()?.inner().get(name)
}

fn sha256(parts: &[&[u8]]) -> String {
    let mut d = Sha256::new();
    for p in parts {
        d.update(p);
    }
    let hex: String = hex::encode(d.finalize());
    format!("sha256:{hex}")
}

/// A header entry's bytes as they travel: name length, name, value.
fn entry(name: &[u8], value: &Value) -> Vec<u8> {
    let mut out = vec![name.len() as u8];
    out.extend_from_slice(name);
    out.extend_from_slice(value.as_bytes());
    out
}

fn x_death() -> Value {
    Value::array([Value::table([
        ("count", Value::long(3)),
        ("reason", Value::long_string("expired")),
        (
            "routing-keys",
            Value::array([Value::long_string("billing.invoice-paid.v1")]),
        ),
        ("time", Value::timestamp(1_700_000_000)),
    ])])
}

#[test]
fn what_lapin_reads_safely_passes_byte_for_byte() {
    let every_type = Value::table([
        ("t", Value::bool(true)),
        ("b", Value::raw(b'b', &[0x80])),
        ("B", Value::octet(7)),
        ("s", Value::raw(b's', &[1, 2])),
        ("u", Value::raw(b'u', &[1, 2])),
        ("I", Value::int(-5)),
        ("i", Value::raw(b'i', &[0, 0, 0, 9])),
        ("l", Value::long(i64::MIN)),
        ("L", Value::raw(b'L', &[0; 8])),
        ("f", Value::raw(b'f', &[0; 4])),
        ("d", Value::double(1.5)),
        ("D", Value::decimal(2, 12345)),
        ("T", Value::timestamp(u64::MAX)),
        ("S", Value::long_string([0, 255, 27, b'['])),
        ("x", Value::bytes([0xff, 0xfe])),
        ("V", Value::void()),
        ("A", Value::array([])),
        ("F", Value::table::<&str>([])),
    ]);
    let flat = (0..MAX_HEADER_ENTRIES - 1).fold(Properties::default(), |p, n| {
        p.header(format!("h{n}"), Value::void())
    });
    for (case, p) in [
        ("none", Properties::default()),
        (
            "all properties",
            Properties::default()
                .content_type("application/json")
                .content_encoding("identity")
                .header("x-death", x_death())
                .header("every", every_type)
                .delivery_mode(2)
                .priority(9)
                .correlation_id("c é")
                .reply_to("r")
                .expiration("60000")
                .message_id("m-1 ")
                .timestamp(u64::MAX)
                .kind("billing.invoice-paid.v1")
                .user_id("guest")
                .app_id("app")
                .cluster_id("cl"),
        ),
        (
            "tables at the depth limit",
            Properties::default().header(
                "h",
                Value::nested_tables(MAX_HEADER_DEPTH, Value::long_string("leaf")),
            ),
        ),
        (
            "arrays at the depth limit",
            Properties::default()
                .header("h", Value::nested_arrays(MAX_HEADER_DEPTH, Value::long(1))),
        ),
        (
            "values at the limit, with the table",
            flat.header("last", Value::void()),
        ),
        ("an empty table", Properties::default().empty_headers()),
    ] {
        let original = payload(&p);
        assert!(parsed(&original).is_some(), "{case}: lapin reads it");
        assert_eq!(content_header(&original, None, FRAME_MAX), None, "{case}");
    }
}

#[test]
fn a_header_nested_too_deep_is_removed_and_the_rest_kept() {
    let room = FRAME_MAX - 200;
    for (case, deep) in [
        (
            "tables, one past",
            Value::nested_tables(MAX_HEADER_DEPTH + 1, Value::void()),
        ),
        (
            "arrays, one past",
            Value::nested_arrays(MAX_HEADER_DEPTH + 1, Value::void()),
        ),
        ("tables, 2000", Value::nested_tables(2_000, Value::void())),
        ("arrays, 2000", Value::nested_arrays(2_000, Value::void())),
        (
            "tables, a frame of them",
            Value::nested_tables(room / 7, Value::void()),
        ),
        (
            "arrays, a frame of them",
            Value::nested_arrays(room / 5, Value::void()),
        ),
        (
            "deep inside a shallow array",
            Value::array([
                Value::long(1),
                Value::table([("x", Value::nested_arrays(3_000, Value::void()))]),
            ]),
        ),
    ] {
        let p = Properties::default()
            .message_id("m-1")
            .header("before", Value::long_string("kept"))
            .header("h", deep.clone())
            .header("x-death", x_death());
        let original = payload(&p);
        let rewritten = content_header(&original, None, FRAME_MAX).expect(case);
        // The report takes a few hundred bytes; a deep header more.
        assert!(
            rewritten.len() <= original.len() + 512
                && (deep.len() < 2_000 || rewritten.len() < original.len()),
            "{case}: {} -> {}",
            original.len(),
            rewritten.len()
        );
        let (read, pruned) = guarded(&p);
        let pruned = pruned.expect(case);
        assert_eq!(pruned.cause, Cause::TooDeep, "{case}");
        assert_eq!(pruned.removed, "\"h\"", "{case}");
        assert_eq!(pruned.digest, sha256(&[&entry(b"h", &deep)]), "{case}");
        assert!(
            pruned.detail.contains("more than 32"),
            "{case}: {}",
            pruned.detail
        );
        assert!(header(&read, "h").is_none(), "{case}");
        assert_eq!(
            header(&read, "before"),
            Some(&AMQPValue::LongString("kept".into())),
            "{case}"
        );
        assert!(header(&read, "x-death").is_some(), "{case}");
        assert_eq!(
            read.headers().as_ref().unwrap().inner().len(),
            2,
            "{case}: the marker is gone"
        );
        assert_eq!(read.message_id().as_ref().unwrap().as_str(), "m-1");
    }
}

#[test]
fn headers_past_the_value_limit_are_removed_in_order() {
    let wide = Value::array((0..MAX_HEADER_ENTRIES).map(|_| Value::void()));
    let p = Properties::default()
        .header("small", Value::long(1))
        .header("wide", wide.clone())
        .header("after", Value::long(2));
    let (read, pruned) = guarded(&p);
    let pruned = pruned.unwrap();
    assert_eq!(pruned.cause, Cause::TooMany);
    assert_eq!(pruned.removed, "\"wide\"");
    assert_eq!(pruned.digest, sha256(&[&entry(b"wide", &wide)]));
    assert!(header(&read, "small").is_some() && header(&read, "after").is_some());

    // Many small headers: those past the limit go, the first ones stay.
    let many = (0..MAX_HEADER_ENTRIES + 2).fold(Properties::default(), |p, n| {
        p.header(format!("h{n:05}"), Value::void())
    });
    let (read, pruned) = guarded(&many);
    let pruned = pruned.unwrap();
    assert_eq!(pruned.cause, Cause::TooMany);
    assert_eq!(
        read.headers().as_ref().unwrap().inner().len(),
        MAX_HEADER_ENTRIES
    );
    assert!(
        pruned.removed.starts_with("\"h10000\", \"h10001\""),
        "{}",
        pruned.removed
    );
}

#[test]
fn warrens_own_record_on_a_copy_is_not_counted() {
    // A producer's headers at the limit, with the record a retry copy adds.
    let at_limit = (0..MAX_HEADER_ENTRIES).fold(Properties::default(), |p, n| {
        p.header(format!("h{n:05}"), Value::void())
    });
    let copy = [
        "x-warren-attempt",
        "x-warren-last-error",
        "x-warren-first-failure",
        "x-warren-last-failure",
        "x-warren-original-exchange",
        "x-warren-original-routing-key",
        "x-warren-signature",
    ]
    .into_iter()
    .fold(at_limit, |p, name| p.header(name, Value::long_string("v")));
    // Back from a retry tier, with the broker's record too.
    let copy = copy
        .header("x-death", x_death())
        .header("x-first-death-queue", Value::long_string("q.retry.5s"));
    assert_eq!(content_header(&payload(&copy), None, FRAME_MAX), None);
    // Past its own budget, the record counts with the rest.
    let forged = copy.header(
        "x-warren-unverified",
        Value::array((0..MAX_RECORD_ENTRIES).map(|_| Value::void())),
    );
    let (_, pruned) = guarded(&forged);
    assert_eq!(pruned.unwrap().removed, "\"x-warren-unverified\"");
}

#[test]
fn text_that_is_not_utf8_is_replaced_byte_for_byte() {
    let p = Properties::default()
        .message_id([b'a', 0xff, 0xfe, b'b'])
        .content_type([0xc3])
        .kind("ok")
        .header("keep", Value::long(1));
    let (read, pruned) = guarded(&p);
    let pruned = pruned.unwrap();
    assert_eq!(pruned.cause, Cause::Unreadable);
    assert_eq!(read.message_id().as_ref().unwrap().as_str(), "a??b");
    assert_eq!(read.content_type().as_ref().unwrap().as_str(), "?");
    assert_eq!(read.kind().as_ref().unwrap().as_str(), "ok");
    assert!(header(&read, "keep").is_some());
    assert!(
        pruned.detail.contains("content_type, message_id"),
        "{}",
        pruned.detail
    );
    assert_eq!(pruned.digest, sha256(&[&[0xc3], &[b'a', 0xff, 0xfe, b'b']]));
    assert_eq!(pruned.removed, "");

    // Without a headers table to carry the report, one is added.
    let (read, pruned) = guarded(&Properties::default().app_id([0x80]));
    assert_eq!(pruned.unwrap().cause, Cause::Unreadable);
    assert_eq!(read.app_id().as_ref().unwrap().as_str(), "?");
}

#[test]
fn a_header_with_a_name_that_is_not_utf8_is_removed() {
    let nested = Value::table([(&[b'k', 0xff][..], Value::long(1))]);
    let p = Properties::default()
        .header([0xff, b'x'], Value::long(1))
        .header("nested", nested)
        .header("fine", Value::table([("é", Value::long(1))]));
    let (read, pruned) = guarded(&p);
    let pruned = pruned.unwrap();
    assert_eq!(pruned.cause, Cause::Unreadable);
    assert_eq!(pruned.removed, r#""\xffx", "nested""#);
    let h = read.headers().as_ref().unwrap();
    assert_eq!(
        h.inner().keys().map(|k| k.as_str()).collect::<Vec<_>>(),
        ["fine"]
    );
}

#[test]
fn a_headers_table_that_is_not_valid_amqp_goes_whole() {
    for (case, p) in [
        (
            "unknown type",
            Properties::default()
                .header("ok", Value::long(1))
                .header("bad", Value::raw(b'Z', &[0])),
        ),
        (
            "length past the table",
            Properties::default().header("bad", Value::raw(b'S', &[0, 0, 0, 200, b'x'])),
        ),
        (
            "nested length past its parent",
            Properties::default().header("bad", Value::raw(b'A', &[0, 0, 0, 5, b'A', 0, 0, 0, 9])),
        ),
    ] {
        let original = payload(&p);
        assert!(parsed(&original).is_none(), "{case}: lapin cannot read it");
        let (read, pruned) = guarded(&p);
        let pruned = pruned.expect(case);
        assert_eq!(pruned.cause, Cause::Unreadable, "{case}");
        assert!(pruned.detail.contains("not valid AMQP"), "{case}");
        assert!(
            read.headers().as_ref().unwrap().inner().is_empty(),
            "{case}"
        );
    }
}

/// A `basic.deliver` payload with the given exchange and routing key.
fn deliver(exchange: &[u8], routing_key: &[u8]) -> Vec<u8> {
    let mut out = vec![0, 60, 0, 60];
    out.push(4);
    out.extend_from_slice(b"ctag");
    out.extend_from_slice(&7u64.to_be_bytes());
    out.push(0);
    out.push(exchange.len() as u8);
    out.extend_from_slice(exchange);
    out.push(routing_key.len() as u8);
    out.extend_from_slice(routing_key);
    out
}

#[test]
fn a_routing_key_that_is_not_utf8_is_replaced_and_reported_with_the_message() {
    let mut frame = deliver(b"ex", &[b'a', b'.', 0xff]);
    let carried = method(&mut frame).expect("reported");
    assert_eq!(frame, deliver(b"ex", b"a.?"), "replaced in place");
    let p = Properties::default().message_id("m");
    let rewritten = content_header(&payload(&p), Some(carried), FRAME_MAX).unwrap();
    let mut read = parsed(&rewritten).unwrap();
    let pruned = take_pruned(&mut read).unwrap();
    assert_eq!(pruned.cause, Cause::Unreadable);
    assert!(pruned.detail.contains("routing key"), "{}", pruned.detail);
    assert_eq!(pruned.digest, sha256(&[&[b'a', b'.', 0xff]]));

    let mut fine = deliver(b"ex", b"a.b");
    assert!(method(&mut fine).is_none());
    assert_eq!(fine, deliver(b"ex", b"a.b"));
}

#[test]
fn the_rewrite_always_fits_the_frame() {
    // A bad id next to headers that fill the frame: the report would push the
    // frame past its limit, so the largest header goes too.
    let big = Value::long_string(vec![b'x'; FRAME_MAX - 200]);
    let p = Properties::default()
        .message_id([0xff])
        .header("big", big)
        .header("small", Value::long(1));
    assert!(p.frame_len() <= FRAME_MAX);
    let (read, pruned) = guarded(&p);
    let pruned = pruned.unwrap();
    assert_eq!(pruned.cause, Cause::TooMany);
    assert_eq!(pruned.removed, "\"big\"");
    assert!(header(&read, "small").is_some());
}

/// A random header value up to `depth` levels, sometimes with a name that is
/// not UTF-8: what lapin reads from it decides what the guard must do.
fn random_value(rng: &mut fastrand::Rng, depth: usize) -> Value {
    match rng.u8(0..10) {
        0 if depth > 0 => Value::array((0..rng.usize(0..4)).map(|_| random_value(rng, depth - 1))),
        1 if depth > 0 => Value::table(
            (0..rng.usize(0..4))
                .map(|n| (random_name(rng, n), random_value(rng, depth - 1)))
                .collect::<Vec<_>>(),
        ),
        2 => Value::long_string(
            (0..rng.usize(0..20))
                .map(|_| rng.u8(..))
                .collect::<Vec<_>>(),
        ),
        3 => Value::double(1.0),
        4 => Value::void(),
        5 => Value::decimal(rng.u8(..), rng.u32(..)),
        6 => Value::nested_tables(rng.usize(0..depth + 2), Value::void()),
        _ => Value::long(rng.i64(..)),
    }
}

fn random_name(rng: &mut fastrand::Rng, n: usize) -> Vec<u8> {
    let mut name = format!("k{n}").into_bytes();
    if rng.u8(0..30) == 0 {
        name.push(0xff);
    }
    name
}

#[test]
fn generated_headers_are_read_by_lapin_after_the_guard_and_untouched_when_readable() {
    let seed = fastrand::u64(..);
    let mut rng = fastrand::Rng::with_seed(seed);
    for _ in 0..400 {
        let depth = rng.usize(0..MAX_HEADER_DEPTH + 6);
        let p = (0..rng.usize(0..6)).fold(Properties::default(), |p, n| {
            p.header(random_name(&mut rng, n), random_value(&mut rng, depth))
        });
        let reserved = rng.u16(0..4);
        let original = payload(&p.clone().reserved_flags(reserved));
        match content_header(&original, None, FRAME_MAX) {
            None => {
                let read = parsed(&original);
                assert!(read.is_some(), "seed {seed}: passed unreadable");
                assert!(
                    within_limits(&read.unwrap()),
                    "seed {seed}: passed too deep"
                );
            }
            Some(rewritten) => {
                assert!(rewritten.len() <= original.len() + 1024, "seed {seed}");
                let read = parsed(&rewritten).expect("lapin reads the rewrite");
                assert!(within_limits(&read), "seed {seed}: rewrote past the limits");
                // Readable as it was, it must have been past a limit.
                if let Some(p) = parsed(&original) {
                    assert!(
                        !within_limits(&p),
                        "seed {seed}: rewrote what lapin reads safely"
                    );
                }
            }
        }
    }
}

/// Tables and arrays a value nests, itself counted (recursion is fine here:
/// the generated values stay shallow enough for a test thread).
fn depth_of(v: &AMQPValue) -> usize {
    match v {
        AMQPValue::FieldTable(t) => 1 + t.inner().values().map(depth_of).max().unwrap_or(0),
        AMQPValue::FieldArray(a) => 1 + a.as_slice().iter().map(depth_of).max().unwrap_or(0),
        _ => 0,
    }
}

fn values_of(v: &AMQPValue) -> usize {
    1 + match v {
        AMQPValue::FieldTable(t) => t.inner().values().map(values_of).sum(),
        AMQPValue::FieldArray(a) => a.as_slice().iter().map(values_of).sum(),
        _ => 0,
    }
}

#[test]
fn the_flag_bits_that_name_no_property_change_nothing() {
    // RabbitMQ takes a content header with bit 0 (a second flag word) or bit 1
    // set and passes it on as it came; lapin reads neither bit. Nor does lapin
    // look at the class: every content header is read as basic properties.
    let deep = Properties::default()
        .message_id("m")
        .header("h", Value::nested_tables(5_000, Value::void()));
    let bent = Properties::default().message_id([b'a', 0xff]);
    for bits in 1..4 {
        let (read, pruned) = guarded(&deep.clone().reserved_flags(bits));
        assert_eq!(pruned.unwrap().cause, Cause::TooDeep, "bits {bits}");
        assert!(header(&read, "h").is_none());
        let (read, pruned) = guarded(&bent.clone().reserved_flags(bits));
        assert_eq!(pruned.unwrap().cause, Cause::Unreadable, "bits {bits}");
        assert_eq!(read.message_id().as_ref().unwrap().as_str(), "a?");
    }
    let mut other_class = payload(&deep);
    other_class[..2].copy_from_slice(&20u16.to_be_bytes());
    let rewritten = content_header(&other_class, None, FRAME_MAX).expect("inspected");
    let mut read = parsed(&rewritten).unwrap();
    assert_eq!(take_pruned(&mut read).unwrap().cause, Cause::TooDeep);
}

#[test]
fn a_frame_the_broker_sent_past_the_frame_size_is_cut_to_fit() {
    // A message that filled its frame, redelivered from a quorum queue with
    // the broker's delivery count added: the count goes, without a report.
    let fill = Value::long_string(vec![b'x'; FRAME_MAX - 50]);
    let p = Properties::default().message_id("m").header("big", fill);
    let redelivered = p.clone().header("x-delivery-count", Value::long(1));
    assert!(p.frame_len() <= FRAME_MAX && redelivered.frame_len() > FRAME_MAX);
    let cut = content_header(&payload(&redelivered), None, FRAME_MAX).unwrap();
    assert!(cut.len() + 8 <= FRAME_MAX);
    let mut read = parsed(&cut).unwrap();
    assert_eq!(
        take_pruned(&mut read),
        None,
        "the broker's bookkeeping needs no report"
    );
    assert!(header(&read, "x-delivery-count").is_none());
    assert!(header(&read, "big").is_some());

    // Past it without the broker's headers to spare: the largest one goes, reported.
    let over = p.header("more", Value::long_string(vec![b'y'; 100]));
    assert!(over.frame_len() > FRAME_MAX);
    let (read, pruned) = guarded(&over);
    let pruned = pruned.unwrap();
    assert_eq!(
        (pruned.cause, pruned.removed.as_str()),
        (Cause::TooMany, "\"big\"")
    );
    assert!(header(&read, "more").is_some());
}
