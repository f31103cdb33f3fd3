//! `/metrics`, `/healthz` and `/readyz`.

use std::sync::Arc;

use axum::Router;
use axum::extract;
use axum::http::StatusCode;
use axum::routing::get;
use metrics_exporter_prometheus::PrometheusHandle;
use warren::telemetry::StatsHandle;

#[derive(Clone)]
/// What the HTTP endpoints read.
pub struct State {
    /// The invoice consumer's counters (`/stats`).
    pub stats: StatsHandle,
    /// The credit consumer's counters.
    pub credit_stats: StatsHandle,
    /// The Prometheus registry `/metrics` renders.
    pub metrics: Arc<PrometheusHandle>,
}

/// `/metrics`, `/healthz` and `/readyz` on `state`.
pub fn router(state: State) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready))
        .with_state(state)
}

async fn metrics(extract::State(state): extract::State<State>) -> String {
    state.metrics.render()
}

/// Ready while the broker and the database are reachable, both consumers are
/// subscribed (the credit consumer to the partitions it holds, or idle with none
/// to hold) and not draining, publishing is not blocked by a broker alarm, and
/// the outbox relay is running.
async fn ready(extract::State(state): extract::State<State>) -> (StatusCode, String) {
    let h = state.stats.health();
    let c = state.credit_stats.health();
    let body = format!(
        "consuming {}\ncredit consuming {}\ndatabase {}\nblocked {}\nrelay {}\n",
        h.consuming,
        c.consuming,
        h.database && c.database,
        h.blocked,
        h.relay
    );
    if h.is_ready() && c.consuming && c.database {
        (StatusCode::OK, body)
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, body)
    }
}
