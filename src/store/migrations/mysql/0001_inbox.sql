-- Keys compare as bytes (utf8mb4_bin): the default collations ignore case and
-- trailing spaces, which would make two distinct message ids one.
CREATE TABLE warren_inbox (
    consumer_name  VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    message_id     VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    event_type     TEXT         CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    correlation_id TEXT         CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NULL,
    received_at    DATETIME(6)  NOT NULL,
    processed_at   DATETIME(6)  NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    PRIMARY KEY (consumer_name, message_id),
    INDEX warren_inbox_processed_at (consumer_name, processed_at)
) ENGINE = InnoDB;
