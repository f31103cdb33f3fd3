-- Partition leases: which instance consumes which partition queue of a
-- partitioned consumer. Times are milliseconds since the epoch, by the clock
-- of the instance that wrote them.
CREATE TABLE warren_partition_leases (
    consumer_name VARBINARY(255) NOT NULL,
    partition_no  BIGINT         NOT NULL,
    owner         VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL DEFAULT '',
    expires_ms    BIGINT         NOT NULL DEFAULT 0,
    PRIMARY KEY (consumer_name, partition_no)
) ENGINE = InnoDB;

-- The instances of a partitioned consumer that are alive, so that each can
-- work out its fair share of the partitions.
CREATE TABLE warren_partition_members (
    consumer_name VARBINARY(255) NOT NULL,
    member        VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    expires_ms    BIGINT         NOT NULL,
    PRIMARY KEY (consumer_name, member)
) ENGINE = InnoDB;

-- The last applied version per entity, written by the version gate in the
-- business transaction.
CREATE TABLE warren_versions (
    scope   VARBINARY(255) NOT NULL,
    entity  VARBINARY(255) NOT NULL,
    version BIGINT         NOT NULL,
    PRIMARY KEY (scope, entity)
) ENGINE = InnoDB;
