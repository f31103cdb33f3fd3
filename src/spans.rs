//! warren's spans: one place that makes them, sets their parents from the
//! W3C context a delivery or an outbox row carries, and reads back the
//! context to pass on.
//!
//! The spans are `tracing` spans of target [`TARGET`]. With the `otel`
//! feature and [`crate::otel::Otel`]'s layer installed, each becomes an
//! OpenTelemetry span; without it nobody listens to them and they cost what
//! a disabled `tracing` span costs, and the W3C context a delivery carried
//! goes on unchanged to the events its handler writes. The span tree is
//! written down in `docs/tracing.md`.

use tracing::Span;

use crate::trace_context::TraceContext;

/// The target of every span warren makes (log filters can name it:
/// `warren::trace=off` keeps the spans out of a log layer).
pub const TARGET: &str = "warren::trace";

/// A delivery's span, from receipt to settlement: the child of the span that
/// published it (the producer's, or a warren relay's, retry or dead-letter
/// publish), read from its `traceparent`.
pub(crate) fn process(
    consumer: &str,
    queue: &str,
    routing_key: &str,
    message_id: &str,
    trace: &TraceContext,
) -> Span {
    let span = tracing::info_span!(
        target: TARGET,
        "process",
        otel.name = %format_args!("process {queue}"),
        otel.kind = "consumer",
        messaging.system = "rabbitmq",
        messaging.operation.type = "process",
        messaging.destination.name = %queue,
        messaging.consumer.group.name = %consumer,
        messaging.message.id = %message_id,
        messaging.rabbitmq.destination.routing_key = %routing_key,
    );
    set_remote_parent(&span, trace);
    span
}

/// The handler's span, a child of its delivery's.
pub(crate) fn handler(parent: &Span, event_type: &str) -> Span {
    tracing::info_span!(
        target: TARGET,
        parent: parent,
        "handler",
        otel.name = %format_args!("handle {event_type}"),
    )
}

/// A transaction's span. With one message it is a child of that message's
/// span; with several it starts a trace of its own: a batch is not one
/// message's child (its commit span is linked to each message's, see
/// [`commit`]).
pub(crate) fn unit(members: &[&Span], solo: bool) -> Span {
    match members {
        [only] => tracing::info_span!(
            target: TARGET,
            parent: *only,
            "transaction",
            warren.messages = 1,
            warren.solo = solo,
        ),
        several => tracing::info_span!(
            target: TARGET,
            parent: None,
            "transaction",
            warren.messages = several.len(),
            warren.solo = solo,
        ),
    }
}

/// The commit's span, a child of the transaction's. In a batch it is linked
/// to each message's span and each message's span to it, so that each
/// message's trace shows the commit that applied it.
pub(crate) fn commit(unit: &Span, members: &[&Span]) -> Span {
    let span = step(unit, "commit");
    if members.len() > 1 {
        link_both_ways(&span, members);
    }
    span
}

/// A step of a transaction (`inbox claim`, `commit`), a child of its span.
pub(crate) fn step(parent: &Span, name: &'static str) -> Span {
    tracing::info_span!(target: TARGET, parent: parent, "step", otel.name = name)
}

/// How a delivery was settled (`ack`, `retry publish`, `dead-letter
/// publish`, ...), a child of its span.
pub(crate) fn settle(parent: &Span, name: &'static str) -> Span {
    tracing::info_span!(target: TARGET, parent: parent, "settle", otel.name = name)
}

/// The context to pass on from inside `span`: its own, continuing `base`'s
/// tracestate and baggage, where OpenTelemetry gave it one; else `base`
/// unchanged.
pub(crate) fn context_of(span: &Span, base: &TraceContext) -> TraceContext {
    otel_context(span, base).unwrap_or_else(|| base.clone())
}

#[cfg(feature = "otel")]
fn otel_context(span: &Span, base: &TraceContext) -> Option<TraceContext> {
    use opentelemetry::trace::TraceContextExt;
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    if span.is_disabled() {
        return None;
    }
    let cx = span.context();
    let sc = cx.span().span_context().clone();
    sc.is_valid().then(|| {
        base.with_parent(
            &format!("{:032x}", sc.trace_id()),
            &format!("{:016x}", sc.span_id()),
            sc.is_sampled(),
        )
    })
}

#[cfg(not(feature = "otel"))]
fn otel_context(_span: &Span, _base: &TraceContext) -> Option<TraceContext> {
    None
}

#[cfg(feature = "otel")]
fn set_remote_parent(span: &Span, trace: &TraceContext) {
    use opentelemetry::trace::TraceContextExt;
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    if span.is_disabled() {
        return;
    }
    if let Some(remote) = remote_span_context(trace) {
        let _ = span.set_parent(opentelemetry::Context::new().with_remote_span_context(remote));
    }
}

#[cfg(not(feature = "otel"))]
fn set_remote_parent(_span: &Span, _trace: &TraceContext) {}

#[cfg(feature = "otel")]
fn link_both_ways(span: &Span, members: &[&Span]) {
    use opentelemetry::trace::TraceContextExt;
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    if span.is_disabled() {
        return;
    }
    let this = span.context().span().span_context().clone();
    for member in members {
        span.add_link(member.context().span().span_context().clone());
        member.add_link(this.clone());
    }
}

#[cfg(not(feature = "otel"))]
fn link_both_ways(_span: &Span, _members: &[&Span]) {}

/// The remote span context a checked W3C context names.
#[cfg(feature = "otel")]
pub(crate) fn remote_span_context(
    trace: &TraceContext,
) -> Option<opentelemetry::trace::SpanContext> {
    use opentelemetry::trace::{SpanContext, SpanId, TraceFlags, TraceId, TraceState};
    let trace_id = TraceId::from_hex(trace.trace_id()?).ok()?;
    let span_id = SpanId::from_hex(trace.parent_id()?).ok()?;
    let flags = if trace.sampled() {
        TraceFlags::SAMPLED
    } else {
        TraceFlags::default()
    };
    let state = trace
        .tracestate()
        .and_then(|s| s.parse::<TraceState>().ok())
        .unwrap_or_default();
    Some(SpanContext::new(trace_id, span_id, flags, true, state))
}
