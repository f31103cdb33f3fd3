//! What changed between RabbitMQ versions that a warren deployment can trip
//! on, as rules on the broker's version. Each rule names the release note it
//! was written from (docs/doctor.md lists them, and which could not be
//! confirmed here, where only 3.10 runs).

use std::fmt;

/// A RabbitMQ version, as the management API reports it (`3.10.8`,
/// `4.0.0-rc.1`, `3.13.7+2.g1234`): pre-release and build suffixes are
/// ignored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Version {
    /// The major version.
    pub major: u32,
    /// The minor version.
    pub minor: u32,
    /// The patch version (0 when absent).
    pub patch: u32,
}

impl Version {
    /// `major.minor.patch`.
    pub const fn new(major: u32, minor: u32, patch: u32) -> Self {
        Version {
            major,
            minor,
            patch,
        }
    }

    /// Reads `3.10.8`, `4.0`, `4.1.0-beta.2` or `3.13.7+2.g1`; `None` for
    /// anything else.
    pub fn parse(text: &str) -> Option<Self> {
        let core = text.trim().split(['-', '+']).next()?;
        let mut parts = core.split('.');
        let major = parts.next()?.parse().ok()?;
        let minor = parts.next()?.parse().ok()?;
        let patch = match parts.next() {
            Some(p) => p.parse().ok()?,
            None => 0,
        };
        if parts.next().is_some() {
            return None;
        }
        Some(Version::new(major, minor, patch))
    }

    fn at_least(self, major: u32, minor: u32) -> bool {
        (self.major, self.minor) >= (major, minor)
    }

    /// The delivery limit a quorum queue has when neither an argument nor a
    /// policy sets one: 20 since 4.0 (release notes 4.0.1, "Quorum queues
    /// now have a default redelivery limit"), none before.
    pub fn quorum_default_delivery_limit(self) -> Option<i64> {
        self.at_least(4, 0).then_some(20)
    }

    /// What a negative delivery limit means on a quorum queue: on 3.x the
    /// queue compares the count against it as it is, so every returned
    /// message is over it, as if it were 0 (policies refuse negative values;
    /// the `x-delivery-limit` argument does not); from 4.0 a negative limit
    /// turns the limit off (release notes 4.0.1: "can be disabled by setting
    /// a delivery limit configuration of -1").
    pub fn negative_delivery_limit(self) -> NegativeLimit {
        if self.at_least(4, 0) {
            NegativeLimit::Unlimited
        } else {
            NegativeLimit::Zero
        }
    }

    /// The default `max_message_size` in bytes: 128 MiB from 3.8, 16 MiB from
    /// 4.0 (release notes 4.0.1, "max_message_size default reduced").
    pub fn default_max_message_size(self) -> u64 {
        if self.at_least(4, 0) {
            16 * 1024 * 1024
        } else {
            128 * 1024 * 1024
        }
    }

    /// Whether the broker reads an `x-death` header that a client publishes
    /// again, counting on from it: until 4.0 (release notes 4.0.1, "RabbitMQ
    /// 4.x will not interpret this x-death header anymore when clients
    /// (re-)publish a message"), except 3.13.0 to 3.13.2, which stopped by
    /// mistake (3.13.3 restored it).
    pub fn x_death_counts_republishes(self) -> bool {
        let mistaken = (Version::new(3, 13, 0)..=Version::new(3, 13, 2)).contains(&self);
        !self.at_least(4, 0) && !mistaken
    }

    /// Whether a quorum queue counts failed deliveries apart from
    /// acquisitions: from 4.3 (release notes 4.3.0, "The delivery limit is
    /// based on delivery-count rather than acquired-count"), `x-delivery-count`
    /// and the delivery limit count rejects and lost consumers only, and
    /// `x-acquired-count` every delivery. Before, `basic.nack` with requeue
    /// counted toward the limit too.
    pub fn counts_acquisitions(self) -> bool {
        self.at_least(4, 3)
    }

    /// What the broker does to a consumer whose delivery stays unacked past
    /// `consumer_timeout`, on a queue of `quorum` type or not.
    pub fn consumer_timeout_action(self, quorum: bool) -> TimeoutAction {
        if self.at_least(4, 3) {
            if quorum {
                TimeoutAction::CancelConsumer
            } else {
                TimeoutAction::Ignored
            }
        } else {
            TimeoutAction::CloseChannel
        }
    }

    /// The `consumer_timeout` in force when the node sets none (or an
    /// invalid one): from 4.3.3 a day (rabbit_channel falls back to
    /// 86400000 ms, commit efe3b7ce4f); before, none.
    pub fn unset_consumer_timeout_ms(self) -> Option<u64> {
        (self >= Version::new(4, 3, 3)).then_some(86_400_000)
    }

    /// Whether the broker refuses transient non-exclusive queues and treats
    /// global QoS as per-consumer unless allowed in its configuration: from
    /// 4.3 (release notes 4.3.0, `global_qos` and `transient_nonexcl_queues`
    /// "advanced from permitted_by_default to denied_by_default").
    pub fn refuses_deprecated_features(self) -> bool {
        self.at_least(4, 3)
    }
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// What a negative delivery limit means on one broker version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NegativeLimit {
    /// 3.x: every redelivery is over the limit.
    Zero,
    /// 4.0 and later: the limit is off.
    Unlimited,
}

/// What the broker does when a delivery outlasts `consumer_timeout`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TimeoutAction {
    /// Closes the channel with `PRECONDITION_FAILED`: every unacked delivery
    /// of the channel goes back to the queue (3.x up to 4.2).
    CloseChannel,
    /// Sends `basic.cancel` to the consumer and returns its deliveries (4.3+,
    /// quorum queues; a client without `consumer_cancel_notify` has its
    /// channel closed instead).
    CancelConsumer,
    /// Nothing: the timeout applies to quorum queues only (4.3+).
    Ignored,
}

impl TimeoutAction {
    /// For people.
    pub fn describe(self) -> &'static str {
        match self {
            TimeoutAction::CloseChannel => {
                "closes the channel (PRECONDITION_FAILED), returning every unacked delivery on it"
            }
            TimeoutAction::CancelConsumer => {
                "cancels the consumer (basic.cancel) and returns its unacked deliveries"
            }
            TimeoutAction::Ignored => "does nothing: the timeout applies to quorum queues only",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_read_with_and_without_suffixes() {
        assert_eq!(Version::parse("3.10.8"), Some(Version::new(3, 10, 8)));
        assert_eq!(Version::parse("4.0"), Some(Version::new(4, 0, 0)));
        assert_eq!(Version::parse("4.1.0-beta.2"), Some(Version::new(4, 1, 0)));
        assert_eq!(
            Version::parse("3.13.7+2.g1234"),
            Some(Version::new(3, 13, 7))
        );
        assert_eq!(Version::parse("three"), None);
        assert_eq!(Version::parse("3"), None);
        assert_eq!(Version::parse("3.10.8.1"), None);
        assert!(Version::new(3, 13, 0) > Version::new(3, 10, 8));
        assert!(Version::new(4, 0, 0) > Version::new(3, 13, 7));
    }

    #[test]
    fn each_rule_turns_at_its_release() {
        let v = |s| Version::parse(s).unwrap();
        assert_eq!(v("3.13.7").quorum_default_delivery_limit(), None);
        assert_eq!(v("4.0.0").quorum_default_delivery_limit(), Some(20));
        assert_eq!(v("3.10.8").negative_delivery_limit(), NegativeLimit::Zero);
        assert_eq!(
            v("4.0.1").negative_delivery_limit(),
            NegativeLimit::Unlimited
        );
        assert_eq!(v("3.13.7").default_max_message_size(), 134_217_728);
        assert_eq!(v("4.0.0").default_max_message_size(), 16_777_216);
        assert!(v("3.12.14").x_death_counts_republishes());
        assert!(!v("3.13.0").x_death_counts_republishes());
        assert!(v("3.13.3").x_death_counts_republishes());
        assert!(!v("4.0.1").x_death_counts_republishes());
        assert!(!v("4.2.9").counts_acquisitions());
        assert!(v("4.3.0").counts_acquisitions());
        assert_eq!(
            v("4.2.9").consumer_timeout_action(true),
            TimeoutAction::CloseChannel
        );
        assert_eq!(
            v("4.3.0").consumer_timeout_action(true),
            TimeoutAction::CancelConsumer
        );
        assert_eq!(
            v("4.3.0").consumer_timeout_action(false),
            TimeoutAction::Ignored
        );
        assert_eq!(v("4.3.2").unset_consumer_timeout_ms(), None);
        assert_eq!(v("4.3.3").unset_consumer_timeout_ms(), Some(86_400_000));
        assert!(!v("4.2.0").refuses_deprecated_features());
        assert!(v("4.3.0").refuses_deprecated_features());
    }
}
