//! `billing run`: the consumer, the outbox relay and the HTTP endpoints, until
//! SIGTERM or SIGINT.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use warren::config::ConfigError;
use warren::format::{Bare, CloudEvents, Formats, WarrenEnvelope};
use warren::retry::RetryPolicy;
use warren::telemetry::StatsHandle;
use warren::tls::TlsOptions;
use warren::topology::QueueType;
use warren::topology::Topology;
use warren::{ConsumerConfig, RelayConfig};

use crate::credit::{self, CREDIT_CONSUMER};
use crate::db::BillingDb;
use crate::handlers::{self, CONSUMER};

/// Broker names for a prefix `P`.
#[derive(Debug, Clone)]
pub struct Names {
    /// The prefix `P`.
    pub prefix: String,
}

impl Names {
    /// The names for `prefix`.
    pub fn new(prefix: &str) -> Self {
        Self {
            prefix: prefix.to_owned(),
        }
    }
    /// `P.events`: where invoice events arrive and recorded payments leave.
    pub fn exchange(&self) -> String {
        format!("{}.events", self.prefix)
    }
    /// `P.invoice-paid`: billing's queue.
    pub fn queue(&self) -> String {
        format!("{}.invoice-paid", self.prefix)
    }
    /// `P.invoice-payment-recorded`: stands in for the downstream service that
    /// consumes billing's events, so that they are routable and can be counted.
    pub fn recorded_queue(&self) -> String {
        format!("{}.invoice-payment-recorded", self.prefix)
    }
    /// `P.customer-credit`: the consistent-hash exchange of the credit stream,
    /// and the base name of its partition queues `P.customer-credit.N`.
    pub fn credit(&self) -> String {
        format!("{}.customer-credit", self.prefix)
    }
    /// `P.customer-credit-limit-changed`: stands in for the downstream consumer
    /// of the credit events billing emits.
    pub fn credit_changed_queue(&self) -> String {
        format!("{}.customer-credit-limit-changed", self.prefix)
    }
}

/// Partitions of the credit stream unless configured.
pub const DEFAULT_PARTITIONS: u32 = 4;
/// How long a partition lease lasts unrenewed, unless configured.
pub const DEFAULT_PARTITION_LEASE: Duration = Duration::from_secs(15);
/// The broker's consumer timeout billing expects unless configured
/// (RabbitMQ's own default).
pub const DEFAULT_CONSUMER_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// Settings of the consumer part.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Unacknowledged deliveries per consumer.
    pub prefetch: u16,
    /// Transactions at once.
    pub concurrency: usize,
    /// Deliveries applied in one transaction, at most.
    pub batch_size: usize,
    /// The retry tiers and the poison limit.
    pub retry: RetryPolicy,
    /// Classic or quorum queues.
    pub queue_type: QueueType,
    /// The broker's consumer timeout billing expects.
    pub consumer_timeout: Duration,
    /// CA file and client certificate for amqps://.
    pub tls: TlsOptions,
    /// Partitions of the credit stream.
    pub partitions: u32,
    /// How long a partition lease lasts unrenewed.
    pub partition_lease: Duration,
    /// Dead letters moved into the database as they come.
    pub dead_letter_store: bool,
    /// Payload fields redacted before a dead letter is stored.
    pub dead_letter_redact: Vec<String>,
    /// The broker's management API for the checks at start (`None`: port
    /// 15672 of the AMQP host).
    pub management_url: Option<String>,
    /// The rabbitmqctl the checks at start read node settings with (`None`:
    /// not run).
    pub rabbitmqctl: Option<String>,
}

impl Default for Settings {
    /// warren's defaults and billing's own, with warren's default retry tiers
    /// and queue type (`billing run` asks for quorum queues and its own tiers).
    fn default() -> Self {
        Settings {
            prefetch: warren::config::DEFAULT_PREFETCH,
            concurrency: warren::config::DEFAULT_CONCURRENCY,
            batch_size: warren::config::DEFAULT_BATCH_SIZE,
            retry: RetryPolicy::default(),
            queue_type: QueueType::default(),
            consumer_timeout: DEFAULT_CONSUMER_TIMEOUT,
            tls: TlsOptions::default(),
            partitions: DEFAULT_PARTITIONS,
            partition_lease: DEFAULT_PARTITION_LEASE,
            dead_letter_store: true,
            dead_letter_redact: Vec::new(),
            management_url: None,
            rabbitmqctl: None,
        }
    }
}

/// What the invoice consumer reads, tried in this order: CloudEvents
/// (structured, then binary), warren's envelope, then a bare JSON payload
/// (its event type the AMQP `type` property, the version its `.vN` suffix).
pub fn invoice_formats() -> Formats {
    Formats::new()
        .then(CloudEvents::new())
        .then(WarrenEnvelope)
        .then(Bare::new())
}

/// billing's consumer configuration for `names`.
pub fn consumer_config(names: &Names, settings: &Settings) -> Result<ConsumerConfig, ConfigError> {
    ConsumerConfig::builder(CONSUMER, names.queue())
        .bind(names.exchange(), ["billing.invoice-paid.*"])
        .with_formats(invoice_formats())
        .with_prefetch(settings.prefetch)
        .with_concurrency(settings.concurrency)
        .with_batch_size(settings.batch_size)
        .with_retry(settings.retry.clone())
        .with_queue_type(settings.queue_type)
        .with_consumer_timeout(settings.consumer_timeout)
        .with_tls(settings.tls.clone())
        .with_stand_in_queue(
            names.exchange(),
            names.recorded_queue(),
            "billing.invoice-payment-recorded.*",
        )
        .build()
}

/// The credit consumer's configuration: `P.events` bound to the hash exchange
/// `P.customer-credit`, which feeds the partition queues.
pub fn credit_config(names: &Names, settings: &Settings) -> Result<ConsumerConfig, ConfigError> {
    ConsumerConfig::builder(CREDIT_CONSUMER, names.credit())
        .bind(names.exchange(), ["billing.customer-credit-limit-set.*"])
        .partitioned(names.credit(), settings.partitions)
        .with_lease_ttl(settings.partition_lease)
        .with_prefetch(settings.prefetch)
        .with_concurrency(settings.concurrency)
        .with_batch_size(settings.batch_size)
        .with_retry(settings.retry.clone())
        .with_queue_type(settings.queue_type)
        .with_consumer_timeout(settings.consumer_timeout)
        .with_tls(settings.tls.clone())
        .with_stand_in_queue(
            names.exchange(),
            names.credit_changed_queue(),
            "billing.customer-credit-limit-changed.*",
        )
        .build()
}

/// Everything billing declares for the invoice stream: the consumer's topology,
/// the downstream stand-in queue for recorded payments included.
pub fn topology(names: &Names, settings: &Settings) -> Result<Topology, ConfigError> {
    Ok(Topology::for_consumer(&consumer_config(names, settings)?))
}

/// Everything billing declares for the credit stream, hash ring included.
pub fn credit_topology(names: &Names, settings: &Settings) -> Result<Topology, ConfigError> {
    Ok(Topology::for_consumer(&credit_config(names, settings)?))
}

/// Declares billing's topology.
pub async fn declare(amqp_url: &str, names: &Names, settings: &Settings) -> Result<(), String> {
    let topology = topology(names, settings).map_err(|e| e.to_string())?;
    let connection = warren::broker::connect_with_tls(amqp_url, "billing setup", &settings.tls)
        .await
        .map_err(|e| {
            format!(
                "cannot reach the broker at {}: {e}",
                warren_admin::redact_url(amqp_url)
            )
        })?;
    let credit = credit_topology(names, settings).map_err(|e| e.to_string())?;
    let mut declared = warren::broker::declare_on(&connection, &topology).await;
    if declared.is_ok() {
        declared = warren::broker::declare_on(&connection, &credit).await;
    }
    let _ = connection.close(200, "declared".into()).await;
    declared.map_err(|e| e.to_string())
}

/// What runs until shutdown, and the handles to watch it.
pub struct Running {
    /// The invoice consumer's counters.
    pub stats: StatsHandle,
    /// The credit consumer's counters.
    pub credit_stats: StatsHandle,
    /// Both consumers (and the relay); ends with the first error.
    pub task: tokio::task::JoinHandle<Result<(), warren::Error>>,
}

/// Starts consumer and relay on `store` until `stop` turns true.
pub async fn start<B: BillingDb>(
    store: B::S,
    amqp_url: &str,
    names: &Names,
    settings: &Settings,
    relay: RelayConfig,
    stop: watch::Receiver<bool>,
) -> Result<Running, String> {
    B::create_tables(&store)
        .await
        .map_err(|e| format!("cannot create billing's tables: {e}"))?;
    declare(amqp_url, names, settings).await?;
    let invoice_config = consumer_config(names, settings).map_err(|e| e.to_string())?;
    // The dead letters of the invoice stream, moved into the database as they
    // come (the credit stream's are not expected; they stay on the broker).
    let ingester = settings.dead_letter_store.then(|| {
        warren_admin::Ingester::new(store.clone(), &invoice_config)
            .redacting(settings.dead_letter_redact.clone())
    });
    let consumer = warren::Consumer::new(
        invoice_config,
        store.clone(),
        handlers::routes::<B>(&names.exchange()),
    );
    let credit = warren::Consumer::new(
        credit_config(names, settings).map_err(|e| e.to_string())?,
        store,
        credit::routes::<B>(&names.exchange()),
    );
    let stats = consumer.stats();
    let credit_stats = credit.stats();
    let url = amqp_url.to_owned();
    let task = tokio::spawn(async move {
        // One consumer stopping on an error it cannot mend (a missing plugin,
        // a drifted queue) stops the other too, so that billing exits with
        // that error instead of running on half its contract.
        let failed = Arc::new(watch::channel(false).0);
        let stop_on = |stop: watch::Receiver<bool>| {
            let (mut stop, mut failed) = (stop, failed.subscribe());
            async move {
                tokio::select! {
                    _ = stop.wait_for(|s| *s) => {}
                    _ = failed.wait_for(|f| *f) => {}
                }
            }
        };
        let report = |ran: Result<(), warren::Error>| {
            if ran.is_err() {
                failed.send_replace(true);
            }
            ran
        };
        let invoices = async {
            report(
                consumer
                    .run_with_relay(&url, relay, stop_on(stop.clone()))
                    .await,
            )
        };
        let credit = async { report(credit.run(&url, stop_on(stop.clone())).await) };
        let ingest = async {
            match ingester {
                Some(ingester) => report(ingester.run(&url, stop_on(stop.clone())).await),
                None => Ok(()),
            }
        };
        let (invoices, credit, ingest) = tokio::join!(invoices, credit, ingest);
        invoices.and(credit).and(ingest)
    });
    Ok(Running {
        stats,
        credit_stats,
        task,
    })
}

/// `billing run`.
pub async fn run<B: BillingDb>(
    store: B::S,
    amqp_url: &str,
    names: &Names,
    settings: &Settings,
    http: SocketAddr,
    inbox_retention: Option<Duration>,
    signal: impl Future<Output = ()>,
) -> Result<(), String> {
    // Histograms, not summaries: quantiles that add up across instances.
    let mut builder = metrics_exporter_prometheus::PrometheusBuilder::new();
    for (name, buckets) in warren::telemetry::HISTOGRAM_BUCKETS {
        builder = builder
            .set_buckets_for_metric(
                metrics_exporter_prometheus::Matcher::Full((*name).to_owned()),
                buckets,
            )
            .map_err(|e| format!("the buckets of {name}: {e}"))?;
    }
    let recorder = builder
        .install_recorder()
        .map_err(|e| format!("cannot install the metrics recorder: {e}"))?;
    crate::checkup::at_start::<B>(&store, amqp_url, names, settings, inbox_retention).await?;
    let (stop_tx, stop_rx) = watch::channel(false);
    if let Some(window) = inbox_retention {
        tokio::spawn(purge_on_schedule::<B>(
            store.clone(),
            window,
            stop_rx.clone(),
        ));
    }
    let running = start::<B>(
        store,
        amqp_url,
        names,
        settings,
        RelayConfig::new(CONSUMER),
        stop_rx.clone(),
    )
    .await?;
    let listener = tokio::net::TcpListener::bind(http)
        .await
        .map_err(|e| format!("cannot listen on {http} (--http): {e}"))?;
    let state = crate::http::State {
        stats: running.stats.clone(),
        credit_stats: running.credit_stats.clone(),
        metrics: Arc::new(recorder),
    };
    let mut http_stop = stop_rx.clone();
    let server = tokio::spawn(async move {
        axum::serve(listener, crate::http::router(state))
            .with_graceful_shutdown(async move {
                let _ = http_stop.wait_for(|s| *s).await;
            })
            .await
    });
    tracing::info!(%http, queue = %names.queue(), "billing running");

    let mut task = running.task;
    let outcome = tokio::select! {
        () = signal => {
            let _ = stop_tx.send(true);
            // The consumer drains within its shutdown deadline; give it that long.
            match tokio::time::timeout(Duration::from_secs(60), &mut task).await {
                Ok(joined) => joined,
                Err(_) => return Err("the consumer did not drain within 60 s".into()),
            }
        }
        joined = &mut task => {
            let _ = stop_tx.send(true);
            joined
        }
    };
    let _ = server.await;
    match outcome {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(e.to_string()),
        Err(e) => Err(format!("consumer task failed: {e}")),
    }
}

/// Deletes inbox rows past `window` at start and then every hour, until `stop`.
async fn purge_on_schedule<B: BillingDb>(
    store: B::S,
    window: Duration,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        match warren_admin::purge_inbox(&store, CONSUMER, window).await {
            Ok(0) => {}
            Ok(n) => tracing::info!(deleted = n, "purged inbox rows past retention"),
            Err(e) => tracing::warn!(error = %e, "inbox purge failed; trying again in an hour"),
        }
        tokio::select! {
            _ = stop.wait_for(|s| *s) => return,
            () = tokio::time::sleep(Duration::from_secs(3600)) => {}
        }
    }
}
