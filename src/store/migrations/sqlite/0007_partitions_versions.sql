-- Partition leases: which instance consumes which partition queue of a
-- partitioned consumer. Times are milliseconds since the epoch, by the clock
-- of the instance that wrote them.
CREATE TABLE warren_partition_leases (
    consumer_name TEXT    NOT NULL,
    partition_no  BIGINT  NOT NULL,
    owner         TEXT    NOT NULL DEFAULT '',
    expires_ms    BIGINT  NOT NULL DEFAULT 0,
    PRIMARY KEY (consumer_name, partition_no)
);

-- The instances of a partitioned consumer that are alive, so that each can
-- work out its fair share of the partitions.
CREATE TABLE warren_partition_members (
    consumer_name TEXT   NOT NULL,
    member        TEXT   NOT NULL,
    expires_ms    BIGINT NOT NULL,
    PRIMARY KEY (consumer_name, member)
);

-- The last applied version per entity, written by the version gate in the
-- business transaction.
CREATE TABLE warren_versions (
    scope   TEXT   NOT NULL,
    entity  TEXT   NOT NULL,
    version BIGINT NOT NULL,
    PRIMARY KEY (scope, entity)
);
