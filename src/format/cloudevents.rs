//! CloudEvents 1.0 over AMQP 0-9-1, in both modes:
//! - structured: content type `application/cloudevents+json`, the body a
//!   JSON object of the attributes and `data`;
//! - binary: the attributes in headers, the body the data. Header names are
//!   `ce-` and the attribute (Knative's RabbitMQ binding, which the
//!   CloudEvents SDKs implement), or the AMQP 1.0 binding's `cloudEvents_`
//!   and `cloudEvents:`, which reach a 0-9-1 consumer when an AMQP 1.0
//!   producer publishes through RabbitMQ 4 (its `time` then an AMQP
//!   timestamp in whole seconds).

use std::borrow::Cow;
use std::fmt;

use chrono::{DateTime, Utc};
use lapin::types::AMQPValue;
use serde::Deserialize;
use serde::de::{Deserializer, MapAccess, Visitor};
use serde_json::value::RawValue;

use super::InvalidMessage;
use super::bare::{VersionFrom, time_value};
use super::{
    Format, Identity, Incoming, Read, Refusal, check_id, check_short, essence, json_content_type,
    version_suffix,
};
use crate::failure::DeadLetterReason as R;

/// The structured mode's content type.
pub const CONTENT_TYPE_STRUCTURED: &str = "application/cloudevents+json";

/// The header prefixes binary mode's attributes may come under.
const PREFIXES: [&str; 3] = ["ce-", "cloudEvents_", "cloudEvents:"];

/// CloudEvents 1.0, structured and binary mode. The identity is `source`
/// and `id` together (see [`Identity::CloudEvent`]); `type` is the event
/// type; the schema version its `.vN` suffix unless
/// [`version_from`](Self::version_from) says otherwise; `time` occurred-at;
/// the extension attributes `correlationid` and `causationid`, if sent, the
/// correlation and causation ids. The data must be JSON
/// (`datacontenttype` absent, `application/json` or a `+json` type);
/// `data_base64` is refused.
#[derive(Debug, Clone)]
pub struct CloudEvents {
    version: VersionFrom,
}

impl CloudEvents {
    /// Version from the type's `.vN` suffix.
    pub fn new() -> Self {
        Self {
            version: VersionFrom::TypeSuffix,
        }
    }

    /// Where the schema version comes from: the type's suffix, an extension
    /// attribute ([`VersionFrom::Header`] names it), or fixed.
    pub fn version_from(mut self, from: VersionFrom) -> Self {
        self.version = from;
        self
    }
}

impl Default for CloudEvents {
    fn default() -> Self {
        Self::new()
    }
}

/// An attribute's value as the message carried it.
#[derive(Clone, Copy)]
enum Value<'a> {
    /// Structured mode: a JSON value.
    Json(&'a RawValue),
    /// Binary mode: a header value, and the header's name.
    Header(&'a AMQPValue, &'a str),
}

impl Value<'_> {
    /// The value as text; `Err` says what it is instead.
    fn text(&self, attribute: &str) -> Result<String, InvalidMessage> {
        let text = match self {
            Value::Json(raw) => serde_json::from_str::<String>(raw.get()).ok(),
            Value::Header(AMQPValue::LongString(s), _) => {
                std::str::from_utf8(s.as_bytes()).ok().map(str::to_owned)
            }
            Value::Header(AMQPValue::ShortString(s), _) => Some(s.as_str().to_owned()),
            Value::Header(..) => None,
        };
        text.ok_or_else(|| invalid(format!("{} is not a string", self.named(attribute))))
    }

    fn named(&self, attribute: &str) -> String {
        match self {
            Value::Json(_) => format!("attribute {attribute:?}"),
            Value::Header(_, header) => format!("header {header:?}"),
        }
    }

    /// The same value as `other`, whatever the header type.
    fn same_as(&self, other: &Value<'_>) -> bool {
        match (self, other) {
            (Value::Header(a, _), Value::Header(b, _)) => {
                a == b || {
                    let (a, b) = (self.text(""), other.text(""));
                    a.is_ok() && a == b
                }
            }
            _ => false,
        }
    }
}

fn invalid(detail: String) -> InvalidMessage {
    InvalidMessage::new(R::InvalidCloudEvent, detail)
}

/// The attributes of one event, whichever mode it came in.
struct Attributes<'a> {
    values: Vec<(Cow<'a, str>, Value<'a>)>,
}

impl<'a> Attributes<'a> {
    fn get(&self, name: &str) -> Option<Value<'a>> {
        self.values.iter().find(|(n, _)| n == name).map(|(_, v)| *v)
    }

    fn text(&self, name: &str) -> Result<Option<String>, InvalidMessage> {
        self.get(name).map(|v| v.text(name)).transpose()
    }

    fn required(&self, name: &str) -> Result<String, InvalidMessage> {
        self.text(name)?
            .ok_or_else(|| invalid(format!("the required attribute {name:?} is missing")))
    }

    /// Binary mode: every header under one of the prefixes, the same
    /// attribute under two prefixes refused unless both say the same.
    fn from_headers(incoming: &Incoming<'a>) -> Result<Self, InvalidMessage> {
        let mut values: Vec<(Cow<'a, str>, Value<'a>)> = Vec::new();
        let Some(headers) = incoming.headers else {
            return Ok(Self { values });
        };
        for (header, value) in headers.inner() {
            let header = header.as_str();
            let Some(name) = PREFIXES.iter().find_map(|p| header.strip_prefix(p)) else {
                continue;
            };
            let value = Value::Header(value, header);
            if let Some((_, earlier)) = values.iter().find(|(n, _)| n == name) {
                if !earlier.same_as(&value) {
                    return Err(invalid(format!(
                        "attribute {name:?} is sent twice with different values ({} and {})",
                        earlier.named(name),
                        value.named(name)
                    )));
                }
                continue;
            }
            values.push((Cow::Borrowed(name), value));
        }
        Ok(Self { values })
    }
}

/// Structured mode: the body's members, in order, a member named twice
/// refused (a JSON map would silently keep the last).
struct Members<'a>(Vec<(Cow<'a, str>, &'a RawValue)>);

impl<'de: 'a, 'a> Deserialize<'de> for Members<'a> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Walk<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for Walk<'a> {
            type Value = Members<'a>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object (a structured CloudEvent)")
            }
            fn visit_map<M: MapAccess<'de>>(self, mut map: M) -> Result<Self::Value, M::Error> {
                let mut members: Vec<(Cow<'a, str>, &'a RawValue)> = Vec::new();
                while let Some(name) = map.next_key::<Cow<'a, str>>()? {
                    if members.iter().any(|(n, _)| *n == name) {
                        return Err(serde::de::Error::custom(format_args!(
                            "member {name:?} appears twice"
                        )));
                    }
                    let value: &'a RawValue = map.next_value()?;
                    members.push((name, value));
                }
                Ok(Members(members))
            }
        }
        deserializer.deserialize_map(Walk(std::marker::PhantomData))
    }
}

impl Format for CloudEvents {
    fn name(&self) -> &'static str {
        "cloudevents"
    }

    fn read(&self, incoming: &Incoming<'_>) -> Result<Read, Refusal> {
        let structured = incoming
            .content_type
            .map(essence)
            .is_some_and(|e| e == CONTENT_TYPE_STRUCTURED);
        let result = if structured {
            self.structured(incoming)
        } else {
            let attributes = Attributes::from_headers(incoming).map_err(Refusal::Invalid)?;
            if attributes.get("specversion").is_none() {
                return Err(Refusal::NotMine(invalid(format!(
                    "neither content type {CONTENT_TYPE_STRUCTURED:?} nor a ce-specversion header"
                ))));
            }
            self.binary(incoming, &attributes)
        };
        result.map_err(Refusal::Invalid)
    }
}

impl CloudEvents {
    fn structured(&self, incoming: &Incoming<'_>) -> Result<Read, InvalidMessage> {
        if let Some(ct) = incoming.content_type {
            super::charset_utf8(ct.split(';').skip(1), ct).map_err(invalid)?;
        }
        let members: Members<'_> = serde_json::from_slice(incoming.body)
            .map_err(|e| invalid(format!("the body is not a structured CloudEvent: {e}")))?;
        let attributes = Attributes {
            values: members
                .0
                .iter()
                .map(|(n, v)| (n.clone(), Value::Json(v)))
                .collect(),
        };
        if attributes.get("data_base64").is_some() {
            return Err(invalid(
                "data_base64: the data is binary; warren reads JSON data only".into(),
            ));
        }
        if let Some(ct) = attributes.text("datacontenttype")? {
            json_content_type(&ct).map_err(|why| invalid(format!("datacontenttype: {why}")))?;
        }
        let payload = match members.0.iter().find(|(n, _)| n == "data") {
            Some((_, data)) => (*data).to_owned(),
            None => null(),
        };
        let time = match attributes.get("time") {
            None => None,
            Some(v) => Some(rfc3339(&v.text("time")?)?),
        };
        self.finish(&attributes, time, payload)
    }

    fn binary(
        &self,
        incoming: &Incoming<'_>,
        attributes: &Attributes<'_>,
    ) -> Result<Read, InvalidMessage> {
        let content_type = match (attributes.text("datacontenttype")?, incoming.content_type) {
            (Some(header), Some(property)) if header != property => {
                return Err(invalid(format!(
                    "datacontenttype {header:?} differs from the content type {property:?}"
                )));
            }
            (header, property) => header.or_else(|| property.map(str::to_owned)),
        };
        if let Some(ct) = content_type.filter(|ct| !ct.is_empty()) {
            json_content_type(&ct).map_err(|why| invalid(format!("datacontenttype: {why}")))?;
        }
        let payload = if incoming.body.iter().all(u8::is_ascii_whitespace) {
            null()
        } else {
            super::json_body(incoming.body)
                .map_err(|e| invalid(format!("the data is not JSON: {e}")))?
        };
        let time = match attributes.get("time") {
            None => None,
            Some(Value::Header(v @ AMQPValue::Timestamp(_), header)) => Some(
                time_value(v)
                    .ok_or_else(|| invalid(format!("header {header:?} is out of range")))?,
            ),
            Some(v) => Some(rfc3339(&v.text("time")?)?),
        };
        self.finish(attributes, time, payload)
    }

    /// What both modes share: the required attributes, their rules, the
    /// version and the identity.
    fn finish(
        &self,
        attributes: &Attributes<'_>,
        time: Option<DateTime<Utc>>,
        payload: Box<RawValue>,
    ) -> Result<Read, InvalidMessage> {
        let specversion = attributes.required("specversion")?;
        if specversion != "1.0" {
            return Err(invalid(format!(
                "specversion is {:?}; warren reads CloudEvents 1.0",
                crate::amqp::truncate(&specversion, 32)
            )));
        }
        let id = attributes.required("id")?;
        check_id("id", &id, R::InvalidCloudEvent)?;
        let source = attributes.required("source")?;
        check_id("source", &source, R::InvalidCloudEvent)?;
        let event_type = attributes.required("type")?;
        if event_type.is_empty() {
            return Err(invalid("type is empty".into()));
        }
        check_short("type", &event_type, R::InvalidCloudEvent)?;
        let schema_version = match &self.version {
            VersionFrom::TypeSuffix => version_suffix(&event_type).ok_or_else(|| {
                invalid(format!(
                    "no schema version: type {:?} has no .vN suffix (name another source: CloudEvents::version_from)",
                    crate::amqp::truncate(&event_type, 100)
                ))
            })?,
            VersionFrom::Fixed(v) => *v,
            VersionFrom::Header(name) => {
                let value = attributes
                    .get(name)
                    .ok_or_else(|| invalid(format!("no schema version: no attribute {name:?}")))?;
                let number = match value {
                    Value::Json(raw) => serde_json::from_str::<u32>(raw.get()).ok(),
                    Value::Header(v, _) => crate::amqp::int_value(v).and_then(|n| u32::try_from(n).ok()),
                };
                match number {
                    Some(n) => n,
                    None => value
                        .text(name)?
                        .trim()
                        .parse()
                        .map_err(|_| invalid(format!("attribute {name:?} is not a whole number")))?,
                }
            }
        };
        let mut read = Read::new("cloudevents", event_type, schema_version, payload);
        read.identity = Some(Identity::CloudEvent { source, id });
        read.occurred_at = time;
        for (attribute, slot) in [
            ("correlationid", &mut read.correlation_id),
            ("causationid", &mut read.causation_id),
        ] {
            if let Some(value) = attributes.text(attribute)?.filter(|v| !v.is_empty()) {
                check_short(attribute, &value, R::InvalidCloudEvent)?;
                *slot = Some(value);
            }
        }
        Ok(read)
    }
}

fn null() -> Box<RawValue> {
    RawValue::from_string("null".into()).expect("null is JSON")
}

fn rfc3339(text: &str) -> Result<DateTime<Utc>, InvalidMessage> {
    DateTime::parse_from_rfc3339(text)
        .map(|t| t.with_timezone(&Utc))
        .map_err(|_| {
            invalid(format!(
                "time {:?} is not an RFC 3339 timestamp",
                crate::amqp::truncate(text, 64)
            ))
        })
}
