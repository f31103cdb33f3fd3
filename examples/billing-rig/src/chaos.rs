//! `billing chaos`: several `billing run` processes on one database, a stream of
//! invoices, and faults at random (from a seed) while it flows; then the
//! invariants, PASS or FAIL each.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use warren::store::OutboxStore;
use warren::store::{DeadLetterStore, Journal};
use warren_admin::DeadLetterQueue;
use warren_chaos::{Campaign, Check, Cluster, ClusterFault, Failover, FaultMix, Fleet, Report};

use billing_service::config::Config;
use billing_service::credit::{self, CREDIT_CONSUMER, CreditSpec};
use billing_service::db::{self, BillingDb};
use billing_service::handlers::CONSUMER;
use billing_service::scratch;
use billing_service::service::{self, Names, Settings};
use billing_service::stream::{self, Plan, StreamSpec};

/// What `billing chaos` was asked for.
#[derive(Debug, Clone)]
pub struct ChaosSpec {
    /// Invoices in the stream.
    pub count: usize,
    /// `billing run` processes at once.
    pub processes: usize,
    /// The seed of the stream and of the faults.
    pub seed: u64,
    /// The faults and their weights.
    pub mix: FaultMix,
    /// Faults stop after this long even if the stream has not been applied yet.
    pub max_fault_time: Duration,
    /// How long the quiet phase may take to drain everything.
    pub drain_deadline: Duration,
    /// Messages published per second (`None`: as fast as the broker takes them),
    /// so the stream flows for a while under faults.
    pub publish_rate: Option<f64>,
    /// One fault of a RabbitMQ cluster instead of the random ones, aimed at
    /// the leader of the target's queue.
    pub cluster: Option<(Cluster, ClusterFault, FaultTarget)>,
}

/// The queue whose leader a cluster fault hits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultTarget {
    /// `P.invoice-paid`, the invoice consumer's queue.
    Invoices,
    /// `P.customer-credit.0`, a partition of the ordered credit stream.
    Credit,
    /// The queue billing's relay publishes its events to.
    Events,
}

impl FaultTarget {
    fn queue(self, names: &Names) -> String {
        match self {
            FaultTarget::Invoices => names.queue(),
            FaultTarget::Credit => format!("{}.0", names.credit()),
            FaultTarget::Events => names.recorded_queue(),
        }
    }
}

impl std::str::FromStr for FaultTarget {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "invoices" => Ok(FaultTarget::Invoices),
            "credit" => Ok(FaultTarget::Credit),
            "events" => Ok(FaultTarget::Events),
            _ => Err(format!(
                "{s:?} is not a target; one of invoices, credit, events"
            )),
        }
    }
}

/// `url` (PostgreSQL's) reaching the server through its Unix socket in
/// `/var/run/postgresql`, from a network namespace where 127.0.0.1 is not the
/// server's.
fn through_socket(url: &str) -> Result<String, String> {
    if !url.starts_with("postgres") {
        return Err(
            "the partition campaign runs on PostgreSQL: give --database-url postgres://...".into(),
        );
    }
    let joiner = if url.contains('?') { '&' } else { '?' };
    Ok(format!("{url}{joiner}host=/var/run/postgresql"))
}

/// `urls` (a comma-separated list) turned left by `by`, so that processes
/// given the same cluster connect to different nodes first.
fn rotated(urls: &str, by: usize) -> String {
    let mut list: Vec<&str> = urls.split(',').collect();
    let by = by % list.len().max(1);
    list.rotate_left(by);
    list.join(",")
}

/// Applied messages over time while a cluster fault ran, every 100 ms, with
/// whether work was waiting then: the stream still being published, or
/// fewer than `valid` applied.
async fn sample_progress<B: BillingDb>(
    store: B::S,
    stream_done: Arc<std::sync::atomic::AtomicBool>,
    valid: i64,
    stop: tokio::sync::watch::Receiver<bool>,
) -> Vec<(Instant, i64, bool)> {
    let mut samples = Vec::new();
    loop {
        if let Ok(c) = B::counts(&store, CONSUMER).await {
            let waiting =
                !stream_done.load(std::sync::atomic::Ordering::Relaxed) || c.inbox_rows < valid;
            samples.push((Instant::now(), c.inbox_rows, waiting));
        }
        if *stop.borrow() {
            return samples;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The longest stretch without a message applied while work was waiting,
/// and when it began relative to `from`.
fn longest_stall(samples: &[(Instant, i64, bool)], from: Instant) -> (Duration, Duration) {
    let mut longest = (Duration::ZERO, Duration::ZERO);
    let mut since: Option<(Instant, i64)> = None;
    for &(at, applied, waiting) in samples {
        match since {
            _ if !waiting => since = None,
            Some((start, count)) if applied == count => {
                let stalled = at.saturating_duration_since(start);
                if stalled > longest.0 {
                    longest = (stalled, start.saturating_duration_since(from));
                }
            }
            _ => since = Some((at, applied)),
        }
    }
    longest
}

/// The retry tiers of the campaign's processes: short, so retries finish quickly.
pub const TIERS: &str = "100ms,200ms,400ms";

/// Publishes the plan, surviving broker faults: a chunk whose publish failed is
/// published again on a new connection (its messages keep their ids, so any copy
/// that did get through is a duplicate the inbox absorbs).
async fn publish_through_faults(
    amqp_url: String,
    exchange: String,
    plan: Arc<Plan>,
    rate: Option<f64>,
) -> Result<(), String> {
    const CHUNK: usize = 50;
    let mut connection: Option<Arc<warren::lapin::Connection>> = None;
    let mut pace = rate.map(|r| {
        let mut i = tokio::time::interval(Duration::from_secs_f64(CHUNK as f64 / r));
        i.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        i
    });
    for chunk in plan.messages.chunks(CHUNK) {
        if let Some(p) = pace.as_mut() {
            p.tick().await;
        }
        let mut tries = 0;
        loop {
            if connection.as_ref().is_none_or(|c| !c.status().connected()) {
                connection = warren::broker::connect(&amqp_url, "billing chaos publisher")
                    .await
                    .ok()
                    .map(Arc::new);
            }
            let ok = match &connection {
                Some(c) => {
                    let publisher = warren::broker::Publisher::new(Arc::clone(c));
                    let items: Vec<_> = chunk
                        .iter()
                        .map(|m| warren::broker::BatchItem {
                            exchange: &exchange,
                            routing_key: &m.routing_key,
                            body: &m.body,
                            properties: m.properties.clone(),
                        })
                        .collect();
                    publisher
                        .publish_batch(&items)
                        .await
                        .iter()
                        .all(Result::is_ok)
                }
                None => false,
            };
            if ok {
                break;
            }
            tries += 1;
            if tries > 600 {
                return Err("the publisher could not get a chunk through in 5 minutes".into());
            }
            connection = None;
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
    Ok(())
}

/// What a cluster fault did, as the campaign measured it.
struct ClusterOutcome {
    queue: String,
    fault: ClusterFault,
    failover: Failover,
    /// The longest time no message was applied, from the fault's start on.
    stall: Duration,
    /// Redelivered messages that ran alone as suspects after the fault.
    suspects: u64,
    /// From the first of those solo runs to the last one's start.
    lane: Duration,
}

/// Waits until a quarter of the stream is applied, then injects `fault` at
/// the node leading `target`'s queue while sampling progress every 100 ms,
/// and prints what it did.
async fn cluster_fault<B: BillingDb>(
    store: &B::S,
    names: &Names,
    aimed: &(Cluster, ClusterFault, FaultTarget),
    valid: usize,
    stream_done: &Arc<std::sync::atomic::AtomicBool>,
    fleet: &Fleet,
    cut_off: Option<&str>,
) -> Result<ClusterOutcome, String> {
    let (cluster, fault, target) = (&aimed.0, aimed.1, aimed.2);
    let queue = target.queue(names);
    let deadline = Instant::now() + Duration::from_secs(120);
    while Instant::now() < deadline {
        let applied = B::counts(store, CONSUMER)
            .await
            .map(|c| c.inbox_rows)
            .unwrap_or(0);
        if applied as usize * 4 >= valid {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let solo_before = fleet.tally().solo_runs;
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let sampler = tokio::spawn(sample_progress::<B>(
        store.clone(),
        Arc::clone(stream_done),
        valid as i64,
        stopped,
    ));
    let started = Instant::now();
    println!("chaos: {} at the leader of {queue}", fault.as_str());
    let member_before = fleet.member_tally(0);
    let also: Vec<String> = cut_off.iter().map(|a| (*a).to_owned()).collect();
    let injected = cluster.inject(fault, &queue, &also).await;
    let member_after = fleet.member_tally(0);
    // Until the stream is applied, or long enough after the fault for a
    // stall at its end to show.
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        let applied = B::counts(store, CONSUMER)
            .await
            .map(|c| c.inbox_rows)
            .unwrap_or(0);
        if applied as usize >= valid {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let _ = stop.send(true);
    let samples = sampler
        .await
        .map_err(|e| format!("the progress sampler failed: {e}"))?;
    let failover = injected?;
    let (stall, stall_at) = longest_stall(&samples, started);
    let tally = fleet.tally();
    let suspects = tally.solo_runs.saturating_sub(solo_before);
    let lane = tally
        .solo_run_span
        .as_ref()
        .and_then(|(first, last)| {
            let first = chrono::DateTime::parse_from_rfc3339(first).ok()?;
            let last = chrono::DateTime::parse_from_rfc3339(last).ok()?;
            (last - first).to_std().ok()
        })
        .unwrap_or_default();
    println!(
        "chaos: {} took {:.1} s; {queue} was led by {}, by {} while it was down, by {} after; \
         another node led it {:.1} s after the fault began",
        fault.as_str(),
        failover.duration.as_secs_f64(),
        failover.leader_before,
        failover.leaders_during.join(" then "),
        failover.leader_after,
        failover.election.as_secs_f64(),
    );
    println!(
        "chaos: consumption stalled for {:.1} s at most ({:.1} s after the fault began); \
         {suspects} redelivered messages ran alone as suspects, over {:.1} s",
        stall.as_secs_f64(),
        stall_at.as_secs_f64(),
        lane.as_secs_f64(),
    );
    if let Some(address) = cut_off {
        // What the instance the partition cut off from the leader did
        // meanwhile, from its own log.
        println!(
            "chaos: the instance cut off with the leader's node ({address}) lost the broker {} \
             times, started consuming {} times and applied {} messages while the fault lasted",
            member_after.broker_lost - member_before.broker_lost,
            member_after.consuming - member_before.consuming,
            member_after.count("applied") - member_before.count("applied"),
        );
    }
    Ok(ClusterOutcome {
        queue,
        fault,
        failover,
        stall,
        suspects,
        lane,
    })
}

/// Runs the campaign; returns whether every invariant held.
pub async fn run<B: BillingDb>(
    store: B::S,
    child_db_url: String,
    amqp_url: &str,
    names: &Names,
    settings: &Settings,
    spec: &ChaosSpec,
) -> Result<bool, String> {
    if !cfg!(feature = "failpoints") && spec.cluster.is_none() {
        return Err(
            "billing chaos arms crash points: build it with --features failpoints \
             (cargo run --release -p billing --features failpoints -- chaos)"
                .into(),
        );
    }
    let started = Instant::now();
    B::create_tables(&store).await.map_err(|e| e.to_string())?;
    warren::store::Store::migrate(&store)
        .await
        .map_err(|e| e.to_string())?;
    service::declare(amqp_url, names, settings).await?;

    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    // A partition cuts the leader's node off from one instance too: that
    // instance (member 0) runs in a network namespace of its own, and
    // reaches PostgreSQL through its socket, which no route can cut.
    let cut_off = match &spec.cluster {
        Some((cluster, ClusterFault::LeaderPartition, _)) => {
            let (namespace, address) = cluster.client(1).await?;
            let socket_url = through_socket(&child_db_url)?;
            Some((namespace, address, socket_url))
        }
        _ => None,
    };
    let cut_off_spawn = cut_off
        .as_ref()
        .map(|(namespace, _, url)| (namespace.clone(), url.clone()));
    let (prefix, url, amqp) = (names.prefix.clone(), child_db_url, amqp_url.to_owned());
    let mut fleet = Fleet::new(spec.processes, move |member| {
        let (mut cmd, url) = match &cut_off_spawn {
            Some((namespace, socket_url)) if member == 0 => {
                let mut cmd = tokio::process::Command::new("ip");
                cmd.args(["netns", "exec", namespace.as_str()]).arg(&exe);
                (cmd, socket_url.as_str())
            }
            _ => (tokio::process::Command::new(&exe), url.as_str()),
        };
        cmd.args([
            "--amqp-url",
            &rotated(&amqp, member),
            "--prefix",
            &prefix,
            "--database-url",
            url,
            "--http",
            "127.0.0.1:0",
            "--retry-tiers",
            TIERS,
            "--log-format",
            "json",
            "run",
        ])
        // Every outcome, applied ones (at DEBUG) too: the tally counts them.
        .env("RUST_LOG", "info,warren::telemetry=debug");
        cmd
    })
    .with_ready_line("\"consuming\"");
    fleet.start_all(spec.mix.start_armed().as_deref()).await?;

    let plan = Arc::new(stream::plan(&StreamSpec {
        count: spec.count,
        duplicates: 0.1,
        v2: 0.3,
        poison: (spec.count / 500).max(5),
        flaky: (spec.count / 1000).max(3).min(spec.count),
        foreign: 0.0,
        seed: spec.seed,
    }));
    let e = plan.expected.clone();
    println!(
        "chaos: seed {}, {} processes, {} deliveries ({} valid invoices, {} duplicate copies, {} poison, {} flaky)",
        spec.seed,
        spec.processes,
        e.published,
        e.valid,
        e.duplicates,
        e.poison.values().sum::<usize>(),
        e.flaky
    );
    // Set once every invoice is published: until then a pause in progress
    // may be a pause in the stream, after it only a stall.
    let stream_done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let publisher = tokio::spawn({
        let done = Arc::clone(&stream_done);
        let publishing = publish_through_faults(
            amqp_url.to_owned(),
            names.exchange(),
            Arc::clone(&plan),
            spec.publish_rate,
        );
        async move {
            let published = publishing.await;
            done.store(true, std::sync::atomic::Ordering::Relaxed);
            published
        }
    });
    // The credit stream beside it: per-customer versions, half in order, half
    // shuffled, with copies; its ordering invariants are checked at the end.
    let credit_plan = credit::plan(&CreditSpec {
        customers: (spec.count / 50).max(20),
        versions: 10,
        duplicates: 0.15,
        flaky: 2,
        seed: spec.seed,
    });
    println!(
        "chaos: {} credit-limit updates for {} customers over {} partitions",
        credit_plan.messages.len(),
        credit_plan.last.len(),
        settings.partitions
    );
    let credit_publisher = tokio::spawn(publish_through_faults(
        amqp_url.to_owned(),
        names.exchange(),
        Arc::new(credit_plan.as_stream()),
        spec.publish_rate.map(|r| r / 4.0),
    ));

    // Faults while the stream flows.
    let mut campaign = Campaign::new(spec.seed, spec.mix.clone());
    let fault_start = Instant::now();
    let mut failover = None;
    if let Some(aimed) = &spec.cluster {
        failover = Some(
            cluster_fault::<B>(
                &store,
                names,
                aimed,
                e.valid,
                &stream_done,
                &fleet,
                cut_off.as_ref().map(|(_, address, _)| address.as_str()),
            )
            .await?,
        );
    }
    while spec.cluster.is_none() {
        let kind = campaign.inject(&mut fleet).await?;
        let applied = B::counts(&store, CONSUMER)
            .await
            .map(|c| c.inbox_rows)
            .unwrap_or(0);
        println!(
            "  {:>6.1} s  {:<28} applied {applied}/{}",
            started.elapsed().as_secs_f64(),
            kind.as_str(),
            e.valid
        );
        let most_applied = applied as usize * 10 >= e.valid * 9;
        if (publisher.is_finished() && most_applied) || fault_start.elapsed() > spec.max_fault_time
        {
            break;
        }
    }
    publisher
        .await
        .map_err(|e| format!("publisher task failed: {e}"))??;
    credit_publisher
        .await
        .map_err(|e| format!("credit publisher task failed: {e}"))??;

    // Quiet phase: every process restarted cleanly, no crash points, no faults.
    fleet.revive(None).await?;
    fleet.restart_all(None).await?;
    println!(
        "  {:>6.1} s  quiet phase: draining",
        started.elapsed().as_secs_f64()
    );
    let connection = Arc::new(
        warren::broker::connect_with_tls(amqp_url, "billing chaos checks", &settings.tls)
            .await
            .map_err(|e| e.to_string())?,
    );
    let tiers: Vec<String> = settings
        .retry
        .tiers()
        .iter()
        .map(|d| warren::topology::retry_queue_name(&names.queue(), *d))
        .collect();
    // Every partition's queue and retry tiers.
    let credit_queues: Vec<String> = service::credit_config(names, settings)
        .map_err(|e| e.to_string())?
        .partition_queues()
        .into_iter()
        .flat_map(|q| {
            let tiers: Vec<String> = settings
                .retry
                .tiers()
                .iter()
                .map(|d| warren::topology::retry_queue_name(&q, *d))
                .collect();
            std::iter::once(q).chain(tiers)
        })
        .collect();
    let drain_start = Instant::now();
    let mut last_report = Instant::now();
    let mut waiting_for = String::new();
    let settled = loop {
        let counts = B::counts(&store, CONSUMER)
            .await
            .map_err(|e| e.to_string())?;
        let pending = store.outbox_status().await.map(|o| o.pending).unwrap_or(-1);
        // What is still ready, queue by queue; a queue that cannot be
        // inspected (its leader away) counts as not drained.
        let mut queued = Vec::new();
        for q in std::iter::once(names.queue())
            .chain(tiers.iter().cloned())
            .chain(credit_queues.iter().cloned())
        {
            match warren::broker::inspect_queue(&connection, &q).await {
                Ok(i) if i.ready == 0 => {}
                Ok(i) => queued.push(format!("{q}: {} ready", i.ready)),
                Err(e) => queued.push(format!("{q}: not inspected ({e})")),
            }
        }
        let credit_done = B::credit_state(&store)
            .await
            .map(|s| credit_final(&credit_plan, &s))
            .unwrap_or(false);
        if counts.inbox_rows as usize >= e.valid && pending == 0 && queued.is_empty() && credit_done
        {
            break true;
        }
        waiting_for = format!(
            "inbox {} of {}; outbox pending {pending}; credit limits {}; queues: {}",
            counts.inbox_rows,
            e.valid,
            if credit_done { "final" } else { "not final" },
            if queued.is_empty() {
                "empty".to_owned()
            } else {
                queued.join(", ")
            },
        );
        let overdue = drain_start.elapsed() > spec.drain_deadline;
        // A drain that takes long says what it waits for, so that one that
        // never ends can be read from its output: on the cluster, that
        // includes the messages a queue holds that are not ready (delivered
        // to a consumer that has not settled them, or a quorum retry tier's
        // expired messages the broker has not yet moved on).
        if (overdue || last_report.elapsed() > Duration::from_secs(30))
            && let Some((cluster, ..)) = &spec.cluster
        {
            let not_ready = match cluster.not_ready(&names.prefix).await {
                Ok(q) if q.is_empty() => "none".to_owned(),
                Ok(q) => q
                    .iter()
                    .map(|(q, unacked, held)| format!("{q}: {unacked} unacked, {held} held back"))
                    .collect::<Vec<_>>()
                    .join(", "),
                Err(e) => format!("not listed ({e})"),
            };
            waiting_for.push_str(&format!("; not ready: {not_ready}"));
        }
        if overdue {
            break false;
        }
        if last_report.elapsed() > Duration::from_secs(30) {
            last_report = Instant::now();
            println!(
                "  {:>6.1} s  still draining: {waiting_for}",
                started.elapsed().as_secs_f64()
            );
        }
        fleet.revive(None).await?;
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    fleet.stop_all().await?;

    // The invariants.
    let counts = B::counts(&store, CONSUMER)
        .await
        .map_err(|e| e.to_string())?;
    let audit = B::audit(&store).await.map_err(|e| e.to_string())?;
    // Distinct messages per reason: a process that dies after the dead-letter
    // copy is confirmed and before the original is acked dead-letters it again
    // (at least once, like the relay's publishes); a missing one is a failure.
    // billing stores dead letters as they come: they are counted in the
    // table (every state) and in the queue (not stored yet), one per message.
    let mut dead_ids = std::collections::BTreeMap::<String, HashSet<String>>::new();
    let mut dead_letters = 0;
    for (n, letter) in DeadLetterQueue::new(Arc::clone(&connection), &names.queue())
        .list(usize::MAX)
        .await
        .map_err(|e| e.to_string())?
        .into_iter()
        .enumerate()
    {
        dead_letters += 1;
        let letter_id = letter
            .properties
            .headers()
            .as_ref()
            .and_then(|h| warren::amqp::header_str(h, warren::headers::HEADER_LETTER_ID))
            .map(|s| s.into_owned());
        let id = match (letter.message_id.is_empty(), letter_id) {
            (false, _) => letter.message_id.clone(),
            (true, Some(letter_id)) => letter_id,
            (true, None) => format!("(no id {n})"),
        };
        dead_ids
            .entry(letter.reason().to_owned())
            .or_default()
            .insert(id);
    }
    for state in [
        warren::store::LetterState::Unresolved,
        warren::store::LetterState::Replayed,
        warren::store::LetterState::Resolved,
    ] {
        let filter = warren::store::LetterFilter {
            state,
            consumer: Some(CONSUMER.to_owned()),
            ..warren::store::LetterFilter::default()
        };
        let mut after = None;
        loop {
            let page = store
                .dead_letters(&filter, after.as_ref(), 1000)
                .await
                .map_err(|e| e.to_string())?;
            let Some(last) = page.last() else { break };
            after = Some(warren::store::PageAfter {
                last_failure: last.last_failure,
                letter_id: last.letter_id.clone(),
            });
            for letter in &page {
                dead_letters += 1;
                let id = if letter.message_id.is_empty() {
                    letter.letter_id.clone()
                } else {
                    letter.message_id.clone()
                };
                dead_ids
                    .entry(letter.reason.clone())
                    .or_default()
                    .insert(id);
            }
        }
    }
    let dead: std::collections::BTreeMap<String, usize> = dead_ids
        .iter()
        .map(|(r, ids)| (r.clone(), ids.len()))
        .collect();
    let mut leftover = Vec::new();
    for q in std::iter::once(names.queue())
        .chain(tiers.iter().cloned())
        .chain(credit_queues.iter().cloned())
    {
        let ready = warren::broker::inspect_queue(&connection, &q)
            .await
            .map_err(|e| e.to_string())?;
        if ready.ready > 0 {
            leftover.push(format!("{q}: {}", ready.ready));
        }
    }
    let captured = drain_ids(&connection, &names.recorded_queue()).await?;
    let captured_ids: HashSet<&str> = captured.iter().map(String::as_str).collect();
    let outbox_ids: HashSet<&str> = audit.outbox_ids.iter().map(String::as_str).collect();
    let valid = e.valid as i64;
    let checks = vec![
        Check::new(
            "the stream drained after the faults",
            settled,
            if settled {
                format!("within {} s", spec.drain_deadline.as_secs())
            } else {
                format!(
                    "not within {} s; still waiting for: {waiting_for}",
                    spec.drain_deadline.as_secs()
                )
            },
        ),
        Check::new(
            "every unique valid message applied exactly once",
            counts.inbox_rows == valid
                && counts.invoices_paid == valid
                && counts.loyalty_rows == valid
                && audit.loyalty_messages == valid
                && counts.loyalty_sum == e.loyalty_sum,
            format!(
                "inbox {} · invoices {} · loyalty rows {} for {} messages · points {} (expected {valid} each, {} points)",
                counts.inbox_rows,
                counts.invoices_paid,
                counts.loyalty_rows,
                audit.loyalty_messages,
                counts.loyalty_sum,
                e.loyalty_sum
            ),
        ),
        Check::new(
            "every poison message dead-lettered with its reason, none applied",
            dead == e.poison && audit.poison_invoices == 0,
            format!(
                "distinct dead letters {dead:?} (expected {:?}; {} copies in all); poison invoices recorded {}",
                e.poison, dead_letters, audit.poison_invoices
            ),
        ),
        Check::new(
            "no valid message dead-lettered as poison",
            dead.get("poison").copied().unwrap_or(0) == 0,
            format!(
                "{} dead-lettered as poison; {} solo runs, {} of them after a death in an earlier solo run",
                dead.get("poison").copied().unwrap_or(0),
                fleet.tally().solo_runs,
                fleet.tally().solo_runs_after_a_death
            ),
        ),
        Check::new(
            "nothing left ready or unacked in any queue",
            leftover.is_empty(),
            if leftover.is_empty() {
                "main queue and retry tiers empty after every process stopped".to_owned()
            } else {
                leftover.join(", ")
            },
        ),
        Check::new(
            "one distinct outbox event per applied message, each published and seen once after dedup",
            audit.outbox_ids.len() as i64 == valid
                && outbox_ids.len() as i64 == valid
                && audit.outbox_unpublished == 0
                && captured_ids == outbox_ids,
            format!(
                "outbox rows {} ({} distinct, {} unpublished); captured {} deliveries of {} distinct ids \
                 ({} published again: a confirm lost, or a mark)",
                audit.outbox_ids.len(),
                outbox_ids.len(),
                audit.outbox_unpublished,
                captured.len(),
                captured_ids.len(),
                captured.len().saturating_sub(captured_ids.len())
            ),
        ),
    ];
    let credit_state = B::credit_state(&store).await.map_err(|e| e.to_string())?;
    let mut credit_dead = 0;
    for q in service::credit_config(names, settings)
        .map_err(|e| e.to_string())?
        .partition_queues()
    {
        credit_dead += DeadLetterQueue::new(Arc::clone(&connection), &q)
            .list(usize::MAX)
            .await
            .map_err(|e| e.to_string())?
            .len();
    }
    let mut checks = checks;
    if let Some(o) = &failover {
        checks.push(Check::new(
            format!("{}: another node led {} while its leader was down", o.fault.as_str(), o.queue),
            o.failover.moved(),
            format!(
                "{} before, {} during, {} after; stalled {:.1} s at most, {} suspects alone over {:.1} s",
                o.failover.leader_before,
                o.failover.leaders_during.join(" then "),
                o.failover.leader_after,
                o.stall.as_secs_f64(),
                o.suspects,
                o.lane.as_secs_f64()
            ),
        ));
    }
    // The stale count is not among them: a killed process takes its counters
    // with it.
    for (ok, text) in credit::checks(&credit_plan, &credit_state, 0)
        .into_iter()
        .take(2)
    {
        checks.push(Check::new("credit stream: ordering", ok, text));
    }
    // Where each update a customer lacks went, from the consumer's journal
    // (every outcome but an applied one): the trail a failed run is read by.
    for (customer, version, id) in credit::missing(&credit_plan, &credit_state) {
        let trail = match store.journal_of_message(CREDIT_CONSUMER, &id, 50).await {
            Ok(entries) if entries.is_empty() => "no journal entry".to_owned(),
            Ok(entries) => entries
                .iter()
                .map(|e| format!("{} {}", e.at.format("%H:%M:%S%.3f"), e.described()))
                .collect::<Vec<_>>()
                .join(", "),
            Err(e) => format!("journal not read: {e}"),
        };
        println!(
            "credit trail: {customer} version {version} ({id}) not applied (applied in order: {:?}); {trail}",
            credit_state
                .applied
                .get(&customer)
                .cloned()
                .unwrap_or_default()
        );
    }
    checks.push(Check::new(
        "credit stream: nothing dead-lettered",
        credit_dead == 0,
        format!("{credit_dead} dead letters across the partitions"),
    ));
    let report = Report::new(&campaign, &fleet, checks, started.elapsed());
    println!("{report}");
    let _ = connection.close(200, "chaos done".into()).await;
    Ok(report.passed())
}

/// Reads every message id from a queue, acking as it goes.
async fn drain_ids(
    connection: &warren::lapin::Connection,
    queue: &str,
) -> Result<Vec<String>, String> {
    use warren::lapin::options::{BasicAckOptions, BasicGetOptions};
    let channel = connection
        .create_channel()
        .await
        .map_err(|e| e.to_string())?;
    let mut ids = Vec::new();
    while let Some(got) = channel
        .basic_get(queue.into(), BasicGetOptions::default())
        .await
        .map_err(|e| e.to_string())?
    {
        ids.push(
            got.delivery
                .properties
                .message_id()
                .as_ref()
                .map(|s| s.to_string())
                .unwrap_or_default(),
        );
        got.delivery
            .acker
            .ack(BasicAckOptions::default())
            .await
            .map_err(|e| e.to_string())?;
    }
    let _ = channel.close(200, "drained".into()).await;
    Ok(ids)
}

/// Every customer of the credit plan at its highest version.
fn credit_final(plan: &credit::CreditPlan, state: &credit::CreditState) -> bool {
    plan.last
        .iter()
        .all(|(c, (v, _))| state.limits.get(c).is_some_and(|(_, stored)| stored == v))
}

/// `billing chaos`: the campaign against a fresh database and prefix, and
/// everything removed afterwards unless `keep`.
pub async fn command(
    cli: &Config,
    spec: &ChaosSpec,
    keep: bool,
    pool: u32,
) -> Result<bool, String> {
    let tag = &uuid::Uuid::now_v7().simple().to_string()[26..];
    let names = Names::new(
        &cli.prefix
            .clone()
            .unwrap_or_else(|| format!("billing-chaos-{tag}")),
    );
    let mut tiers = warren::retry::RetryPolicy::new(
        TIERS
            .split(',')
            .map(|t| warren::retry::parse_delay(t).expect("valid tiers")),
    );
    // The retry policy must match the processes' (the topology is derived from it).
    tiers = tiers.with_poison_limit(warren::retry::DEFAULT_POISON_LIMIT);
    let settings = Settings {
        retry: tiers.clone(),
        ..cli.settings(tiers)
    };
    let fresh = scratch::fresh_database(cli, &format!("chaos_{tag}"), pool).await?;
    let url = fresh.url.clone();
    let passed = db::with_store!(fresh.db, |store: B| {
        let passed = run::<B>(store.clone(), url, &cli.amqp_url, &names, &settings, spec).await;
        if !keep {
            B::pool(&store).close().await;
        }
        passed
    });
    if keep {
        println!(
            "kept: prefix {:?}, database {}",
            names.prefix,
            warren_admin::redact_url(&fresh.url)
        );
    } else {
        scratch::teardown(cli, &names, &settings, fresh.schema.as_deref()).await;
        let _ = std::fs::remove_dir_all(&fresh.temp);
    }
    passed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stall_counts_only_while_work_waits() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let samples = [
            (at(0), 10, true),
            (at(100), 20, true),
            // Nothing applied for 800 ms while the stream flows.
            (at(500), 20, true),
            (at(900), 20, true),
            (at(1000), 30, true),
            // Everything applied, the stream done: a pause is no stall.
            (at(1100), 40, false),
            (at(5000), 40, false),
        ];
        let (stall, began) = longest_stall(&samples, t0);
        assert_eq!(stall, Duration::from_millis(800));
        assert_eq!(began, Duration::from_millis(100));
    }

    #[test]
    fn a_cut_off_instance_reaches_postgresql_through_its_socket() {
        assert_eq!(
            through_socket("postgres://u@127.0.0.1:5432/db?sslmode=disable").unwrap(),
            "postgres://u@127.0.0.1:5432/db?sslmode=disable&host=/var/run/postgresql"
        );
        assert_eq!(
            through_socket("postgres://u@127.0.0.1/db").unwrap(),
            "postgres://u@127.0.0.1/db?host=/var/run/postgresql"
        );
        assert!(through_socket("sqlite://billing.db").is_err());
    }

    #[test]
    fn each_process_starts_at_another_node() {
        let urls = "amqp://a,amqp://b,amqp://c";
        assert_eq!(rotated(urls, 0), urls);
        assert_eq!(rotated(urls, 1), "amqp://b,amqp://c,amqp://a");
        assert_eq!(rotated(urls, 4), "amqp://b,amqp://c,amqp://a");
        assert_eq!(rotated("amqp://one", 3), "amqp://one");
    }
}
