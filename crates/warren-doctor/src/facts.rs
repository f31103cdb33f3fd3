//! What the doctor learns about a broker, read from the management API's
//! JSON, from `rabbitmqctl environment` and from an AMQP connection. The same
//! readers take live answers and the responses recorded in the tests.

use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::{Map, Value};

use super::version::Version;

/// Everything known about the broker, each part with why it is missing.
#[derive(Debug, Clone, Default)]
pub struct BrokerFacts {
    /// From the management HTTP API.
    pub api: Option<ApiFacts>,
    /// Why [`api`](Self::api) is missing.
    pub api_missing: Option<String>,
    /// The node settings the HTTP API does not show.
    pub node: Option<NodeSettings>,
    /// Why [`node`](Self::node) is missing.
    pub node_missing: Option<String>,
    /// From an AMQP connection.
    pub connection: Option<ConnectionFacts>,
    /// Why [`connection`](Self::connection) is missing.
    pub connection_missing: Option<String>,
}

/// What the management API says.
#[derive(Debug, Clone, Default)]
pub struct ApiFacts {
    /// `rabbitmq_version` of `/api/overview`, as reported.
    pub version_text: String,
    /// The version, if it reads as one.
    pub version: Option<Version>,
    /// The node that answered (`node`).
    pub node: String,
    /// The exchange types the broker knows (plugins add some).
    pub exchange_types: Vec<String>,
    /// Feature flags: name to (state, stability).
    pub feature_flags: BTreeMap<String, (String, String)>,
    /// Each of the consumer's queues, `None` where it does not exist.
    pub queues: BTreeMap<String, Option<QueueFacts>>,
}

/// One queue as the management API shows it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct QueueFacts {
    /// `classic`, `quorum` or `stream`.
    pub queue_type: String,
    /// The arguments it was declared with.
    pub arguments: Map<String, Value>,
    /// The policy that applies, with its definition.
    pub policy: Option<Policy>,
    /// The operator policy that applies, with its definition.
    pub operator_policy: Option<Policy>,
    /// `effective_policy_definition`: the policy and the operator policy
    /// merged by the broker (without the arguments).
    pub effective_policy: Map<String, Value>,
    /// Consumers subscribed.
    pub consumers: u64,
}

/// A policy or operator policy applied to a queue.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Policy {
    /// Its name.
    pub name: String,
    /// Its definition, where it could be read (reading policies needs the
    /// `policymaker` tag, operator policies `administrator`).
    pub definition: Option<Map<String, Value>>,
}

impl ApiFacts {
    /// Reads `/api/overview` and `/api/feature-flags` (the latter may be
    /// missing: it needs more than `monitoring` on some versions).
    pub fn read(overview: &Value, feature_flags: Option<&Value>) -> Result<Self, String> {
        let version_text = overview
            .get("rabbitmq_version")
            .and_then(Value::as_str)
            .ok_or("the overview has no rabbitmq_version")?
            .to_owned();
        let exchange_types = overview
            .get("exchange_types")
            .and_then(Value::as_array)
            .map(|types| {
                types
                    .iter()
                    .filter_map(|t| t.get("name").and_then(Value::as_str))
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default();
        let feature_flags = feature_flags
            .and_then(Value::as_array)
            .map(|flags| {
                flags
                    .iter()
                    .filter_map(|f| {
                        let text = |k: &str| f.get(k).and_then(Value::as_str).unwrap_or("");
                        let name = text("name");
                        (!name.is_empty()).then(|| {
                            (
                                name.to_owned(),
                                (text("state").into(), text("stability").into()),
                            )
                        })
                    })
                    .collect()
            })
            .unwrap_or_default();
        Ok(ApiFacts {
            version: Version::parse(&version_text),
            version_text,
            node: overview
                .get("node")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_owned(),
            exchange_types,
            feature_flags,
            queues: BTreeMap::new(),
        })
    }
}

impl QueueFacts {
    /// Reads `/api/queues/{vhost}/{name}`, with the definitions of its policy
    /// and operator policy where they could be read.
    pub fn read(
        queue: &Value,
        policy: Option<&Value>,
        operator_policy: Option<&Value>,
    ) -> Result<Self, String> {
        let object = queue.as_object().ok_or("a queue is not a JSON object")?;
        let map = |key: &str| {
            object
                .get(key)
                .and_then(Value::as_object)
                .cloned()
                .unwrap_or_default()
        };
        let named = |key: &str, body: Option<&Value>| {
            let name = object.get(key).and_then(Value::as_str)?;
            Some(Policy {
                name: name.to_owned(),
                definition: body
                    .and_then(|b| b.get("definition"))
                    .and_then(Value::as_object)
                    .cloned(),
            })
        };
        Ok(QueueFacts {
            queue_type: object
                .get("type")
                .and_then(Value::as_str)
                .unwrap_or("classic")
                .to_owned(),
            arguments: map("arguments"),
            policy: named("policy", policy),
            operator_policy: named("operator_policy", operator_policy),
            effective_policy: map("effective_policy_definition"),
            consumers: object.get("consumers").and_then(Value::as_u64).unwrap_or(0),
        })
    }
}

impl QueueFacts {
    /// Reads a queue with the policy lists of its virtual host
    /// (`/api/policies/{vhost}`, `/api/operator-policies/{vhost}`, which any
    /// management user with access to the virtual host may read; `None`
    /// where one was refused). The policy that applies is found in the list
    /// as the broker finds it, by pattern, `apply-to` and priority: the
    /// queue's own `policy` field lags until its statistics are next
    /// emitted. Where a list is missing or a pattern does not read, the
    /// queue's field names the policy.
    pub fn read_listed(
        queue: &Value,
        policies: Option<&[Value]>,
        operator_policies: Option<&[Value]>,
    ) -> Result<Self, String> {
        let name = queue.get("name").and_then(Value::as_str).unwrap_or("");
        let kind = queue
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or("classic");
        let pick = |items: Option<&[Value]>, key: &str| -> Option<Value> {
            let items = items?;
            if let Some(found) = applicable(items, name, kind) {
                return found.cloned();
            }
            let named = queue.get(key).and_then(Value::as_str)?;
            items
                .iter()
                .find(|p| p.get("name").and_then(Value::as_str) == Some(named))
                .cloned()
        };
        let policy = pick(policies, "policy");
        let operator = pick(operator_policies, "operator_policy");
        let mut queue = queue.clone();
        if let Some(object) = queue.as_object_mut() {
            // The names of what applies now, where the lists could tell.
            for (key, list, found) in [
                ("policy", policies, &policy),
                ("operator_policy", operator_policies, &operator),
            ] {
                if list.is_some_and(|l| applicable(l, name, kind).is_some()) {
                    let value = found
                        .as_ref()
                        .and_then(|p| p.get("name").cloned())
                        .unwrap_or(Value::Null);
                    object.insert(key.to_owned(), value);
                }
            }
        }
        QueueFacts::read(&queue, policy.as_ref(), operator.as_ref())
    }
}

/// The policy of `policies` the broker applies to queue `name` of type
/// `kind`: the highest priority among those whose pattern matches the name
/// and whose `apply-to` covers the queue. `Some(None)`: none applies;
/// `None`: a pattern could not be read, so the list cannot tell.
fn applicable<'a>(policies: &'a [Value], name: &str, kind: &str) -> Option<Option<&'a Value>> {
    let mut best: Option<(i64, &Value)> = None;
    for policy in policies {
        let applies_to = policy
            .get("apply-to")
            .and_then(Value::as_str)
            .unwrap_or("all");
        let covers = match applies_to {
            "all" | "queues" => true,
            "classic_queues" => kind == "classic",
            "quorum_queues" => kind == "quorum",
            "streams" => kind == "stream",
            _ => false,
        };
        if !covers {
            continue;
        }
        let pattern = policy.get("pattern").and_then(Value::as_str).unwrap_or("");
        let regex = regex_lite::Regex::new(pattern).ok()?;
        if !regex.is_match(name) {
            continue;
        }
        let priority = policy.get("priority").and_then(Value::as_i64).unwrap_or(0);
        if best.is_none_or(|(p, _)| priority > p) {
            best = Some((priority, policy));
        }
    }
    Some(best.map(|(_, p)| p))
}

/// Node settings that 3.10's HTTP API does not show, read from
/// `rabbitmqctl environment`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NodeSettings {
    /// The node the settings are of.
    pub node: String,
    /// `consumer_timeout` in milliseconds; `None` when turned off.
    pub consumer_timeout_ms: Option<u64>,
    /// `max_message_size` in bytes, if set.
    pub max_message_size: Option<u64>,
    /// `frame_max` in bytes, if set.
    pub frame_max: Option<u64>,
    /// How long a quorum queue's dead-letter worker waits for the confirm of
    /// a message it handed on before it sends it again, in milliseconds, if
    /// set: `dead_letter_worker_publisher_confirm_timeout_ms` (4.x) or
    /// `dead_letter_worker_publisher_confirm_timeout` (3.x).
    pub dead_letter_resend_ms: Option<u64>,
}

impl NodeSettings {
    /// Reads what `rabbitmqctl environment` prints: a first line naming the
    /// node, then the application environments as Erlang terms, the `rabbit`
    /// application's among them. A key the node does not set is reported as
    /// its absence: `consumer_timeout` absent or `false` means no timeout.
    pub fn read_environment(text: &str) -> Result<Self, String> {
        let node = text
            .lines()
            .find_map(|l| l.strip_prefix("Application environment of node "))
            .map(|rest| rest.trim_end_matches(" ...").trim().to_owned())
            .ok_or(
                "no \"Application environment of node\" line: not rabbitmqctl environment's output",
            )?;
        let rabbit = rabbit_section(text)
            .ok_or("no {rabbit, [...]} section in rabbitmqctl environment's output")?;
        let number = |key: &str| setting(rabbit, key).and_then(|v| v.parse::<u64>().ok());
        Ok(NodeSettings {
            node,
            consumer_timeout_ms: number("consumer_timeout"),
            max_message_size: number("max_message_size"),
            frame_max: number("frame_max"),
            dead_letter_resend_ms: number("dead_letter_worker_publisher_confirm_timeout_ms")
                .or_else(|| number("dead_letter_worker_publisher_confirm_timeout")),
        })
    }
}

/// The text of the `{rabbit, [...]}` term, up to its closing brace. Strings
/// and quoted atoms are stepped over: log formats hold brackets.
fn rabbit_section(text: &str) -> Option<&str> {
    let start = text.find("{rabbit,")?;
    let rest = &text[start..];
    let mut depth = 0usize;
    let mut quote: Option<char> = None;
    let mut escaped = false;
    for (i, c) in rest.char_indices() {
        if let Some(q) = quote {
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == q {
                quote = None;
            }
            continue;
        }
        match c {
            '"' | '\'' => quote = Some(c),
            '{' | '[' => depth += 1,
            '}' | ']' => {
                depth = depth.checked_sub(1)?;
                if depth == 0 {
                    return Some(&rest[..=i]);
                }
            }
            _ => {}
        }
    }
    None
}

/// The value of `{key,VALUE}` at the rabbit application's top level: a
/// number or an atom.
fn setting<'a>(section: &'a str, key: &str) -> Option<&'a str> {
    let pattern = format!("{{{key},");
    let at = section.find(&pattern)? + pattern.len();
    let rest = section[at..].trim_start();
    let end = rest.find(['}', ','])?;
    Some(rest[..end].trim())
}

/// What an AMQP connection to the broker shows.
#[derive(Debug, Clone, Default)]
pub struct ConnectionFacts {
    /// The frame size agreed in `connection.tune`.
    pub frame_max: u32,
    /// The consistent-hash ring probe, for a partitioned consumer: `Ok(true)`
    /// when the hash exchange does not exist yet, `Ok(false)` when it and
    /// every partition queue do, `Err` with what is broken.
    pub ring: Option<Result<bool, String>>,
}

#[cfg(test)]
mod tests {
    use super::*;

    const ENVIRONMENT: &str = "Application environment of node rabbit@localhost ...
[{amqp10_common,[]},
 {rabbit,
     [{auth_backends,[rabbit_auth_backend_internal]},
      {consumer_timeout,1800000},
      {dead_letter_worker_publisher_confirm_timeout,180000},
      {frame_max,131072},
      {log,[{console,[{formatter,{rabbit_logger_text_fmt,#{prefix_format => [time,\" [\",level,\"] \"]}}}]}]},
      {loopback_users,[<<\"guest\">>]},
      {max_message_size,134217728},
      {tcp_listen_options,[{backlog,128},{nodelay,true}]}]},
 {rabbit_common,[]}]
";

    #[test]
    fn node_settings_read_from_rabbitmqctl_environment() {
        let settings = NodeSettings::read_environment(ENVIRONMENT).unwrap();
        assert_eq!(settings.node, "rabbit@localhost");
        assert_eq!(settings.consumer_timeout_ms, Some(1_800_000));
        assert_eq!(settings.max_message_size, Some(134_217_728));
        assert_eq!(settings.frame_max, Some(131_072));
        assert_eq!(settings.dead_letter_resend_ms, Some(180_000));
        // 4.x names it with _ms; either is read, not a prefix of the other.
        let four = ENVIRONMENT.replace(
            "{dead_letter_worker_publisher_confirm_timeout,180000}",
            "{dead_letter_worker_publisher_confirm_timeout_ms,15000}",
        );
        let settings = NodeSettings::read_environment(&four).unwrap();
        assert_eq!(settings.dead_letter_resend_ms, Some(15_000));
    }

    #[test]
    fn a_timeout_turned_off_or_unset_reads_as_none() {
        let off = ENVIRONMENT.replace("{consumer_timeout,1800000}", "{consumer_timeout,false}");
        assert_eq!(
            NodeSettings::read_environment(&off)
                .unwrap()
                .consumer_timeout_ms,
            None
        );
        let unset = ENVIRONMENT.replace("{consumer_timeout,1800000},", "");
        assert_eq!(
            NodeSettings::read_environment(&unset)
                .unwrap()
                .consumer_timeout_ms,
            None
        );
        // A key of another application is not the rabbit application's.
        let elsewhere = unset.replace(
            "{amqp10_common,[]}",
            "{amqp10_common,[{consumer_timeout,5}]}",
        );
        assert_eq!(
            NodeSettings::read_environment(&elsewhere)
                .unwrap()
                .consumer_timeout_ms,
            None
        );
    }

    #[test]
    fn the_policy_that_applies_is_found_by_pattern_apply_to_and_priority() {
        use serde_json::json;
        let policies = vec![
            json!({"name": "all-low", "pattern": ".*", "apply-to": "all", "priority": 0,
                   "definition": {"max-length": 5}}),
            json!({"name": "orders", "pattern": "^orders\\.", "apply-to": "quorum_queues",
                   "priority": 5, "definition": {"delivery-limit": 20}}),
            json!({"name": "exchanges", "pattern": ".*", "apply-to": "exchanges",
                   "priority": 9, "definition": {}}),
        ];
        // The queue's own field still names a policy deleted seconds ago.
        let queue = json!({"name": "orders.dead-letter", "type": "quorum",
                           "arguments": {}, "policy": "deleted"});
        let facts = QueueFacts::read_listed(&queue, Some(&policies), Some(&[])).unwrap();
        let policy = facts.policy.unwrap();
        assert_eq!(policy.name, "orders");
        assert_eq!(policy.definition.unwrap()["delivery-limit"], 20);
        assert_eq!(facts.operator_policy, None);
        // A classic queue of the same name: only the policy for all queues.
        let classic = json!({"name": "orders.dead-letter", "type": "classic", "arguments": {}});
        let facts = QueueFacts::read_listed(&classic, Some(&policies), None).unwrap();
        assert_eq!(facts.policy.unwrap().name, "all-low");
        // Nothing matches: no policy, whatever the stale field says.
        let other = json!({"name": "billing", "type": "quorum", "arguments": {}, "policy": "gone"});
        let only = vec![policies[1].clone()];
        assert_eq!(
            QueueFacts::read_listed(&other, Some(&only), None)
                .unwrap()
                .policy,
            None
        );
        // Without the list, the queue's field is all there is.
        let named = QueueFacts::read_listed(&other, None, None).unwrap();
        assert_eq!(named.policy.unwrap().definition, None);
    }

    #[test]
    fn other_output_is_refused() {
        assert!(NodeSettings::read_environment("Error: unable to perform an operation").is_err());
    }
}
