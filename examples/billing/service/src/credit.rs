//! billing's second stream: customer credit limits, partitioned by customer and
//! applied latest-version-wins.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use warren::version::{Verdict, VersionMode};
use warren::{HandlerError, Message, Outgoing, Registry, State, Tx};

use crate::amount::Amount;
use crate::db::BillingDb;
use crate::handlers::identifier;

/// The credit consumer's name: its own deduplication boundary.
pub const CREDIT_CONSUMER: &str = "billing-credit";
/// Incoming event type.
pub const LIMIT_SET: &str = "billing.customer-credit-limit-set.v1";
/// The event billing emits through its outbox for every applied version.
pub const LIMIT_CHANGED: &str = "billing.customer-credit-limit-changed.v1";
/// The version gate's scope.
const SCOPE: &str = "customer-credit";

/// `billing.customer-credit-limit-set.v1`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CreditLimitSet {
    /// The customer whose limit this sets.
    pub customer_id: String,
    /// The JSON text as the producer wrote it, read exactly.
    pub credit_limit: Box<RawValue>,
    /// The limit's version; each customer's start at 1.
    pub version: i64,
}

/// `billing.customer-credit-limit-changed.v1`, written to the outbox.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CreditLimitChanged {
    /// The customer whose limit changed.
    pub customer_id: String,
    /// Exact decimal text.
    pub credit_limit: String,
    /// The version now applied.
    pub version: i64,
    /// The version it replaced (0 for a new customer).
    pub previous_version: i64,
}

/// A validated credit limit, ready to apply.
#[derive(Debug, Clone)]
pub struct CreditLimit {
    /// The customer.
    pub customer_id: String,
    /// Canonical decimal text.
    pub credit_limit: String,
    /// The version to apply.
    pub version: i64,
}

/// Latest version wins: the gate drops a version not newer than the applied
/// one (acked, counted as stale); a newer one updates the limit, records the
/// change and emits an event, all in the transaction of the inbox claim.
pub async fn limit_set<B: BillingDb>(
    State(exchange): State<Arc<str>>,
    msg: Message<CreditLimitSet>,
    tx: &mut Tx<B>,
) -> Result<(), HandlerError> {
    let p = &msg.payload;
    identifier("customerId", &p.customer_id)?;
    // The header decides the partition; a producer that sets it to anything
    // but the customer would spread one customer over several partitions.
    if msg.partition_key.as_deref() != Some(p.customer_id.as_str()) {
        return Err(HandlerError::permanent(format!(
            "the partition-key header ({:?}) must equal customerId",
            msg.partition_key.as_deref().map(crate::amount::shown)
        )));
    }
    if p.version < 1 {
        return Err(HandlerError::permanent(format!(
            "version is {}; versions start at 1",
            p.version
        )));
    }
    let limit = Amount::from_json(p.credit_limit.get()).map_err(HandlerError::permanent)?;
    if limit.is_negative() {
        return Err(HandlerError::permanent(format!(
            "creditLimit {limit} is negative"
        )));
    }
    if p.customer_id.starts_with("cus_flaky") && msg.attempt <= 2 {
        return Err(HandlerError::transient(format!(
            "credit bureau timed out (simulated, attempt {})",
            msg.attempt
        )));
    }
    let previous = match tx
        .check_version(SCOPE, &p.customer_id, p.version, VersionMode::LatestWins)
        .await?
    {
        Verdict::Stale { .. } => return Ok(()),
        Verdict::Apply { previous } => previous,
    };
    let change = CreditLimit {
        customer_id: p.customer_id.clone(),
        credit_limit: limit.to_string(),
        version: p.version,
    };
    B::apply_credit_limit(tx, &change, &msg.meta.message_id).await?;
    let event = Outgoing::new(
        LIMIT_CHANGED,
        1,
        &CreditLimitChanged {
            customer_id: change.customer_id.clone(),
            credit_limit: change.credit_limit.clone(),
            version: change.version,
            previous_version: previous,
        },
    )
    .map_err(HandlerError::permanent)?
    .with_partition_key(&change.customer_id);
    tx.publish(&exchange, LIMIT_CHANGED, event).await?;
    Ok(())
}

/// The credit consumer's routing table.
pub fn routes<B: BillingDb>(exchange: &str) -> Registry<B, Arc<str>> {
    Registry::with_state(Arc::<str>::from(exchange)).route(LIMIT_SET, 1, limit_set::<B>)
}

/// What the credit tables hold, for the checks.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CreditState {
    /// customer -> (credit limit, version).
    pub limits: BTreeMap<String, (String, i64)>,
    /// customer -> versions in the order they were applied (`applied_seq`).
    pub applied: BTreeMap<String, Vec<i64>>,
}

/// A credit-limit stream: in order, shuffled, with duplicated versions.
#[derive(Debug, Clone)]
pub struct CreditSpec {
    /// Customers in the stream.
    pub customers: usize,
    /// Versions per customer.
    pub versions: i64,
    /// Share of versions published a second time.
    pub duplicates: f64,
    /// Customers whose messages fail twice before they apply (`cus_flaky_*`).
    pub flaky: usize,
    /// The seed of the shuffle and the duplicates.
    pub seed: u64,
}

/// A planned credit stream and what must come of it.
#[derive(Debug, Clone)]
pub struct CreditPlan {
    /// In publishing order.
    pub messages: Vec<Outgoing>,
    /// Distinct messages.
    pub unique: usize,
    /// customer -> (highest version, its limit).
    pub last: BTreeMap<String, (i64, String)>,
    /// customer -> (version, message id) of each distinct message.
    pub ids: BTreeMap<String, Vec<(i64, String)>>,
}

/// The limit version `v` of a customer sets: deterministic, so the expected final
/// state is known.
fn limit_of(customer: usize, version: i64) -> String {
    // Cents never end in 0, so every database prints the value as written.
    format!(
        "{}.{}",
        1000 + customer as i64 * 10 + version,
        11 * (1 + version % 8)
    )
}

/// Plans the stream: the first half of the customers' versions in order, the
/// rest shuffled, and `duplicates` of all of them sent again.
pub fn plan(spec: &CreditSpec) -> CreditPlan {
    let mut rng = fastrand::Rng::with_seed(spec.seed ^ 0xc4ed17);
    let name = |i: usize| {
        if i < spec.flaky {
            format!("cus_flaky_credit_{i}")
        } else {
            format!("cus_credit_{i}")
        }
    };
    let mut ordered = Vec::new();
    let mut shuffled = Vec::new();
    let mut last = BTreeMap::new();
    let mut ids: BTreeMap<String, Vec<(i64, String)>> = BTreeMap::new();
    for i in 0..spec.customers {
        let customer = name(i);
        for v in 1..=spec.versions {
            let limit = limit_of(i, v);
            let payload = serde_json::json!({
                "customerId": customer, "creditLimit": RawNumber(&limit), "version": v,
            });
            let message = Outgoing::new(LIMIT_SET, 1, &payload)
                .expect("a serializable payload")
                .with_partition_key(&customer);
            ids.entry(customer.clone())
                .or_default()
                .push((v, message.meta().message_id.clone()));
            if i % 2 == 0 {
                ordered.push(message);
            } else {
                shuffled.push(message);
            }
        }
        last.insert(customer, (spec.versions, limit_of(i, spec.versions)));
    }
    rng.shuffle(&mut shuffled);
    let mut messages = ordered;
    // Interleave the shuffled half into the ordered half at random places;
    // the ordered half keeps its own order.
    for m in shuffled {
        let at = rng.usize(..=messages.len());
        messages.insert(at, m);
    }
    let unique = messages.len();
    let copies: Vec<Outgoing> = messages
        .iter()
        .filter(|_| rng.f64() < spec.duplicates)
        .cloned()
        .collect();
    for c in copies {
        let at = rng.usize(..=messages.len());
        messages.insert(at, c);
    }
    CreditPlan {
        messages,
        unique,
        last,
        ids,
    }
}

/// A decimal written into JSON as a number, digits untouched.
struct RawNumber<'a>(&'a str);

impl Serialize for RawNumber<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        RawValue::from_string(self.0.to_owned())
            .map_err(serde::ser::Error::custom)?
            .serialize(s)
    }
}

/// The messages a customer's final state lacks: for each customer not at
/// its highest version, those of versions above the one applied, as
/// `(customer, version, message id)`.
pub fn missing(plan: &CreditPlan, state: &CreditState) -> Vec<(String, i64, String)> {
    plan.ids
        .iter()
        .flat_map(|(customer, ids)| {
            let applied = state.limits.get(customer).map_or(0, |(_, v)| *v);
            ids.iter()
                .filter(move |(v, _)| *v > applied)
                .map(move |(v, id)| (customer.clone(), *v, id.clone()))
        })
        .collect()
}

/// The ordering checks on what the tables hold: `(ok, text)` per check.
pub fn checks(plan: &CreditPlan, state: &CreditState, stale: u64) -> Vec<(bool, String)> {
    let wrong_final: Vec<&String> = plan
        .last
        .iter()
        .filter(|(c, (v, limit))| state.limits.get(*c) != Some(&(limit.clone(), *v)))
        .map(|(c, _)| c)
        .collect();
    let out_of_order: BTreeSet<&String> = state
        .applied
        .iter()
        .filter(|(_, versions)| versions.windows(2).any(|w| w[0] >= w[1]))
        .map(|(c, _)| c)
        .collect();
    let applied: usize = state.applied.values().map(Vec::len).sum();
    vec![
        (
            wrong_final.is_empty(),
            format!(
                "credit limits = the highest version per customer ({} customers, {} wrong{})",
                plan.last.len(),
                wrong_final.len(),
                wrong_final
                    .first()
                    .map(|c| format!(", e.g. {c}"))
                    .unwrap_or_default()
            ),
        ),
        (
            out_of_order.is_empty(),
            format!(
                "per customer, applied versions only increase ({} customers out of order)",
                out_of_order.len()
            ),
        ),
        (
            applied + stale as usize == plan.unique,
            format!(
                "every distinct version applied or dropped as stale: {applied} applied + {stale} stale = {} distinct",
                plan.unique
            ),
        ),
    ]
}

/// Publishes the plan to `exchange` with routing key = event type, a batch of
/// confirms at a time.
pub async fn publish(
    connection: &Arc<warren::lapin::Connection>,
    exchange: &str,
    plan: &CreditPlan,
) -> Result<(), String> {
    let publisher = warren::broker::Publisher::new(Arc::clone(connection));
    for chunk in plan.messages.chunks(200) {
        let bodies: Vec<Vec<u8>> = chunk.iter().map(Outgoing::body).collect();
        let items: Vec<_> = chunk
            .iter()
            .zip(&bodies)
            .map(|(m, body)| warren::broker::BatchItem {
                exchange,
                routing_key: LIMIT_SET,
                body,
                properties: m.properties(),
            })
            .collect();
        for result in publisher.publish_batch(&items).await {
            result.map_err(|e| format!("publish failed: {e}"))?;
        }
    }
    Ok(())
}

impl CreditPlan {
    /// The plan as raw messages, for publishers that take those.
    pub fn as_stream(&self) -> crate::stream::Plan {
        crate::stream::Plan {
            messages: self
                .messages
                .iter()
                .map(|m| crate::stream::Planned {
                    routing_key: LIMIT_SET.to_owned(),
                    body: m.body(),
                    properties: m.properties(),
                })
                .collect(),
            expected: crate::stream::Expected::default(),
        }
    }
}

/// The credit handler through warren's test kit: billing's real routing table
/// and partitioned consumer configuration, an SQLite database in memory.
#[cfg(test)]
mod tests {

    use warren::SqliteStore;
    use warren::sqlx::Sqlite;
    use warren::testing::{Settled, TestConsumer, sqlite_in_memory};
    use warren_admin::DeadLetterReason;

    use super::*;
    use crate::service::{Names, Settings, credit_config};

    async fn kit() -> TestConsumer<SqliteStore> {
        let store = sqlite_in_memory().await.unwrap();
        Sqlite::create_tables(&store).await.unwrap();
        let names = Names::new("billing");
        let settings = Settings::default();
        TestConsumer::new(
            credit_config(&names, &settings).unwrap(),
            store,
            routes::<Sqlite>(&names.exchange()),
        )
        .await
        .unwrap()
    }

    fn set(customer: &str, limit: &str, version: i64) -> Outgoing {
        let payload = CreditLimitSet {
            customer_id: customer.into(),
            credit_limit: RawValue::from_string(limit.to_owned()).unwrap(),
            version,
        };
        Outgoing::new(LIMIT_SET, 1, &payload)
            .unwrap()
            .with_partition_key(customer)
    }

    async fn state(kit: &TestConsumer<SqliteStore>) -> CreditState {
        Sqlite::credit_state(kit.store()).await.unwrap()
    }

    #[tokio::test]
    async fn newer_versions_apply_and_an_older_one_is_stale() {
        let kit = kit().await;
        assert_eq!(
            kit.deliver(&set("cus_1", "100.50", 1)).await,
            Settled::Applied
        );
        assert_eq!(kit.deliver(&set("cus_1", "250", 3)).await, Settled::Applied);
        assert_eq!(kit.deliver(&set("cus_1", "75", 2)).await, Settled::Stale);
        let s = state(&kit).await;
        assert_eq!(s.limits["cus_1"], ("250".to_owned(), 3));
        assert_eq!(s.applied["cus_1"], [1, 3], "applied in this order");
        let events = kit.outbox().await.unwrap();
        let versions: Vec<i64> = events
            .iter()
            .map(|e| {
                assert_eq!(e.routing_key, LIMIT_CHANGED);
                e.payload::<CreditLimitChanged>().unwrap().version
            })
            .collect();
        assert_eq!(versions, [1, 3], "one event per version applied");
    }

    #[tokio::test]
    async fn a_negative_limit_and_a_foreign_partition_key_are_permanent() {
        let kit = kit().await;
        let Settled::DeadLettered { reason, error, .. } = kit.deliver(&set("cus_2", "-5", 1)).await
        else {
            panic!("a negative limit is not applied");
        };
        assert_eq!(reason, DeadLetterReason::Permanent);
        assert!(error.contains("negative"), "{error}");
        let split = set("cus_2", "10", 1).with_partition_key("cus_other");
        let Settled::DeadLettered { reason, error, .. } = kit.deliver(&split).await else {
            panic!("a key that differs from the customer would split it over partitions");
        };
        assert_eq!(reason, DeadLetterReason::Permanent);
        assert!(error.contains("partition-key"), "{error}");
        assert!(state(&kit).await.limits.is_empty(), "nothing applied");
    }

    #[tokio::test]
    async fn a_flaky_customer_fails_twice_then_applies() {
        let kit = kit().await;
        assert!(matches!(
            kit.deliver(&set("cus_flaky_1", "5", 1)).await,
            Settled::Retried { attempt: 1, .. }
        ));
        assert!(matches!(
            kit.next_attempt().await,
            Settled::Retried { attempt: 2, .. }
        ));
        assert_eq!(kit.next_attempt().await, Settled::Applied);
        assert_eq!(state(&kit).await.limits["cus_flaky_1"], ("5".to_owned(), 1));
    }
}
