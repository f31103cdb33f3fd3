-- Keys are bytes (VARBINARY): the default collations ignore case and trailing
-- spaces, and even utf8mb4_bin pads with spaces when it compares, so two
-- distinct message ids would be one. Other text compares as utf8mb4_bin.
CREATE TABLE warren_inbox (
    consumer_name  VARBINARY(255) NOT NULL,
    message_id     VARBINARY(255) NOT NULL,
    event_type     TEXT         CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    correlation_id TEXT         CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NULL,
    received_at    DATETIME(6)  NOT NULL,
    processed_at   DATETIME(6)  NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    PRIMARY KEY (consumer_name, message_id),
    INDEX warren_inbox_processed_at (consumer_name, processed_at)
) ENGINE = InnoDB;
