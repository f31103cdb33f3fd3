//! What leaves: an envelope built for publishing, with its AMQP properties.

use chrono::{DateTime, SecondsFormat, Utc};
use lapin::BasicProperties;
use lapin::types::ShortString;
use serde::Serialize;
use serde_json::value::RawValue;

use crate::amqp::{MAX_SHORT_STRING_LEN, PERSISTENT};
use crate::envelope::{CONTENT_TYPE_JSON, MAX_MESSAGE_ID_LEN, Metadata};
use crate::format::Identity;
use crate::headers::{HEADER_BAGGAGE, HEADER_TRACEPARENT, HEADER_TRACESTATE};
use crate::trace_context::TraceContext;

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct WireOut<'a> {
    message_id: &'a str,
    event_type: &'a str,
    schema_version: u32,
    occurred_at_utc: String,
    correlation_id: &'a str,
    causation_id: Option<&'a str>,
    payload: &'a RawValue,
}

/// A message ready to publish: envelope body plus the AMQP properties that go with it.
///
/// The message id is a UUIDv7 fixed at construction, so every publish attempt of
/// this value carries the same id and downstream inboxes can deduplicate it.
///
/// ```
/// use warren::Outgoing;
/// #[derive(serde::Serialize)]
/// struct InvoicePaid { invoice_id: String }
///
/// let msg = Outgoing::new("billing.invoice-paid.v1", 1, &InvoicePaid { invoice_id: "inv_1".into() })?;
/// let props = msg.properties();
/// assert_eq!(props.message_id().as_ref().map(|s| s.as_str()), Some(msg.meta().message_id.as_str()));
/// assert_eq!(msg.meta().correlation_id, msg.meta().message_id); // a new flow starts here
/// # Ok::<(), serde_json::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct Outgoing {
    meta: Metadata,
    payload: Box<RawValue>,
    /// Headers sent as AMQP long strings (the partition key among them).
    headers: std::collections::BTreeMap<String, String>,
    /// The W3C trace context it continues, checked; sent as the
    /// `traceparent`, `tracestate` and `baggage` headers.
    trace: TraceContext,
    /// The correlation id was given (or carried from a cause), not the
    /// message's own id by default.
    correlation_given: bool,
}

impl Outgoing {
    /// A new message that starts a flow: fresh UUIDv7 id, occurred now, correlation
    /// id equal to its own id, no causation id.
    pub fn new<T: Serialize + ?Sized>(
        event_type: impl Into<String>,
        schema_version: u32,
        payload: &T,
    ) -> Result<Self, serde_json::Error> {
        let id = uuid::Uuid::now_v7().to_string();
        Ok(Self {
            meta: Metadata {
                message_id: id.clone(),
                identity: Identity::Given(id.clone()),
                format: "warren",
                event_type: event_type.into(),
                schema_version,
                occurred_at: Some(Utc::now()),
                correlation_id: id,
                causation_id: None,
            },
            payload: serde_json::value::to_raw_value(payload)?,
            headers: std::collections::BTreeMap::new(),
            trace: TraceContext::default(),
            correlation_given: false,
        })
    }

    /// Marks this message as caused by `cause`: the correlation id is carried over
    /// and the causation id is the cause's message id.
    pub fn caused_by(mut self, cause: &Metadata) -> Self {
        self.meta.correlation_id = cause.correlation_id.clone();
        self.correlation_given = true;
        self.meta.causation_id = Some(cause.message_id.clone());
        self
    }

    /// Sets the correlation id explicitly.
    pub fn with_correlation_id(mut self, id: impl Into<String>) -> Self {
        self.meta.correlation_id = id.into();
        self.correlation_given = true;
        self
    }

    /// Overrides the message id. Use only to carry an id that already exists (for
    /// example one stored in an outbox row, or one derived from a business
    /// fact); new messages get a UUIDv7. A message that starts a flow is its
    /// own correlation id, so the correlation id follows, unless one was set
    /// with [`with_correlation_id`](Self::with_correlation_id) or
    /// [`caused_by`](Self::caused_by), before or after.
    ///
    /// ```
    /// # use warren::Outgoing;
    /// let msg = Outgoing::new("billing.invoice-paid.v1", 1, &serde_json::json!({}))?
    ///     .with_message_id("inv_1:paid");
    /// assert_eq!(msg.meta().correlation_id, "inv_1:paid");
    /// let msg = Outgoing::new("billing.invoice-paid.v1", 1, &serde_json::json!({}))?
    ///     .with_correlation_id("order-7")
    ///     .with_message_id("inv_1:paid");
    /// assert_eq!(msg.meta().correlation_id, "order-7");
    /// # Ok::<(), serde_json::Error>(())
    /// ```
    pub fn with_message_id(mut self, id: impl Into<String>) -> Self {
        self.meta.message_id = id.into();
        self.meta.identity = Identity::Given(self.meta.message_id.clone());
        if !self.correlation_given {
            self.meta.correlation_id = self.meta.message_id.clone();
        }
        self
    }

    /// Sets the partition key: the `partition-key` header, as an AMQP long
    /// string (the type a consistent-hash exchange must see to put one entity's
    /// messages in one partition). For a consumer partitioned on another header,
    /// use [`with_header`](Self::with_header).
    pub fn with_partition_key(self, key: impl Into<String>) -> Self {
        self.with_header(crate::headers::HEADER_PARTITION_KEY, key)
    }

    /// Sets a header, sent as an AMQP long string. The trace headers
    /// (`traceparent`, `tracestate`, `baggage`) go through
    /// [`TraceContext`]'s checks instead, as if set by
    /// [`with_trace_context`](Self::with_trace_context).
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        let (name, value) = (name.into(), value.into());
        let t = &self.trace;
        let (mut parent, mut state, mut baggage) = (t.traceparent(), t.tracestate(), t.baggage());
        match name.as_str() {
            HEADER_TRACEPARENT => parent = Some(&value),
            HEADER_TRACESTATE => state = Some(&value),
            HEADER_BAGGAGE => baggage = Some(&value),
            _ => {
                self.headers.insert(name, value);
                return self;
            }
        }
        self.trace = TraceContext::from_parts(parent, state, baggage);
        self
    }

    /// Sets the trace context this message continues. Inside a handler,
    /// [`Tx::publish`](crate::Tx::publish) sets the handler's own unless one is
    /// set here.
    pub fn with_trace_context(mut self, trace: TraceContext) -> Self {
        self.trace = trace;
        self
    }

    /// The trace context this message continues (empty if none).
    pub fn trace_context(&self) -> &TraceContext {
        &self.trace
    }

    /// The headers set with [`with_header`](Self::with_header).
    pub fn headers(&self) -> &std::collections::BTreeMap<String, String> {
        &self.headers
    }

    /// Sets when the business event happened.
    pub fn with_occurred_at(mut self, at: DateTime<Utc>) -> Self {
        self.meta.occurred_at = Some(at);
        self
    }

    /// When the business event happened: always set on a message built here.
    pub(crate) fn occurred_at(&self) -> DateTime<Utc> {
        self.meta.occurred_at.unwrap_or_default()
    }

    /// The envelope fields.
    pub fn meta(&self) -> &Metadata {
        &self.meta
    }

    /// The JSON body: the envelope with its payload.
    pub fn body(&self) -> Vec<u8> {
        let wire = WireOut {
            message_id: &self.meta.message_id,
            event_type: &self.meta.event_type,
            schema_version: self.meta.schema_version,
            occurred_at_utc: self
                .occurred_at()
                .to_rfc3339_opts(SecondsFormat::Millis, true),
            correlation_id: &self.meta.correlation_id,
            causation_id: self.meta.causation_id.as_deref(),
            payload: &self.payload,
        };
        serde_json::to_vec(&wire).expect("an envelope of strings and raw JSON always serializes")
    }

    /// Checks that every envelope field fits where it travels: ids and event type
    /// non-empty, at most [`MAX_SHORT_STRING_LEN`] bytes (the AMQP limit of the
    /// properties they are copied into; the message id at most
    /// [`MAX_MESSAGE_ID_LEN`], what inboxes accept) and free of control
    /// characters. [`Publisher::publish`](crate::broker::Publisher::publish) and the
    /// outbox refuse a message that fails this.
    pub fn validate(&self) -> Result<(), InvalidOutgoing> {
        self.check().map_err(InvalidOutgoing)
    }

    fn check(&self) -> Result<(), String> {
        let m = &self.meta;
        let id_len = m.message_id.len();
        if id_len == 0 || id_len > MAX_MESSAGE_ID_LEN {
            return Err(format!(
                "message id is {id_len} bytes; it must be 1 to {MAX_MESSAGE_ID_LEN}"
            ));
        }
        if m.event_type.is_empty() {
            return Err("event type is empty".into());
        }
        for name in self.headers.keys() {
            if name.is_empty() || name.len() > MAX_SHORT_STRING_LEN {
                return Err(format!(
                    "header name {name:?} must be 1 to {MAX_SHORT_STRING_LEN} bytes"
                ));
            }
        }
        for (field, value) in [
            ("message id", m.message_id.as_str()),
            ("event type", m.event_type.as_str()),
            ("correlation id", m.correlation_id.as_str()),
            (
                "causation id",
                m.causation_id.as_deref().unwrap_or_default(),
            ),
        ] {
            if value.len() > MAX_SHORT_STRING_LEN {
                return Err(format!(
                    "{field} is {} bytes, the limit is {MAX_SHORT_STRING_LEN}",
                    value.len()
                ));
            }
            if value.chars().any(char::is_control) {
                return Err(format!("{field} contains a control character"));
            }
        }
        Ok(())
    }

    /// AMQP properties: message id, type, JSON content type, correlation id,
    /// timestamp, persistent delivery. A field over the AMQP limit is left out
    /// rather than panicking; [`validate`](Self::validate) reports it, and
    /// warren's publishers refuse such a message before it gets here.
    pub fn properties(&self) -> BasicProperties {
        let mut props = BasicProperties::default()
            .with_content_type(CONTENT_TYPE_JSON.into())
            .with_timestamp(self.occurred_at().timestamp().max(0) as u64)
            .with_delivery_mode(PERSISTENT);
        if let Ok(id) = ShortString::try_new(self.meta.message_id.as_str()) {
            props = props.with_message_id(id);
        }
        if let Ok(kind) = ShortString::try_new(self.meta.event_type.as_str()) {
            props = props.with_type(kind);
        }
        if let Ok(correlation) = ShortString::try_new(self.meta.correlation_id.as_str()) {
            props = props.with_correlation_id(correlation);
        }
        if !self.headers.is_empty() {
            let mut headers = lapin::types::FieldTable::default();
            for (name, value) in &self.headers {
                if let Ok(name) = ShortString::try_new(name.as_str()) {
                    headers.insert(
                        name,
                        lapin::types::AMQPValue::LongString(value.as_str().into()),
                    );
                }
            }
            props = props.with_headers(headers);
        }
        if !self.trace.is_empty() {
            let mut headers = props.headers().clone().unwrap_or_default();
            self.trace.write_headers(&mut headers);
            props = props.with_headers(headers);
        }
        props
    }
}

/// Why a message cannot be published as it is: which field, and what is wrong
/// with it (too long for its AMQP property, a control character, empty).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidOutgoing(pub(crate) String);

impl std::fmt::Display for InvalidOutgoing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for InvalidOutgoing {}

#[cfg(test)]
mod tests {
    use super::*;

    fn new() -> Outgoing {
        Outgoing::new("t.v1", 1, &serde_json::json!({})).unwrap()
    }

    #[test]
    fn a_given_message_id_is_the_correlation_id_unless_one_was_set_in_either_order() {
        let m = new().with_message_id("m1");
        assert_eq!(
            (
                m.meta().message_id.as_str(),
                m.meta().correlation_id.as_str()
            ),
            ("m1", "m1")
        );
        let m = new().with_correlation_id("c1").with_message_id("m1");
        assert_eq!(m.meta().correlation_id, "c1");
        let m = new().with_message_id("m1").with_correlation_id("c1");
        assert_eq!(m.meta().correlation_id, "c1");
        let cause = new().with_correlation_id("flow").meta().clone();
        let m = new().caused_by(&cause).with_message_id("m1");
        assert_eq!(m.meta().correlation_id, "flow");
        let m = new().with_message_id("m1").caused_by(&cause);
        assert_eq!(m.meta().correlation_id, "flow");
        assert_eq!(
            m.properties().correlation_id().as_ref().map(|s| s.as_str()),
            Some("flow")
        );
        let m = new().with_message_id("m1").with_message_id("m2");
        assert_eq!(m.meta().correlation_id, "m2");
    }
}
