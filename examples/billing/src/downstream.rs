//! `billing downstream`: stands in for the service downstream of billing. It
//! consumes the `invoice-payment-recorded` events billing's outbox publishes,
//! from a queue of its own (`P.downstream`), into its own inbox, in whatever
//! database it is given: a second service, for following a message from the
//! producer through billing to the next consumer (`warren trace --follow`,
//! and the trace chain).

use warren::store::ConsumerStore;
use warren::{Consumer, ConsumerConfig, HandlerError, Message, Registry, Tx};

use billing_service::handlers::RECORDED;
use billing_service::service::{Names, Settings};

/// The downstream consumer's name: its inbox rows and journal carry it.
pub const DOWNSTREAM_CONSUMER: &str = "billing-downstream";

/// The downstream consumer's configuration: `P.downstream`, bound to
/// billing's recorded events on `P.events`.
pub fn config(names: &Names, settings: &Settings) -> Result<ConsumerConfig, String> {
    ConsumerConfig::builder(DOWNSTREAM_CONSUMER, format!("{}.downstream", names.prefix))
        .bind(names.exchange(), ["billing.invoice-payment-recorded.*"])
        .with_retry(settings.retry.clone())
        .with_queue_type(settings.queue_type)
        .with_tls(settings.tls.clone())
        .build()
        .map_err(|e| e.to_string())
}

/// Each event is recorded by its inbox row alone: it is applied once.
async fn recorded<DB: warren::store::Dialect>(
    _event: Message<serde_json::Value>,
    _tx: &mut Tx<DB>,
) -> Result<(), HandlerError> {
    Ok(())
}

/// Runs the downstream consumer on `store` until `shutdown`.
pub async fn run<S: ConsumerStore>(
    store: S,
    amqp_url: &str,
    names: &Names,
    settings: &Settings,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), String> {
    let config = config(names, settings)?;
    let registry = Registry::new().route(RECORDED, 1, recorded::<S::Db>);
    Consumer::new(config, store, registry)
        .run(amqp_url, shutdown)
        .await
        .map_err(|e| e.to_string())
}
