//! OpenTelemetry export (the `otel` feature): warren's spans sent over
//! OTLP/HTTP with JSON bodies, configured by the standard environment
//! variables.
//!
//! ```no_run
//! use tracing_subscriber::layer::SubscriberExt;
//! use tracing_subscriber::util::SubscriberInitExt;
//!
//! // None unless OTEL_EXPORTER_OTLP_ENDPOINT (or ..._TRACES_ENDPOINT) is set.
//! let otel = warren::otel::Otel::from_env("billing").expect("valid OTEL_* settings");
//! tracing_subscriber::registry()
//!     .with(otel.as_ref().map(|o| o.layer()))
//!     .init();
//! // ... run; dropping `otel` flushes what is buffered.
//! ```
//!
//! Read from the environment: `OTEL_EXPORTER_OTLP_ENDPOINT` (warren appends
//! `/v1/traces`) or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (used as it is),
//! `OTEL_EXPORTER_OTLP_HEADERS`, `OTEL_EXPORTER_OTLP_TIMEOUT`,
//! `OTEL_TRACES_SAMPLER` and its argument, `OTEL_BSP_*` for the batch
//! processor, and `OTEL_SERVICE_NAME` over the name given. Only the
//! `http/json` protocol is built in: `OTEL_EXPORTER_OTLP_PROTOCOL` set to
//! anything else is an error that says so.

use std::time::SystemTime;

use opentelemetry::trace::{SpanKind, Status, TraceContextExt, Tracer as _, TracerProvider as _};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::Layer;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::registry::LookupSpan;

use crate::spans::{TARGET, remote_span_context};
use crate::trace_context::TraceContext;

/// An installed OpenTelemetry pipeline: warren's spans batched and exported
/// over OTLP/HTTP. Dropping it flushes and shuts the exporter down.
pub struct Otel {
    provider: SdkTracerProvider,
}

impl Otel {
    /// The pipeline the standard `OTEL_*` variables describe, for a service
    /// called `service_name` (unless `OTEL_SERVICE_NAME` says otherwise);
    /// `None` when no OTLP endpoint is set. It is also made the global
    /// tracer provider, which the outbox relay's spans use.
    pub fn from_env(service_name: &str) -> Result<Option<Self>, String> {
        let endpoint = [
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            "OTEL_EXPORTER_OTLP_ENDPOINT",
        ]
        .into_iter()
        .any(|name| std::env::var(name).is_ok_and(|v| !v.trim().is_empty()));
        if !endpoint {
            return Ok(None);
        }
        for name in [
            "OTEL_EXPORTER_OTLP_PROTOCOL",
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        ] {
            if let Ok(p) = std::env::var(name)
                && p != "http/json"
            {
                return Err(format!(
                    "{name}={p}: warren exports over http/json only; unset it or set http/json"
                ));
            }
        }
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpJson)
            .build()
            .map_err(|e| format!("OpenTelemetry exporter: {e}"))?;
        let name = std::env::var("OTEL_SERVICE_NAME")
            .ok()
            .filter(|n| !n.trim().is_empty())
            .unwrap_or_else(|| service_name.to_owned());
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_resource(Resource::builder().with_service_name(name).build())
            .build();
        opentelemetry::global::set_tracer_provider(provider.clone());
        Ok(Some(Self { provider }))
    }

    /// The `tracing` layer that turns warren's spans into OpenTelemetry
    /// spans; it listens to warren's span target only, so that log events
    /// and other crates' spans stay out of the traces.
    pub fn layer<S>(&self) -> impl Layer<S> + use<S>
    where
        S: tracing::Subscriber + for<'a> LookupSpan<'a>,
    {
        tracing_opentelemetry::layer()
            .with_tracer(self.provider.tracer("warren"))
            .with_filter(Targets::new().with_target(TARGET, tracing::Level::INFO))
    }
}

impl Drop for Otel {
    fn drop(&mut self) {
        // Exports what is still buffered; an unreachable collector costs the
        // exporter's timeout, once.
        let _ = self.provider.shutdown();
    }
}

/// The spans of one outbox row in a relay pass: how long it waited in the
/// outbox (from its write, by the database's clock, to now), and, as its
/// child, the publish. Ended when the outcome is known.
pub(crate) struct RowSpans {
    outbox: Context,
    publish: Context,
}

impl RowSpans {
    /// Starts the spans of a row written at `written_at` with context
    /// `stored`, publishing to `exchange`; returns them and the context to
    /// send, the publish span's (or `stored` unchanged where no tracer
    /// provider is installed).
    pub(crate) fn start(
        stored: &TraceContext,
        written_at: Option<chrono::DateTime<chrono::Utc>>,
        exchange: &str,
        message_id: &str,
    ) -> (Self, TraceContext) {
        let tracer = opentelemetry::global::tracer("warren");
        let parent = match remote_span_context(stored) {
            Some(remote) => Context::new().with_remote_span_context(remote),
            None => Context::new(),
        };
        let mut outbox = tracer
            .span_builder("outbox wait")
            .with_kind(SpanKind::Internal)
            .with_attributes([KeyValue::new("messaging.message.id", message_id.to_owned())]);
        if let Some(t) = written_at {
            outbox = outbox.with_start_time(SystemTime::from(t));
        }
        let outbox = parent.with_span(outbox.start_with_context(&tracer, &parent));
        let publish = tracer
            .span_builder(format!("publish {exchange}"))
            .with_kind(SpanKind::Producer)
            .with_attributes([
                KeyValue::new("messaging.system", "rabbitmq"),
                KeyValue::new("messaging.operation.type", "send"),
                KeyValue::new("messaging.destination.name", exchange.to_owned()),
                KeyValue::new("messaging.message.id", message_id.to_owned()),
            ])
            .start_with_context(&tracer, &outbox);
        let publish = outbox.with_span(publish);
        let sc = publish.span().span_context().clone();
        let send = if sc.is_valid() {
            stored.with_parent(
                &format!("{:032x}", sc.trace_id()),
                &format!("{:016x}", sc.span_id()),
                sc.is_sampled(),
            )
        } else {
            stored.clone()
        };
        (Self { outbox, publish }, send)
    }

    /// Ends both spans; `error` marks the publish failed.
    pub(crate) fn end(self, error: Option<&str>) {
        if let Some(e) = error {
            self.publish.span().set_status(Status::error(e.to_owned()));
        }
        self.publish.span().end();
        self.outbox.span().end();
    }
}
