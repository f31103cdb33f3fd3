use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};

use super::*;
use crate::failure::DeadLetterReason as R;

fn headers(pairs: &[(&str, AMQPValue)]) -> FieldTable {
    let mut table = FieldTable::default();
    for (k, v) in pairs {
        table.insert(ShortString::from(*k), v.clone());
    }
    table
}

fn text(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s))
}

fn chain() -> Formats {
    Formats::new()
        .then(CloudEvents::new())
        .then(WarrenEnvelope)
        .then(Bare::new())
}

fn read_in(formats: &Formats, incoming: Incoming<'_>) -> Result<Read, InvalidMessage> {
    formats.read(&incoming, 1 << 20)
}

fn refused(formats: &Formats, incoming: Incoming<'_>) -> InvalidMessage {
    read_in(formats, incoming).expect_err("should be refused")
}

const PAID: &[u8] =
    br#"{"invoiceId":"inv_1","customerId":"cus_1","amount":149.0,"currency":"USD"}"#;

#[test]
fn a_bare_payload_reads_its_properties() {
    let incoming = Incoming {
        message_id: Some("m-1"),
        content_type: Some("application/json"),
        kind: Some("billing.invoice-paid.v1"),
        correlation_id: Some("order-7"),
        timestamp: Some(1_700_000_000),
        ..Incoming::body_only(PAID)
    };
    let read = read_in(&chain(), incoming).unwrap();
    assert_eq!(read.format, "bare");
    assert_eq!(read.identity, Some(Identity::Given("m-1".into())));
    assert_eq!(read.event_type, "billing.invoice-paid.v1");
    assert_eq!(read.schema_version, 1);
    assert_eq!(read.correlation_id.as_deref(), Some("order-7"));
    assert_eq!(read.occurred_at.unwrap().timestamp(), 1_700_000_000);
    assert_eq!(read.payload.get().as_bytes(), PAID);
}

#[test]
fn a_bare_payload_without_an_id_or_a_type() {
    let no_id = Incoming {
        kind: Some("billing.invoice-paid.v1"),
        ..Incoming::body_only(PAID)
    };
    let read = read_in(&chain(), no_id).unwrap();
    assert_eq!(
        read.identity, None,
        "only a route that derives a key takes it"
    );
    assert_eq!(read.occurred_at, None);

    let no_type = Incoming {
        message_id: Some("m-1"),
        ..Incoming::body_only(PAID)
    };
    let why = refused(&chain(), no_type);
    assert_eq!(why.reason, R::InvalidBarePayload);
    assert!(why.detail.contains("type property"), "{}", why.detail);

    let no_suffix = Incoming {
        message_id: Some("m-1"),
        kind: Some("billing.invoice-paid"),
        ..Incoming::body_only(PAID)
    };
    assert_eq!(refused(&chain(), no_suffix).reason, R::InvalidBarePayload);
}

#[test]
fn a_bare_payload_takes_its_type_and_version_from_where_it_is_told() {
    let h = headers(&[
        ("event-type", text("shop.order-placed")),
        ("schema-version", AMQPValue::ShortShortInt(3)),
        ("occurred-at", text("2026-01-02T03:04:05.678Z")),
    ]);
    let incoming = Incoming {
        message_id: Some("m-1"),
        headers: Some(&h),
        ..Incoming::body_only(PAID)
    };
    let bare = Formats::new().then(
        Bare::new()
            .event_type_from(TypeFrom::Header("event-type".into()))
            .version_from(VersionFrom::Header("schema-version".into()))
            .occurred_at_header("occurred-at"),
    );
    let read = read_in(&bare, incoming).unwrap();
    assert_eq!(
        (read.event_type.as_str(), read.schema_version),
        ("shop.order-placed", 3)
    );
    assert_eq!(read.occurred_at.unwrap().timestamp_millis() % 1000, 678);

    let fixed = Formats::new().then(
        Bare::new()
            .event_type_from(TypeFrom::Fixed("shop.order-placed".into()))
            .version_from(VersionFrom::Fixed(1)),
    );
    let read = read_in(&fixed, Incoming::body_only(PAID)).unwrap();
    assert_eq!(
        (read.event_type.as_str(), read.schema_version),
        ("shop.order-placed", 1)
    );

    let by_key = Formats::new().then(Bare::new().event_type_from(TypeFrom::RoutingKey));
    let read = read_in(
        &by_key,
        Incoming {
            routing_key: "shop.order-placed.v2",
            ..Incoming::body_only(PAID)
        },
    )
    .unwrap();
    assert_eq!(read.schema_version, 2);
}

#[test]
fn a_bare_payloads_id_is_held_to_the_id_rules() {
    let long = "x".repeat(201);
    for id in [long.as_str(), "a\u{7}b"] {
        let incoming = Incoming {
            message_id: Some(id),
            kind: Some("t.v1"),
            ..Incoming::body_only(PAID)
        };
        assert_eq!(
            refused(&chain(), incoming).reason,
            R::InvalidBarePayload,
            "{id:?}"
        );
    }
}

#[test]
fn the_envelope_is_told_apart_by_its_fields() {
    let envelope = br#"{"messageId":"m-1","eventType":"t.v1","schemaVersion":1,"occurredAtUtc":"2026-01-01T00:00:00Z","correlationId":"c","payload":{"a":1}}"#;
    let incoming = Incoming {
        message_id: Some("m-1"),
        content_type: Some("application/json"),
        ..Incoming::body_only(envelope)
    };
    let read = read_in(&chain(), incoming).unwrap();
    assert_eq!(read.format, "warren");
    assert_eq!(read.payload.get(), r#"{"a":1}"#);

    // Its rules hold in any chain: no message_id, or another one, is refused.
    let no_property = Incoming {
        message_id: None,
        ..incoming
    };
    assert_eq!(refused(&chain(), no_property).reason, R::MissingMessageId);
    let other = Incoming {
        message_id: Some("m-2"),
        ..incoming
    };
    assert_eq!(refused(&chain(), other).reason, R::MessageIdMismatch);
    // Ill-typed, with every field that makes it one: still the envelope's.
    let ill_typed = br#"{"messageId":"m-1","eventType":"t.v1","schemaVersion":"one","payload":{}}"#;
    let incoming = Incoming {
        body: ill_typed,
        ..incoming
    };
    assert_eq!(refused(&chain(), incoming).reason, R::InvalidEnvelope);
    // A business object with a messageId of its own is a bare payload.
    let business = br#"{"messageId":"m-1","amount":3}"#;
    let incoming = Incoming {
        kind: Some("t.v1"),
        body: business,
        ..incoming
    };
    assert_eq!(read_in(&chain(), incoming).unwrap().format, "bare");
}

#[test]
fn the_default_refuses_as_warren_always_has() {
    let default = Formats::default();
    assert_eq!(
        refused(&default, Incoming::body_only(PAID)).reason,
        R::InvalidContentType
    );
    let json = Incoming {
        content_type: Some("application/json"),
        ..Incoming::body_only(PAID)
    };
    assert_eq!(refused(&default, json).reason, R::MissingMessageId);
    let with_id = Incoming {
        message_id: Some("m-1"),
        ..json
    };
    let why = refused(&default, with_id);
    assert_eq!(why.reason, R::InvalidEnvelope);
    assert!(why.detail.contains("messageId"), "{}", why.detail);
}

#[test]
fn a_chain_names_each_formats_refusal() {
    let no_format = Incoming {
        content_type: Some("text/plain"),
        ..Incoming::body_only(b"hello")
    };
    let why = refused(&chain(), no_format);
    assert_eq!(why.reason, R::UnrecognizedFormat);
    for name in ["not cloudevents", "not warren", "not bare"] {
        assert!(why.detail.contains(name), "{}", why.detail);
    }
}

#[test]
fn size_and_encoding_come_first_for_every_format() {
    let big = Incoming {
        kind: Some("t.v1"),
        ..Incoming::body_only(PAID)
    };
    assert_eq!(chain().read(&big, 10).unwrap_err().reason, R::BodyTooLarge);
    let gzip = Incoming {
        content_encoding: Some("gzip"),
        ..big
    };
    assert_eq!(
        refused(&chain(), gzip).reason,
        R::UnsupportedContentEncoding
    );
}

fn structured(body: &str) -> Result<Read, InvalidMessage> {
    read_in(
        &chain(),
        Incoming {
            content_type: Some("application/cloudevents+json; charset=utf-8"),
            ..Incoming::body_only(body.as_bytes())
        },
    )
}

const EVENT: &str = r#"{"specversion":"1.0","id":"e-1","source":"/billing","type":"billing.invoice-paid.v1","time":"2026-12-06T21:47:30.326155Z","datacontenttype":"application/json","data":{"invoiceId":"inv_1"}}"#;

#[test]
fn a_structured_cloudevent() {
    let read = structured(EVENT).unwrap();
    assert_eq!(read.format, "cloudevents");
    assert_eq!(
        read.identity,
        Some(Identity::CloudEvent {
            source: "/billing".into(),
            id: "e-1".into()
        })
    );
    assert_eq!(
        (read.event_type.as_str(), read.schema_version),
        ("billing.invoice-paid.v1", 1)
    );
    assert_eq!(read.occurred_at.unwrap().timestamp_subsec_micros(), 326_155);
    assert_eq!(read.payload.get(), r#"{"invoiceId":"inv_1"}"#);
}

#[test]
fn a_binary_cloudevent_under_each_prefix() {
    for prefix in ["ce-", "cloudEvents_", "cloudEvents:"] {
        let h = headers(&[
            (&format!("{prefix}specversion"), text("1.0")),
            (&format!("{prefix}id"), text("e-1")),
            (&format!("{prefix}source"), text("/billing")),
            (&format!("{prefix}type"), text("billing.invoice-paid.v2")),
            (&format!("{prefix}correlationid"), text("order-7")),
            (
                &format!("{prefix}time"),
                AMQPValue::Timestamp(1_700_000_000),
            ),
        ]);
        let incoming = Incoming {
            content_type: Some("application/json"),
            headers: Some(&h),
            ..Incoming::body_only(PAID)
        };
        let read = read_in(&chain(), incoming).unwrap();
        assert_eq!(read.format, "cloudevents", "{prefix}");
        assert_eq!(read.schema_version, 2);
        assert_eq!(read.correlation_id.as_deref(), Some("order-7"));
        assert_eq!(read.occurred_at.unwrap().timestamp(), 1_700_000_000);
        assert_eq!(read.payload.get().as_bytes(), PAID);
    }
}

#[test]
fn hostile_cloudevents_are_refused_naming_the_format() {
    let cases = [
        (
            EVENT.replace(r#""id":"e-1""#, &format!(r#""id":"{}""#, "x".repeat(201))),
            "id",
        ),
        (
            EVENT.replace(r#""id":"e-1""#, r#""id":"e\u0000""#),
            "control",
        ),
        (
            EVENT.replace(r#""source":"/billing""#, r#""source":"""#),
            "source",
        ),
        (
            EVENT.replace(r#""specversion":"1.0""#, r#""specversion":"0.3""#),
            "specversion",
        ),
        (
            EVENT.replace(r#""data":{"invoiceId":"inv_1"}"#, r#""data_base64":"aGk=""#),
            "data_base64",
        ),
        (
            EVENT.replace("application/json", "text/plain"),
            "datacontenttype",
        ),
        (EVENT.replace(r#""id":"e-1","#, ""), "\"id\""),
        (EVENT.replace(r#""id":"e-1""#, r#""id":7"#), "string"),
        (
            EVENT.replace(r#""id":"e-1""#, r#""id":"e-1","id":"e-2""#),
            "twice",
        ),
        (
            EVENT.replace("2026-12-06T21:47:30.326155Z", "yesterday"),
            "time",
        ),
        (
            EVENT.replace(
                r#""type":"billing.invoice-paid.v1""#,
                r#""type":"billing.invoice-paid""#,
            ),
            "suffix",
        ),
        ("{not json".to_owned(), "structured"),
    ];
    for (body, says) in cases {
        let why = structured(&body).expect_err(&body);
        assert_eq!(why.reason, R::InvalidCloudEvent, "{body}");
        assert!(why.detail.contains(says), "{says}: {}", why.detail);
    }
}

#[test]
fn hostile_binary_cloudevents_are_refused() {
    let base = [
        ("ce-specversion", text("1.0")),
        ("ce-id", text("e-1")),
        ("ce-source", text("/billing")),
        ("ce-type", text("billing.invoice-paid.v1")),
    ];
    let with = |extra: &[(&str, AMQPValue)]| {
        let mut pairs: Vec<(&str, AMQPValue)> = base.to_vec();
        for (k, v) in extra {
            pairs.retain(|(n, _)| n != k);
            pairs.push((k, v.clone()));
        }
        headers(&pairs)
    };
    let two_prefixes = with(&[("cloudEvents:id", text("e-2"))]);
    let same_twice = with(&[("cloudEvents_id", text("e-1"))]);
    let ill_typed = with(&[("ce-id", AMQPValue::Boolean(true))]);
    // Headers, content type, body, and what the refusal says (`None`: read).
    type Case<'a> = (&'a FieldTable, Option<&'a str>, &'a [u8], Option<&'a str>);
    let cases: [Case<'_>; 5] = [
        (&two_prefixes, Some("application/json"), PAID, Some("twice")),
        (&same_twice, Some("application/json"), PAID, None),
        (
            &ill_typed,
            Some("application/json"),
            PAID,
            Some("not a string"),
        ),
        (
            &with(&[]),
            Some("application/json"),
            b"{not json",
            Some("not JSON"),
        ),
        (
            &with(&[]),
            Some("application/xml"),
            b"<a/>",
            Some("datacontenttype"),
        ),
    ];
    for (h, ct, body, says) in cases {
        let incoming = Incoming {
            content_type: ct,
            headers: Some(h),
            ..Incoming::body_only(body)
        };
        match (read_in(&chain(), incoming), says) {
            (Ok(read), None) => assert_eq!(read.format, "cloudevents"),
            (Err(why), Some(says)) => {
                assert_eq!(why.reason, R::InvalidCloudEvent);
                assert!(why.detail.contains(says), "{says}: {}", why.detail);
            }
            (other, says) => panic!("{says:?}: {other:?}"),
        }
    }
}

#[test]
fn a_structured_content_type_wins_over_headers_beside_it() {
    let h = headers(&[
        ("ce-specversion", text("1.0")),
        ("ce-id", text("from-a-header")),
        ("ce-source", text("/elsewhere")),
        ("ce-type", text("other.v9")),
    ]);
    let incoming = Incoming {
        content_type: Some("application/cloudevents+json"),
        headers: Some(&h),
        ..Incoming::body_only(EVENT.as_bytes())
    };
    let read = read_in(&chain(), incoming).unwrap();
    assert_eq!(read.event_type, "billing.invoice-paid.v1");
    assert_eq!(
        read.identity,
        Some(Identity::CloudEvent {
            source: "/billing".into(),
            id: "e-1".into()
        })
    );
}

#[test]
fn identities_never_meet_across_namespaces() {
    let event = Identity::CloudEvent {
        source: "/a".into(),
        id: "b".into(),
    };
    let shifted = Identity::CloudEvent {
        source: "/a".into(),
        id: "b".into(),
    };
    assert_eq!(event.key(), shifted.key(), "the key is stable");
    let other = Identity::CloudEvent {
        source: "/ab".into(),
        id: String::new(),
    };
    assert_ne!(
        event.key(),
        other.key(),
        "length-prefixed: no shift between the parts"
    );
    let keys = [
        Identity::Given(event.key()).key(),
        event.key(),
        Identity::Derived("inv_1:paid".into()).key(),
        Identity::Given("~key:inv_1:paid".into()).key(),
        Identity::Given("inv_1:paid".into()).key(),
    ];
    let distinct: std::collections::HashSet<_> = keys.iter().collect();
    assert_eq!(distinct.len(), keys.len(), "{keys:?}");
    // Every key fits the stores' 255-byte column.
    let longest = Identity::Derived("k".repeat(200)).key();
    assert!(longest.len() <= 255);
}

#[test]
#[should_panic(expected = "listed twice")]
fn a_format_listed_twice_is_a_programming_error() {
    let _ = Formats::new().then(Bare::new()).then(Bare::new());
}

fn frameworks() -> Formats {
    Formats::new()
        .then(CloudEvents::new())
        .then(
            MassTransit::new()
                .message_type(
                    "urn:message:Billing.Contracts:IInvoiceEvent",
                    "billing.any",
                    9,
                )
                .message_type(
                    "urn:message:Billing.Contracts:InvoicePaid",
                    "billing.invoice-paid",
                    1,
                ),
        )
        .then(NServiceBus::new().message_type(
            "Billing.Contracts.InvoicePaid",
            "billing.invoice-paid",
            1,
        ))
        .then(SpringAmqp::new().type_id(
            "com.example.billing.InvoicePaid",
            "billing.invoice-paid",
            1,
        ))
        .then(WarrenEnvelope)
        .then(Bare::new())
}

/// A MassTransit envelope as its System.Text.Json serializer writes one.
fn masstransit_body(message_type: &str) -> String {
    format!(
        r#"{{"messageId":"00010000-ac12-0242-d4c8-08dd1e3b7a11",
        "correlationId":"2f1e0000-0000-0000-0000-000000000001",
        "conversationId":"00010000-ac12-0242-d4c9-08dd1e3b7a11",
        "initiatorId":"00010000-ac12-0242-aaaa-08dd1e3b7a11",
        "sourceAddress":"rabbitmq://localhost/shop",
        "destinationAddress":"rabbitmq://localhost/Billing.Contracts:InvoicePaid",
        "messageType":{message_type},
        "message":{paid},
        "sentTime":"2026-12-07T09:23:14.3184567Z",
        "headers":{{}},
        "host":{{"machineName":"shop-1","processName":"Shop","processId":4242,
                 "assembly":"Shop","assemblyVersion":"1.0.0.0",
                 "frameworkVersion":"8.0.11","massTransitVersion":"8.3.4.0",
                 "operatingSystemVersion":"Unix 6.1"}}}}"#,
        paid = std::str::from_utf8(PAID).unwrap()
    )
}

#[test]
fn a_masstransit_envelope_maps_its_first_known_urn() {
    let body = masstransit_body(
        r#"["urn:message:Billing.Contracts:InvoicePaid","urn:message:Billing.Contracts:IInvoiceEvent"]"#,
    );
    let incoming = Incoming {
        message_id: Some("00010000-ac12-0242-d4c8-08dd1e3b7a11"),
        content_type: Some("application/vnd.masstransit+json"),
        ..Incoming::body_only(body.as_bytes())
    };
    let read = read_in(&frameworks(), incoming).unwrap();
    assert_eq!(read.format, "masstransit");
    assert_eq!(
        read.identity,
        Some(Identity::Given(
            "00010000-ac12-0242-d4c8-08dd1e3b7a11".into()
        ))
    );
    assert_eq!(
        (read.event_type.as_str(), read.schema_version),
        ("billing.invoice-paid", 1)
    );
    assert_eq!(
        read.correlation_id.as_deref(),
        Some("00010000-ac12-0242-d4c9-08dd1e3b7a11"),
        "the conversation is the flow"
    );
    assert_eq!(
        read.causation_id.as_deref(),
        Some("00010000-ac12-0242-aaaa-08dd1e3b7a11")
    );
    assert_eq!(
        read.occurred_at.unwrap().to_rfc3339(),
        "2026-12-07T09:23:14.318456700+00:00"
    );
    assert_eq!(read.payload.get().as_bytes(), PAID);
}

#[test]
fn hostile_masstransit_envelopes_are_refused_naming_the_format() {
    let mt = |body: &str, id: Option<&'static str>| -> InvalidMessage {
        let body = body.to_owned().into_bytes();
        let incoming = Incoming {
            message_id: id,
            content_type: Some("application/vnd.masstransit+json"),
            ..Incoming::body_only(&body)
        };
        refused(&frameworks(), incoming)
    };
    let unknown = mt(
        &masstransit_body(r#"["urn:message:Shop:OrderPlaced"]"#),
        None,
    );
    assert_eq!(unknown.reason, R::InvalidMassTransit);
    assert!(
        unknown.detail.contains("urn:message:Shop:OrderPlaced"),
        "{unknown}"
    );
    assert_eq!(
        mt(&masstransit_body("[]"), None).reason,
        R::InvalidMassTransit
    );
    assert_eq!(
        mt(
            &masstransit_body(r#""urn:message:Billing.Contracts:InvoicePaid""#),
            None
        )
        .reason,
        R::InvalidMassTransit,
        "messageType is a list"
    );
    let mismatch = mt(
        &masstransit_body(r#"["urn:message:Billing.Contracts:InvoicePaid"]"#),
        Some("another-id"),
    );
    assert_eq!(mismatch.reason, R::MessageIdMismatch);
    for body in [
        r#"{"messageType":["urn:message:Billing.Contracts:InvoicePaid"],"message":{}}"#,
        r#"{"messageId":"","messageType":["urn:message:Billing.Contracts:InvoicePaid"],"message":{}}"#,
        r#"{"messageId":"m\u0000","messageType":["urn:message:Billing.Contracts:InvoicePaid"],"message":{}}"#,
        r#"{"messageId":"m-1","messageType":["urn:message:Billing.Contracts:InvoicePaid"]}"#,
        r#"{"messageId":"m-1","messageType":["urn:message:Billing.Contracts:InvoicePaid"],"message":{},"sentTime":"yesterday"}"#,
        r#"{"messageId":"m-1","messageType":["urn:message:Billing.Contracts:InvoicePaid"],"message":{},"conversationId":"a\nb"}"#,
        r#"[1,2]"#,
        r#"{"messageId":"m-1""#,
    ] {
        let why = mt(body, None);
        assert_eq!(why.reason, R::InvalidMassTransit, "{body}: {why}");
    }
    let long = format!(
        r#"{{"messageId":"{}","messageType":["urn:message:Billing.Contracts:InvoicePaid"],"message":{{}}}}"#,
        "m".repeat(201)
    );
    assert_eq!(mt(&long, None).reason, R::InvalidMassTransit);
    // Alone, a consumer of MassTransit refuses other content types as such.
    let alone = Formats::new().then(MassTransit::new());
    assert_eq!(
        refused(&alone, Incoming::body_only(PAID)).reason,
        R::InvalidContentType
    );
}

fn nservicebus_headers(types: &str) -> FieldTable {
    headers(&[
        (
            "NServiceBus.MessageId",
            text("8a0c5d4e-7b2f-4c1e-9a3b-b2a100000001"),
        ),
        ("NServiceBus.EnclosedMessageTypes", text(types)),
        ("NServiceBus.ContentType", text("application/json")),
        ("NServiceBus.TimeSent", text("2026-12-07 09:23:14:318456 Z")),
        ("NServiceBus.ConversationId", text("conv-1")),
        ("NServiceBus.RelatedTo", text("cause-1")),
        ("NServiceBus.MessageIntent", text("Publish")),
        ("NServiceBus.Version", text("9.2.3")),
    ])
}

#[test]
fn an_nservicebus_message_maps_its_first_known_type() {
    let table = nservicebus_headers(
        "Billing.Contracts.InvoicePaid, Billing.Contracts, Version=1.0.0.0, Culture=neutral, PublicKeyToken=null;\
         Billing.Contracts.IInvoiceEvent, Billing.Contracts, Version=1.0.0.0, Culture=neutral, PublicKeyToken=null",
    );
    let incoming = Incoming {
        message_id: Some("8a0c5d4e-7b2f-4c1e-9a3b-b2a100000001"),
        headers: Some(&table),
        ..Incoming::body_only(PAID)
    };
    let read = read_in(&frameworks(), incoming).unwrap();
    assert_eq!(read.format, "nservicebus");
    assert_eq!(
        read.identity,
        Some(Identity::Given(
            "8a0c5d4e-7b2f-4c1e-9a3b-b2a100000001".into()
        ))
    );
    assert_eq!(
        (read.event_type.as_str(), read.schema_version),
        ("billing.invoice-paid", 1)
    );
    assert_eq!(read.correlation_id.as_deref(), Some("conv-1"));
    assert_eq!(read.causation_id.as_deref(), Some("cause-1"));
    assert_eq!(
        read.occurred_at.unwrap().to_rfc3339(),
        "2026-12-07T09:23:14.318456+00:00"
    );
    assert_eq!(read.payload.get().as_bytes(), PAID);
}

#[test]
fn hostile_nservicebus_messages_are_refused_naming_the_format() {
    let nsb = |table: &FieldTable, body: &'static [u8], id: Option<&'static str>| {
        let incoming = Incoming {
            message_id: id,
            headers: Some(table),
            ..Incoming::body_only(body)
        };
        refused(&frameworks(), incoming)
    };
    let known = "Billing.Contracts.InvoicePaid, Billing.Contracts";
    let unknown = nsb(&nservicebus_headers("Shop.OrderPlaced, Shop"), PAID, None);
    assert_eq!(unknown.reason, R::InvalidNServiceBus);
    assert!(unknown.detail.contains("Shop.OrderPlaced"), "{unknown}");
    assert_eq!(
        nsb(&nservicebus_headers(known), PAID, Some("other")).reason,
        R::MessageIdMismatch
    );
    assert_eq!(
        nsb(&nservicebus_headers(known), b"<InvoicePaid/>", None).reason,
        R::InvalidNServiceBus,
        "not JSON"
    );
    let mut xml = nservicebus_headers(known);
    xml.insert("NServiceBus.ContentType".into(), text("text/xml"));
    assert_eq!(nsb(&xml, PAID, None).reason, R::InvalidNServiceBus);
    let mut late = nservicebus_headers(known);
    late.insert("NServiceBus.TimeSent".into(), text("2026-12-07T09:23:14Z"));
    assert_eq!(nsb(&late, PAID, None).reason, R::InvalidNServiceBus);
    let mut no_id = nservicebus_headers(known);
    no_id.insert("NServiceBus.MessageId".into(), text(""));
    assert_eq!(nsb(&no_id, PAID, None).reason, R::InvalidNServiceBus);
    let mut not_text = nservicebus_headers(known);
    not_text.insert(
        "NServiceBus.EnclosedMessageTypes".into(),
        AMQPValue::LongInt(7),
    );
    assert_eq!(nsb(&not_text, PAID, None).reason, R::InvalidNServiceBus);
}

#[test]
fn a_spring_message_maps_its_type_id() {
    let table = headers(&[("__TypeId__", text("com.example.billing.InvoicePaid"))]);
    let incoming = Incoming {
        content_type: Some("application/json"),
        // Spring's converter names the charset here.
        content_encoding: Some("UTF-8"),
        headers: Some(&table),
        timestamp: Some(1_700_000_000),
        ..Incoming::body_only(PAID)
    };
    let read = read_in(&frameworks(), incoming).unwrap();
    assert_eq!(read.format, "spring");
    assert_eq!(read.identity, None, "Spring sends no id unless told to");
    assert_eq!(
        (read.event_type.as_str(), read.schema_version),
        ("billing.invoice-paid", 1)
    );
    assert_eq!(read.occurred_at.unwrap().timestamp(), 1_700_000_000);

    let unknown = headers(&[("__TypeId__", text("com.example.shop.OrderPlaced"))]);
    let why = refused(
        &frameworks(),
        Incoming {
            message_id: Some("m-1"),
            headers: Some(&unknown),
            ..Incoming::body_only(PAID)
        },
    );
    assert_eq!(why.reason, R::InvalidSpringMessage);
    assert!(why.detail.contains("com.example.shop.OrderPlaced"), "{why}");
    let why = refused(
        &frameworks(),
        Incoming {
            message_id: Some("m-1"),
            headers: Some(&table),
            ..Incoming::body_only(b"not json")
        },
    );
    assert_eq!(why.reason, R::InvalidSpringMessage);
}

#[test]
#[should_panic(expected = "mapped twice")]
fn a_type_mapped_twice_is_a_programming_error() {
    let _ = SpringAmqp::new()
        .type_id("a.B", "x", 1)
        .type_id("a.B", "y", 2);
}
